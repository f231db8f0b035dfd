"""`q8_0`: llama.cpp's 8-bit block type (ggml `block_q8_0`): one fp16 scale per group, signed 8-bit codes, 8.5 bits per
element at G = 32 (ggml's 34 bytes per 32 values).

Arithmetic (per group, fp32; ggml's `quantize_row_q8_0_ref`):

    d    = absmax(group) / 127            code computed with this fp32 d;  stored: fp16(d)
    q    = roundf(x / d)   in [-127, 127]  (x * (1/d), half away from zero; q = 0 where d == 0)
    x'   = q * fp16(d)                    code = q + 128, table[c] = c - 128

Error: |x - x'| <= |d| / 2 + 127 |d - fp16(d)| (the rounding of q, then of the stored scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvq_lab.quant.formats import CodeFormat, register_format
from kvq_lab.quant.formats.ggml import inverse, masked, round_half_away, to_fp16, zero_invalid
from kvq_lab.quant.rounding import div


@register_format("q8_0")
@dataclass(frozen=True)
class Q8_0Format(CodeFormat):
    """llama.cpp's q8_0: codes round(x / d) in [-127, 127] with d = absmax / 127, stored fp16 (module docstring)."""

    name: str = "q8_0"
    supported_bits = (8,)
    params = ("scale",)

    def build_table(self) -> torch.Tensor:
        return torch.arange(256, dtype=torch.float32) - 128  # code c holds q = c - 128

    def _d(self, g: torch.Tensor, valid=None) -> torch.Tensor:
        return div(masked(g.float(), valid, 0.0).abs().amax(-1), 127)

    def quantize_groups(self, g, valid=None):
        x = g.float()
        d = self._d(x, valid)
        q = round_half_away(x * inverse(d).unsqueeze(-1)).clamp(-127, 127)
        return zero_invalid((q + 128).to(torch.uint8), valid), to_fp16(d), None

    def error_bound(self, g, scale, zero):
        d = self._d(g)
        return (d.abs() / 2 + 127 * (d - scale.float()).abs()).unsqueeze(-1).expand(g.shape)
