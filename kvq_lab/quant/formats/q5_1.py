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

import torch

from kvq_lab.quant.formats import CodeFormat, register_format
from kvq_lab.quant.formats.ggml import inverse, masked, to_fp16, zero_invalid
from kvq_lab.quant.rounding import div


@register_format("q5_1")
@dataclass(frozen=True)
class Q5_1Format(CodeFormat):
    """llama.cpp's q5_1: codes trunc((x - min) / d + 0.5), d = (max - min) / 31; d and min stored fp16 (module
    docstring)."""

    name: str = "q5_1"
    supported_bits = (5,)
    params = ("scale", "zero")

    def build_table(self) -> torch.Tensor:
        return torch.arange(32, dtype=torch.float32)

    def _range(self, g: torch.Tensor, valid=None) -> tuple[torch.Tensor, torch.Tensor]:
        x = g.float()
        mn = masked(x, valid, float("inf")).amin(-1)
        mx = masked(x, valid, -float("inf")).amax(-1)
        empty = ~torch.isfinite(mn)  # no valid element: any parameters will do
        mn, mx = torch.where(empty, 0.0, mn), torch.where(empty, 0.0, mx)
        return mn, div(mx - mn, 31)

    def quantize_groups(self, g, valid=None):
        x = g.float()
        mn, d = self._range(x, valid)
        codes = torch.trunc((x - mn.unsqueeze(-1)) * inverse(d).unsqueeze(-1) + 0.5).clamp(0, 31)
        return zero_invalid(codes.to(torch.uint8), valid), to_fp16(d), to_fp16(mn)

    def error_bound(self, g, scale, zero):
        mn, d = self._range(g)
        bound = d.abs() / 2 + 31 * (d - scale.float()).abs() + (mn - zero.float()).abs()
        return bound.unsqueeze(-1).expand(g.shape)
