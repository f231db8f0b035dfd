"""`q5_0`: llama.cpp's 5-bit symmetric block type (ggml `block_q5_0`): one fp16 scale per group, 5-bit codes, 5.5
bits per element at G = 32 (ggml's 22 bytes per 32 values: the low 4 bits of each code in `qs`, the fifth in `qh`;
kvq_lab packs the same codes 8 to a 40-bit word, `kvq_lab.quant.pack`, the same 5 bits per code).

Arithmetic (per group, fp32; ggml's `quantize_row_q5_0_ref`):

    m    = the element of largest magnitude, with its sign
    d    = m / -16                        code computed with this fp32 d;  stored: fp16(d)
    code = min(31, trunc(x / d + 16.5))   (x * (1/d); code 16 where d == 0)
    x'   = (code - 16) * fp16(d)          table[c] = c - 16

q4_0's arithmetic with twice the levels: m itself maps to code 0 (-16 d = m); the other end of the range, +16 d,
has no code, so elements that round there are clamped to code 31 (15 d). Error: |x - x'| <= |d| + 16 |d - fp16(d)|
(a full step at the clamped end, half a step elsewhere, then the rounding of the stored scale).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvq_lab.quant.formats import register_format
from kvq_lab.quant.formats.q4_0 import Q4_0Format


@register_format("q5_0")
@dataclass(frozen=True)
class Q5_0Format(Q4_0Format):
    """llama.cpp's q5_0: codes trunc(x / d + 16.5) clamped to 31, d = signed absmax / -16, stored fp16 (module
    docstring); `q4_0`'s arithmetic, which reads its width from `bits`."""

    name: str = "q5_0"
    supported_bits = (5,)
