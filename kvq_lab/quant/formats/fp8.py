"""`fp8_e4m3`, `fp8_e5m2`: 8-bit floating-point codes times one fp16 scale per group (no zero point).

Arithmetic (per group, fp32; F = the fp8 type's largest finite value, 448 for e4m3, 57344 for e5m2):

    scale = min(fp16_round_up(absmax(group) / F), 65504)     # stored (fp16); scale >= absmax / F
    code  = bits of fp8_round_nearest_even(clamp(x / scale, -F, F))     (x / 1 where scale == 0)
    x'    = table[code] * scale                             # table[c] = the value of fp8 bit pattern c

Rounding the scale *up* keeps |x / scale| <= F, so no element overflows; the clamp acts only on a one-ulp fp32
overshoot of the division, and on groups whose absmax exceeds 65504 * F (fp16 cannot hold their scale: their
largest elements saturate at +-65504 * F instead of becoming inf or NaN). The cast is torch's `.to(float8_*)`
(round to nearest even), so a code is exactly `(x / scale).to(float8).view(uint8)` for every element in range.

Error (exact arithmetic): the fp8 rounding of y = x / scale, |y - fp8(y)| <= 2^-(m+1) |y| for normal y
(m mantissa bits: 3 for e4m3, 2 for e5m2) and <= half the smallest subnormal s_min below that (2^-10 for e4m3,
2^-17 for e5m2), so |x - x'| <= 2^-(m+1) |x| + scale * s_min / 2.

Bit patterns that are not finite (e4m3fn: 0x7F, 0xFF are NaN; e5m2: 0x7C, 0xFC are +-inf, 0x7D-0x7F and
0xFD-0xFF NaN) are never produced as codes; their table entries are 0.0, so even a corrupted code dequantizes
to a finite value. -0.0 (0x80) is a code like any other (small negative values round to it).
Elements outside `valid` get code 0 (+0.0). Micikevicius et al., "FP8 Formats for Deep Learning" (2022).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvq_lab.quant.formats import CodeFormat, register_format
from kvq_lab.quant.rounding import fp16_round_up

DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_FP16_MAX = torch.finfo(torch.float16).max


@register_format("fp8_e5m2")
@register_format("fp8_e4m3")
@dataclass(frozen=True)
class FP8Format(CodeFormat):
    """8-bit float codes (e4m3: more precision, range +-448; e5m2: more range, +-57344) with an absmax scale."""

    bits: int = 8
    name: str = "fp8_e4m3"
    supported_bits = (8,)
    params = ("scale",)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    def build_table(self) -> torch.Tensor:
        t = torch.arange(256, dtype=torch.uint8).view(self.dtype).float()  # [256]: the value of each pattern
        return torch.where(torch.isfinite(t), t, torch.zeros_like(t))  # NaN / inf patterns: never codes

    def quantize_groups(
        self, g: torch.Tensor, valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        """g [..., n, G] -> codes uint8 [..., n, G], scale fp16 [..., n], None (no zero point)."""
        fmax = torch.finfo(self.dtype).max
        x = g.float()
        if valid is not None:
            valid = valid.to(torch.bool)
        a = x.abs() if valid is None else torch.where(valid, x.abs(), 0.0)
        scale = fp16_round_up(a.amax(-1) / fmax).clamp(max=_FP16_MAX)  # [..., n]
        s = scale.float().unsqueeze(-1)
        y = (x / torch.where(s > 0, s, torch.ones_like(s))).clamp(-fmax, fmax)  # scale 0: every element is 0
        if valid is not None:
            y = torch.where(valid, y, 0.0)
        return y.to(self.dtype).view(torch.uint8), scale, None

    def error_bound(self, g: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        """[..., n, G]: 2^-(m+1) |x| + scale * s_min / 2, plus what saturates beyond 65504 * F."""
        fi = torch.finfo(self.dtype)
        s = scale.float().unsqueeze(-1)
        x = g.float().abs()
        s_min = fi.smallest_normal * fi.eps  # smallest subnormal: 2^-9 (e4m3), 2^-16 (e5m2)
        bound = x * (fi.eps / 2) + s * (s_min / 2) + (x - s * fi.max).clamp(min=0)
        # scale 0 only when absmax / F underflows fp32 (absmax < ~1e-42): x' = 0
        return torch.where(s > 0, bound, x)
