"""`q4_0`: llama.cpp's 4-bit symmetric block type (ggml `block_q4_0`): one fp16 scale per group, 4-bit codes, 4.5
bits per element at G = 32 (ggml's 18 bytes per 32 values).

Arithmetic (per group, fp32; ggml's `quantize_row_q4_0_ref`):

    m    = the element of largest magnitude, with its sign
    d    = m / -8                         code computed with this fp32 d;  stored: fp16(d)
    code = min(15, trunc(x / d + 8.5))    (x * (1/d); code 8 where d == 0)
    x'   = (code - 8) * fp16(d)           table[c] = c - 8

m itself maps to code 0 (-8 d = m); the other end of the range, +8 d, has no code, so elements that round there
are clamped to code 15 (7 d). Error: |x - x'| <= |d| + 8 |d - fp16(d)| (a full step at the clamped end, half a step
elsewhere, then the rounding of the stored scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvq_lab.quant.formats import CodeFormat, register_format
from kvq_lab.quant.formats.ggml import inverse, masked, signed_absmax, to_fp16, zero_invalid


@register_format("q4_0")
@dataclass(frozen=True)
class Q4_0Format(CodeFormat):
    """llama.cpp's q4_0: codes trunc(x / d + 8.5) clamped to 15, d = signed absmax / -8, stored fp16 (module
    docstring)."""

    name: str = "q4_0"
    supported_bits = (4,)
    params = ("scale",)

    # q5_0 is the same arithmetic at 5 bits (`q5_0.py`): everything below reads the width from `bits`
    @property
    def half(self) -> int:
        """2^(bits - 1): 8 for q4_0, 16 for q5_0 (the offset of the codes; the signed absmax maps to -half d)."""
        return 1 << (self.bits - 1)

    def build_table(self) -> torch.Tensor:
        return torch.arange(2 * self.half, dtype=torch.float32) - self.half

    def _d(self, g: torch.Tensor, valid=None) -> torch.Tensor:
        return signed_absmax(masked(g.float(), valid, 0.0)) / -self.half  # a power of two: exact on every device

    def quantize_groups(self, g, valid=None):
        x = g.float()
        d = self._d(x, valid)
        codes = torch.trunc(x * inverse(d).unsqueeze(-1) + (self.half + 0.5)).clamp(0, 2 * self.half - 1)
        return zero_invalid(codes.to(torch.uint8), valid), to_fp16(d), None

    def error_bound(self, g, scale, zero):
        d = self._d(g)
        return (d.abs() + self.half * (d - scale.float()).abs()).unsqueeze(-1).expand(g.shape)
