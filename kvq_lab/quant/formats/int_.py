"""`int`: asymmetric uniform integer codes, today's arithmetic (the `kvq_lab.quant.reference` docstring is its
specification), as a code format: table[c] = c, so x' = c * scale + zero bit for bit as `reference.dequantize`.

Quantization delegates to `reference.quantize` itself, so the two cannot drift apart: each group of G values
becomes one per-channel group of a [n_groups, 1, G, 1] tensor, where `valid` can mask single elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvq_lab.quant import reference
from kvq_lab.quant.formats import CodeFormat, register_format
from kvq_lab.quant.spec import QuantSpec


@register_format("int")
@dataclass(frozen=True)
class IntFormat(CodeFormat):
    """Asymmetric uniform integer quantization (KIVI's): L = 2^bits - 1 steps of fp16 `scale` above fp16 `zero`.

    zero = fp16_round_down(min), scale = fp16_round_up((max - zero) / L), code = round_half_even((x - zero) / scale)
    clamped to [0, L]; every element's error is at most scale / 2.
    """

    name: str = "int"
    supported_bits = (1, 2, 3, 4, 8)
    params = ("scale", "zero")

    def build_table(self) -> torch.Tensor:
        return torch.arange(1 << self.bits, dtype=torch.float32)  # [2^bits]: code c is worth c steps

    def quantize_groups(
        self, g: torch.Tensor, valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """g [..., n, G] -> codes uint8 [..., n, G], scale fp16 [..., n], zero fp16 [..., n]."""
        *lead, n, G = g.shape
        x = g.reshape(-1, 1, G, 1)  # [N, 1, G, 1]: batch row i is group i, its G elements run along tokens
        v = None if valid is None else valid.to(torch.bool).expand(g.shape).reshape(-1, 1, G)  # [N, 1, G]
        q = reference.quantize(x, QuantSpec(self.bits, G, "channel"), valid=v)
        return q.codes.reshape(*lead, n, G), q.scale.reshape(*lead, n), q.zero.reshape(*lead, n)

    def error_bound(self, g: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        """Half a step: [..., n, G] (the outward-rounded parameters keep every element inside the grid)."""
        return (scale.float() / 2).unsqueeze(-1).expand(g.shape)
