"""`int`: asymmetric uniform integer codes, KIVI's arithmetic, as a code format: table[c] = c, x' = c * scale + zero.

Arithmetic (per group of G values, fp32; L = 2^bits - 1):

    zero  = fp16_round_down(min(group))                 # stored zero point (fp16), <= every element
    scale = fp16_round_up((max(group) - zero) / L)      # stored step (fp16)
    code  = clamp(round_half_even((x - zero) / scale), 0, L)      (code = 0 where scale == 0)
    x'    = code * scale + zero                         (two roundings, no fma)

Rounding the stored parameters *outwards* (zero down, scale up) keeps every element of the group inside the
representable range, so no code is clamped and every element's error is at most half a step: |x - x'| <= scale / 2
(up to fp32 rounding). KIVI rounds its fp16 parameters to nearest instead; the difference is below one fp16 ulp
of the parameters. A zero-width group (max == min, e.g. all zeros) gets scale 0 and reproduces its value exactly
instead of dividing by zero. Elements outside `valid` do not enter min/max and get code 0; a group with no valid
element gets scale 0 and zero 0.

This is the arithmetic `kvq_lab.quant.reference.quantize` had before formats existed, operation for operation, so
its results are bit for bit the same (tested against a frozen copy in tests/quant/test_format_matrix.py); the fast
whole-group path (`kvq_lab.kernels.torch_path.quantize_whole_groups`) and the Triton kernel are tested against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvq_lab.quant.formats import CodeFormat, register_format
from kvq_lab.quant.rounding import div, fp16_round_down, fp16_round_up
from kvq_lab.quant.spec import DEFAULT_BITS, INT_BITS


@register_format("int")
@dataclass(frozen=True)
class IntFormat(CodeFormat):
    """Asymmetric uniform integer quantization (KIVI's): L = 2^bits - 1 steps of fp16 `scale` above fp16 `zero`.

    zero = fp16_round_down(min), scale = fp16_round_up((max - zero) / L), code = round_half_even((x - zero) / scale)
    clamped to [0, L]; every element's error is at most scale / 2.
    """

    name: str = "int"
    supported_bits = INT_BITS
    default_bits = DEFAULT_BITS
    params = ("scale", "zero")
    codes_are_values = True

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def build_table(self) -> torch.Tensor:
        return torch.arange(1 << self.bits, dtype=torch.float32)  # [2^bits]: code c is worth c steps

    def quantize_groups(
        self, g: torch.Tensor, valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """g [..., n, G] -> codes uint8 [..., n, G], scale fp16 [..., n], zero fp16 [..., n]."""
        g = g.float()
        if valid is None:
            mn, mx = g.amin(-1), g.amax(-1)  # [..., n]
        else:
            valid = torch.broadcast_to(valid.to(torch.bool), g.shape)
            mn = torch.where(valid, g, float("inf")).amin(-1)
            mx = torch.where(valid, g, -float("inf")).amax(-1)
            empty = ~valid.any(-1)  # a group of padding only: any params will do
            mn = torch.where(empty, 0.0, mn)
            mx = torch.where(empty, 0.0, mx)
        zero = fp16_round_down(mn)
        scale = fp16_round_up(div(mx - zero.float(), self.levels))
        s = scale.float().unsqueeze(-1)
        safe = torch.where(s > 0, s, torch.ones_like(s))
        codes = torch.round((g - zero.float().unsqueeze(-1)) / safe).clamp_(0, self.levels)
        codes = torch.where(s > 0, codes, torch.zeros_like(codes))
        if valid is not None:
            codes = torch.where(valid, codes, torch.zeros_like(codes))
        return codes.to(torch.uint8), scale, zero

    def dequantize_groups(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        """codes [..., n, G], scale/zero [..., n] -> fp32 [..., n, G] = code * scale + zero (the code is its own
        table entry: no lookup)."""
        if zero is None:
            return super().dequantize_groups(codes, scale, zero)  # the base class names the missing zero point
        return codes.float() * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)

    def error_bound(self, g: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        """Half a step: [..., n, G] (the outward-rounded parameters keep every element inside the grid)."""
        return (scale.float() / 2).unsqueeze(-1).expand(g.shape)
