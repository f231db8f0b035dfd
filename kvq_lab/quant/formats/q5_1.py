"""`q5_1`: llama.cpp's 5-bit asymmetric block type (ggml `block_q5_1`): an fp16 scale and an fp16 minimum per group,
5-bit codes, 6 bits per element at G = 32 (ggml's 24 bytes per 32 values: the low 4 bits of each code in `qs`, the
fifth in `qh`; kvq_lab packs the same codes 8 to a 40-bit word, `kvq_lab.quant.pack`, the same 5 bits per code).

Arithmetic (per group, fp32; ggml's `quantize_row_q5_1_ref`):

    d    = (max - min) / 31               code computed with this fp32 d and min;  stored: fp16(d), fp16(min)
    code = min(31, trunc((x - min) / d + 0.5))      ((x - min) * (1/d); code 0 where d == 0)
    x'   = code * fp16(d) + fp16(min)     table[c] = c

q4_1's arithmetic with twice the levels. Error: |x - x'| <= |d| / 2 + 31 |d - fp16(d)| + |min - fp16(min)| (the
rounding of the code, then of the two stored parameters; nothing is clamped: the codes span [min, max] exactly in
fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvq_lab.quant.formats import register_format
from kvq_lab.quant.formats.q4_1 import Q4_1Format


@register_format("q5_1")
@dataclass(frozen=True)
class Q5_1Format(Q4_1Format):
    """llama.cpp's q5_1: codes trunc((x - min) / d + 0.5), d = (max - min) / 31; d and min stored fp16 (module
    docstring); `q4_1`'s arithmetic, which reads its width from `bits`."""

    name: str = "q5_1"
    supported_bits = (5,)
