"""`turbo`: TurboQuant's MSE stage (Zandieh et al., "TurboQuant: Online Vector Quantization with Near-optimal
Distortion Rate", arXiv 2504.19874): one norm per vector, each coordinate rounded to a Lloyd-Max codebook.

TurboQuant rotates each vector at random (here a separate transform: `rhadamard`, the randomized Hadamard rotation
the engines use), after which every coordinate of a vector x of n coordinates is distributed alike, close to
N(0, |x|^2 / n). So one scale per vector, s = |x| / sqrt(n), makes the coordinates near standard normal, and a
scalar quantizer optimal for N(0, 1) (Lloyd-Max: each level the mean of its interval, each boundary the midpoint
of its neighbours) is near optimal for each of them. Per group (a group is the vector: `group_size` = the head dim
with per-token groups, `quant=turboquant_mse_<b>b`), fp32:

    s    = |x| / sqrt(n)               n = the group's elements (its valid ones); stored: fp16(s)
    code = index of the level nearest to x / s      (on a midpoint: the lower level; x' = 0 where s == 0)
    x'   = table[code] * fp16(s)       table: the 2^bits Lloyd-Max levels of N(0, 1), computed in float64

Deviation, stated: the paper's levels are optimal for the exact distribution of a coordinate of a random unit
vector in n dimensions (a Beta density on [-1, 1]); these are its limit for large n (the normal), and they do not
depend on the group size. Their distortion per coordinate is what the paper reports for its MSE stage, 0.363 /
0.118 / 0.0345 / 0.0095 at 1 / 2 / 3 / 4 bits (tested). The norm costs one fp16 per vector (16 / n bits per element).

Error: |x - x'| <= s * max(g / 2, |x| / s - t_max) + t_max |s - fp16(s)|, g the largest gap between levels and t_max
the largest level (a coordinate beyond the last level rounds to it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch

from kvq_lab.quant.formats import CodeFormat, register_format
from kvq_lab.quant.formats.ggml import inverse, masked, to_fp16, zero_invalid
from kvq_lab.quant.rounding import div

ITERATIONS = 500


@cache
def lloyd_max_normal(bits: int) -> tuple[float, ...]:
    """The 2^bits Lloyd-Max levels of N(0, 1), ascending (float64 iterations from the normal's quantiles)."""
    n = 1 << bits
    p = torch.arange(1, n + 1, dtype=torch.float64) / (n + 1)
    levels = math.sqrt(2) * torch.erfinv(2 * p - 1)
    for _ in range(ITERATIONS):
        edges = torch.cat([torch.tensor([-math.inf], dtype=torch.float64), (levels[1:] + levels[:-1]) / 2,
                           torch.tensor([math.inf], dtype=torch.float64)])  # fmt: skip
        pdf = torch.exp(-(edges**2) / 2) / math.sqrt(2 * math.pi)
        mass = torch.special.ndtr(edges[1:]) - torch.special.ndtr(edges[:-1])
        levels = (pdf[:-1] - pdf[1:]) / mass  # E[X | interval]
    return tuple(levels.tolist())


def distortion(bits: int) -> float:
    """E[(X - Q(X))^2] of the levels for X ~ N(0, 1) (exact integral of the piecewise quadratic error)."""
    t = torch.tensor(lloyd_max_normal(bits), dtype=torch.float64)
    e = torch.cat([torch.tensor([-math.inf]), (t[1:] + t[:-1]) / 2, torch.tensor([math.inf])]).double()
    pdf = torch.exp(-(e**2) / 2) / math.sqrt(2 * math.pi)
    pdf_e = torch.where(torch.isfinite(e), e * pdf, torch.zeros_like(e))
    mass = torch.special.ndtr(e[1:]) - torch.special.ndtr(e[:-1])
    ex = pdf[:-1] - pdf[1:]  # integral of x phi(x)
    ex2 = mass + pdf_e[:-1] - pdf_e[1:]  # integral of x^2 phi(x)
    return float((ex2 - 2 * t * ex + t * t * mass).sum())


@register_format("turbo")
@dataclass(frozen=True)
class TurboFormat(CodeFormat):
    """TurboQuant's MSE stage: |x| / sqrt(n) per group, Lloyd-Max levels of N(0, 1) per coordinate (module
    docstring). Pair it with `rhadamard` on the same tensor."""

    name: str = "turbo"
    supported_bits = (1, 2, 3, 4)
    default_bits = 3
    params = ("scale",)

    def build_table(self) -> torch.Tensor:
        return torch.tensor(lloyd_max_normal(self.bits), dtype=torch.float32)

    def _scale(self, x: torch.Tensor, valid=None) -> torch.Tensor:
        x = masked(x, valid, 0.0)
        n = x.shape[-1] if valid is None else torch.broadcast_to(valid, x.shape).sum(-1).clamp(min=1)
        norm = x.square().sum(-1).sqrt()
        return div(norm, n**0.5) if valid is None else norm / n.float().sqrt()

    def _nearest(self, y: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(self.midpoints(y.device), y.contiguous())  # on a midpoint: the lower level

    def quantize_groups(self, g, valid=None):
        x = g.float()
        s = self._scale(x, valid)
        codes = self._nearest(x * inverse(s).unsqueeze(-1))
        return zero_invalid(codes.to(torch.uint8), valid), to_fp16(s), None

    def error_bound(self, g, scale, zero):
        x = g.float()
        s = self._scale(x).unsqueeze(-1)
        t = self.table(g.device)
        gap, top = float((t[1:] - t[:-1]).max()), float(t.abs().max())
        inner = s * torch.maximum(torch.full_like(x, gap / 2), x.abs() * inverse(s) - top)
        return inner + top * (s - scale.float().unsqueeze(-1)).abs()
