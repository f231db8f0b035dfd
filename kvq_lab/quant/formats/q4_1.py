"""`q4_1`: llama.cpp's 4-bit asymmetric block type (ggml `block_q4_1`): an fp16 scale and an fp16 minimum per group,
4-bit codes, 5 bits per element at G = 32 (ggml's 20 bytes per 32 values).

Arithmetic (per group, fp32; ggml's `quantize_row_q4_1_ref`):

    d    = (max - min) / 15               code computed with this fp32 d and min;  stored: fp16(d), fp16(min)
    code = min(15, trunc((x - min) / d + 0.5))      ((x - min) * (1/d); code 0 where d == 0)
    x'   = code * fp16(d) + fp16(min)     table[c] = c

Error: |x - x'| <= |d| / 2 + 15 |d - fp16(d)| + |min - fp16(min)| (the rounding of the code, then of the two
stored parameters; nothing is clamped: the codes span [min, max] exactly in fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvq_lab.quant.formats import CodeFormat, register_format
from kvq_lab.quant.formats.ggml import inverse, masked, to_fp16, zero_invalid
from kvq_lab.quant.rounding import div


@register_format("q4_1")
@dataclass(frozen=True)
class Q4_1Format(CodeFormat):
    """llama.cpp's q4_1: codes trunc((x - min) / d + 0.5), d = (max - min) / 15; d and min stored fp16 (module
    docstring)."""

    name: str = "q4_1"
    supported_bits = (4,)
    params = ("scale", "zero")

    # q5_1 is the same arithmetic at 5 bits (`q5_1.py`): everything below reads the width from `bits`
    @property
    def levels(self) -> int:
        """2^bits - 1: 15 for q4_1, 31 for q5_1."""
        return (1 << self.bits) - 1

    def build_table(self) -> torch.Tensor:
        return torch.arange(self.levels + 1, dtype=torch.float32)

    def _range(self, g: torch.Tensor, valid=None) -> tuple[torch.Tensor, torch.Tensor]:
        x = g.float()
        mn = masked(x, valid, float("inf")).amin(-1)
        mx = masked(x, valid, -float("inf")).amax(-1)
        empty = ~torch.isfinite(mn)  # no valid element: any parameters will do
        mn, mx = torch.where(empty, 0.0, mn), torch.where(empty, 0.0, mx)
        return mn, div(mx - mn, self.levels)

    def quantize_groups(self, g, valid=None):
        x = g.float()
        mn, d = self._range(x, valid)
        codes = torch.trunc((x - mn.unsqueeze(-1)) * inverse(d).unsqueeze(-1) + 0.5).clamp(0, self.levels)
        return zero_invalid(codes.to(torch.uint8), valid), to_fp16(d), to_fp16(mn)

    def error_bound(self, g, scale, zero):
        mn, d = self._range(g)
        bound = d.abs() / 2 + self.levels * (d - scale.float()).abs() + (mn - zero.float()).abs()
        return bound.unsqueeze(-1).expand(g.shape)
