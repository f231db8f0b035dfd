"""The packed storage layout's arithmetic, in plain integers (no torch): block size, words, rows.

`kvq_lab.quant.pack` packs and unpacks along this layout (its docstring draws it); the format registry
(`kvq_lab.quant.formats`) counts bytes with it without importing torch.
"""

from __future__ import annotations

import math

BLOCK = 32  # tokens per packing block: a multiple of every word's code count (8 at most)


PACKABLE_BITS = (1, 2, 3, 4, 5, 8)  # code widths the layout packs without a wasted bit


def word_layout(bits: int) -> tuple[int, int]:
    """(u, nb): codes per word and bytes per word. 1 -> (8, 1), 2 -> (4, 1), 3 -> (8, 3), 4 -> (2, 1), 5 -> (8, 5),
    8 -> (1, 1). A word is the smallest whole number of bytes holding whole codes: 8 * nb = u * bits."""
    if bits not in PACKABLE_BITS:
        raise ValueError(f"cannot pack bits={bits}; allowed: {', '.join(map(str, PACKABLE_BITS))}")
    u = 8 // math.gcd(bits, 8)
    return u, bits * u // 8


def padded_tokens(n_tokens: int, block: int = BLOCK) -> int:
    """Tokens of storage that `n_tokens` occupy: whole blocks."""
    return -(-n_tokens // block) * block


def packed_rows(n_tokens: int, bits: int, block: int = BLOCK) -> int:
    """Byte rows (of D bytes each) holding `n_tokens` tokens: whole blocks of `block * bits / 8` rows."""
    return padded_tokens(n_tokens, block) * bits // 8
