"""`lut`: 2^bits arbitrary code values (a sorted codebook) under a per-group fp16 (scale, zero) normalisation.

The base of non-uniform codes (NormalFloat, QLoRA; k-means codebooks per layer, KVQuant's "nuq"): a codebook
of 2^bits sorted values is given at construction (a k-means fit later); by default it is NormalFloat, QLoRA's
construction for any bit width (`normal_float_codebook`: quantiles of N(0, 1) with an exact 0, 4 bits gives
bitsandbytes' NF4 values).

Table: the codebook mapped affinely onto [0, 1], t_0 = 0 < t_1 < ... < t_last = 1 (fp32). Per-group scale and
zero absorb any affine map, so this loses nothing, and the fixed range makes the parameter rule the `int` one
with L = 1. Arithmetic (per group, fp32):

    zero  = fp16_round_down(min(group))             # stored (fp16), <= every element
    scale = fp16_round_up(max(group) - zero)        # stored (fp16): the group spans [zero, zero + scale]
    u     = (x - zero) / scale                      # in [0, 1]   (u = 0 where scale == 0)
    code  = index of the table entry nearest to u, decided by the fp32 midpoints m_i = (t_i + t_{i+1}) / 2:
            code = #{i: m_i < u}, and u exactly on a midpoint goes to the even index (round half to even,
            as `int` rounds; with a uniform codebook the two pick the same codes up to parameter rounding)
    x'    = table[code] * scale + zero

The outward-rounded parameters keep every u inside [0, 1], so |x - x'| <= scale * max_gap / 2, where max_gap
is the largest distance between adjacent table entries (measured to the fp32 midpoints: `half_gap`).
Elements outside `valid` get code 0; a group with no valid element gets scale 0 and zero 0.
The table is stored once per tensor or layer (`table_bytes`: fp32, 4 * 2^bits bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from kvq_lab.quant.formats import CodeFormat, register_format
from kvq_lab.quant.rounding import fp16_round_down, fp16_round_up
from kvq_lab.quant.spec import QuantConfigError


def normal_float_codebook(bits: int) -> tuple[float, ...]:
    """NormalFloat (Dettmers et al., QLoRA 2023, bitsandbytes `create_normal_map`) for any width, in [-1, 1].

    2^(b-1) positive quantiles of N(0, 1) at probabilities linspace(p, 1/2, 2^(b-1) + 1) (the last dropped),
    2^(b-1) - 1 negative ones at linspace(p, 1/2, 2^(b-1)), and an exact 0, divided by the largest magnitude;
    p = ((1 - 1/(2(2^b - 1))) + (1 - 1/(2^(b+1)))) / 2 (QLoRA's 0.9677 at 4 bits). Computed in float64.
    """
    n = 1 << bits
    p = ((1 - 1 / (2 * (n - 1))) + (1 - 1 / (2 * n))) / 2
    pos = torch.special.ndtri(torch.linspace(p, 0.5, n // 2 + 1, dtype=torch.float64)[:-1])
    neg = -torch.special.ndtri(torch.linspace(p, 0.5, n // 2, dtype=torch.float64)[:-1])
    v = torch.cat([neg, torch.zeros(1, dtype=torch.float64), pos]).sort().values
    return tuple((v / v.abs().max()).tolist())


@register_format("lut")
@dataclass(frozen=True)
class LUTFormat(CodeFormat):
    """Non-uniform codes: 2^bits sorted codebook values, each group scaled and shifted onto the codebook's range.

    codebook: 2^bits strictly increasing finite numbers (any range: only their relative spacing matters), or None
    for NormalFloat (`normal_float_codebook(bits)`).
    """

    name: str = "lut"
    codebook: tuple[float, ...] | None = None
    supported_bits = (1, 2, 3, 4, 8)
    default_bits = 2  # as int's, so `format=lut` changes the code values and nothing else
    params = ("scale", "zero")

    def __post_init__(self):
        super().__post_init__()
        if self.codebook is None:
            return
        n = 1 << self.bits
        try:
            cb = tuple(float(v) for v in self.codebook)  # lists and config sequences become a hashable tuple
        except (TypeError, ValueError):
            raise QuantConfigError(f"codebook={self.codebook!r} must be a sequence of {n} numbers") from None
        object.__setattr__(self, "codebook", cb)
        if len(cb) != n:
            raise QuantConfigError(f"codebook has {len(cb)} values; format=lut with bits={self.bits} needs {n}")
        if not all(map(math.isfinite, cb)):
            raise QuantConfigError(f"codebook={cb} has a non-finite value; give finite numbers")
        t = self._normalized()
        if not bool((t[1:] > t[:-1]).all()):
            i = int((t[1:] <= t[:-1]).nonzero()[0])
            raise QuantConfigError(
                f"codebook entries {i} and {i + 1} ({cb[i]}, {cb[i + 1]}) are not strictly increasing in fp32 "
                "after mapping onto [0, 1]; give sorted, well separated values"
            )

    def _normalized(self) -> torch.Tensor:
        """fp32 [2^bits]: the codebook mapped affinely onto [0, 1] (in float64, so t_0 = 0 and t_last = 1 exactly)."""
        cb = torch.tensor(self.codebook or normal_float_codebook(self.bits), dtype=torch.float64)
        return ((cb - cb[0]) / (cb[-1] - cb[0])).float()

    @property
    def table_bytes(self) -> int:
        return 4 * (1 << self.bits)  # fp32, once per tensor or layer

    @cached_property
    def half_gap(self) -> float:
        """Largest distance from a table entry to a midpoint next to it (max_gap / 2 up to fp32 midpoints)."""
        t = self.table().double()
        m = self.midpoints().double()
        return float(torch.maximum(m - t[:-1], t[1:] - m).max())

    def build_table(self) -> torch.Tensor:
        return self._normalized()

    def quantize_groups(
        self, g: torch.Tensor, valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """g [..., n, G] -> codes uint8 [..., n, G], scale fp16 [..., n], zero fp16 [..., n]."""
        x = g.float()
        if valid is None:
            mn, mx = x.amin(-1), x.amax(-1)  # [..., n]
        else:
            valid = torch.broadcast_to(valid.to(torch.bool), x.shape)
            mn = torch.where(valid, x, float("inf")).amin(-1)
            mx = torch.where(valid, x, -float("inf")).amax(-1)
            empty = ~valid.any(-1)  # no valid element: any parameters will do
            mn, mx = torch.where(empty, 0.0, mn), torch.where(empty, 0.0, mx)
        zero = fp16_round_down(mn)
        scale = fp16_round_up(mx - zero.float())
        z, s = zero.float().unsqueeze(-1), scale.float().unsqueeze(-1)  # [..., n, 1]
        u = (x - z) / torch.where(s > 0, s, torch.ones_like(s))  # [..., n, G], in [0, 1] where valid
        m = self.midpoints(g.device)
        u = u.contiguous()  # [..., n, G]: searchsorted copies a strided input anyway
        lo = torch.searchsorted(m, u)  # midpoints < u
        hi = torch.searchsorted(m, u, right=True)  # midpoints <= u: hi = lo + 1 exactly on a midpoint
        codes = torch.where((hi > lo) & (lo % 2 == 1), hi, lo)  # a tie goes to the even index
        keep = s > 0 if valid is None else (s > 0) & valid
        codes = torch.where(keep, codes, torch.zeros_like(codes))
        return codes.to(torch.uint8), scale, zero

    def error_bound(self, g: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        """[..., n, G]: scale * max_gap / 2."""
        return (scale.float() * self.half_gap).unsqueeze(-1).expand(g.shape)
