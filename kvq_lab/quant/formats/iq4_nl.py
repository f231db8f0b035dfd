"""`iq4_nl`: llama.cpp's non-linear 4-bit block type (ggml `block_iq4_nl`): 16 fixed code values, one fp16 scale per
group chosen by a small search, 4.5 bits per element at G = 32 (ggml's 18 bytes per 32 values).

Table: ggml's `kvalues_iq4nl` = -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113 (denser
near zero, as the values of a bell-shaped distribution are). x' = table[code] * fp16(d).

Scale search (per group, fp32; ggml's `quantize_row_iq4_nl_impl` with block 32, no importance weights, ntry = 7):
weights w = x^2; m = the element of largest magnitude with its sign (a group with |m| < 1e-15 gets d = 0);
nearest(v) = the index of the table value nearest to v (ties to the larger value, values beyond the ends to the
ends). Start from d = m / 127: codes c = nearest(x / d) give the least-squares scale d = sum(w q x) / sum(w q^2)
(q = table[c]) and its score sum(w q x)^2 / sum(w q^2). Then for t = -7..7 the codes nearest((t - 127) x / m) give
a candidate scale the same way; a candidate with a higher score replaces d. Final codes: nearest(x / d), with
the fp32 d; stored: fp16(d).

The search's sums run in another order than ggml's loops, so a scale can differ from ggml's in its last fp32 bits
(and rarely a code); the `gguf` package has no iq4_nl quantizer to compare against, only the dequantizer, which
the tests check this table and formula against. Error (exact arithmetic): the code is the nearest table value to
x / d, so |x - x'| <= 12 |d| (half the largest gap, 89 to 113) inside the table's range, and |x| - 113 |d| beyond
it, plus 127 |d - fp16(d)| for the stored scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from kvq_lab.quant.formats import CodeFormat, register_format
from kvq_lab.quant.formats.ggml import inverse, masked, signed_absmax, to_fp16, zero_invalid
from kvq_lab.quant.rounding import div

VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
TRIES = 7
GROUP_MAX_EPS = 1e-15


@cache
def _values(device: str) -> torch.Tensor:
    return torch.tensor(VALUES, dtype=torch.float32, device=device)


def nearest(v: torch.Tensor) -> torch.Tensor:
    """int64 index of the table value nearest to each v (ggml's `best_index_int8`: ties go to the larger value)."""
    vals = _values(str(v.device))
    hi = torch.searchsorted(vals, v.contiguous(), right=True).clamp(1, len(VALUES) - 1)  # vals[hi-1] <= v < vals[hi]
    lo = hi - 1
    down = (v - vals[lo]) < (vals[hi] - v)
    idx = torch.where(down, lo, hi)
    return torch.where(v <= vals[0], 0, torch.where(v >= vals[-1], len(VALUES) - 1, idx))


def _fit(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum w q x, sum w q^2) over each group for codes c, and the least-squares scale (0 where the sums are 0)."""
    q = _values(str(x.device))[c]
    sqx, sq2 = (w * q * x).sum(-1), (w * q * q).sum(-1)
    return sqx, sq2, torch.where(sq2 > 0, sqx / torch.where(sq2 > 0, sq2, 1.0), 0.0)


def search_scale(x: torch.Tensor) -> torch.Tensor:
    """fp32 [..., n]: the scale ggml's search picks for each group of x [..., n, G] (module docstring)."""
    w = x * x
    m = signed_absmax(x)
    ok = m.abs() >= GROUP_MAX_EPS
    m_safe = torch.where(ok, m, torch.ones_like(m))
    d0 = div(-m_safe, VALUES[0])
    sqx, sq2, d = _fit(x, w, nearest(x * (1 / d0).unsqueeze(-1)))
    best = d * sqx
    for t in range(-TRIES, TRIES + 1):
        s_id = (t + VALUES[0]) / m_safe
        sqx, sq2, cand = _fit(x, w, nearest(x * s_id.unsqueeze(-1)))
        better = (sq2 > 0) & (sqx * sqx > best * sq2)
        d = torch.where(better, cand, d)
        best = torch.where(better, cand * sqx, best)
    return torch.where(ok, d, torch.zeros_like(d))


@register_format("iq4_nl")
@dataclass(frozen=True)
class IQ4NLFormat(CodeFormat):
    """llama.cpp's iq4_nl: 16 fixed non-uniform values times one fp16 scale found by a small search (module
    docstring)."""

    name: str = "iq4_nl"
    supported_bits = (4,)
    params = ("scale",)

    def build_table(self) -> torch.Tensor:
        return torch.tensor(VALUES, dtype=torch.float32)

    def quantize_groups(self, g, valid=None):
        x = masked(g.float(), valid, 0.0)  # a zero has weight 0 and magnitude 0: it changes no statistic
        d = search_scale(x)
        codes = nearest(x * inverse(d).unsqueeze(-1))
        return zero_invalid(codes.to(torch.uint8), valid), to_fp16(d), None

    def error_bound(self, g, scale, zero):
        x = g.float()
        d = search_scale(x).abs().unsqueeze(-1)
        beyond = x.abs() - VALUES[-1] * d  # past the last value (113): the code is an end of the table
        inner = torch.maximum(12 * d, beyond)
        return inner + 127 * (d - scale.float().abs().unsqueeze(-1)).abs()
