"""`iq4_nl`: llama.cpp's non-linear 4-bit block type (ggml `block_iq4_nl`): 16 fixed code values, one fp16 scale per
group, 4.5 bits per element at G = 32 (ggml's 18 bytes per 32 values), quantized as llama.cpp quantizes a KV cache.

Table: ggml's `kvalues_iq4nl` = -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113 (denser
near zero, as the values of a bell-shaped distribution are). x' = table[code] * fp16(d).

Which quantizer. ggml has two for this type. A cache row is written through the CPU type traits' `from_float`,
`quantize_row_iq4_nl` -> `quantize_row_iq4_nl_ref`, which calls `quantize_row_iq4_nl_impl` with ntry = -1: no scale
search. A model file's weights go through `quantize_iq4_nl` (ntry = 7, a search over 15 starting scales, then the
codes again with the best scale). kvq_lab is a KV-cache tool, so `iq4_nl` is the cache's (b11434's ggml-quants.c).
The difference matters: kvq_lab carried the weights' search before, which on Gemma-3-270M with llama.cpp's Hadamard
rotation lost 0.147 mean KLD where llama.cpp's cache loses 0.085 and the cache's quantizer here 0.083
(experiments/frontier/README.md), although its squared error on Gaussian blocks is 6% lower.

The cache's quantizer (per group, fp32): weights w = x^2; m = the element of largest magnitude with its sign (the
first on a tie; a group with |m| < 1e-15 gets d = 0 and codes 0); d0 = m / -127, so m lands on the table's longer
end; codes c = nearest(x * (1 / d0)), nearest(v) = the index of the table value nearest to v (ties to the larger
value, values beyond the ends to the ends); the stored scale is the weighted least-squares one for those codes,
d = sum(w q x) / sum(w q^2) with q = table[c] (0 if the sum is 0), rounded to fp16. The codes are not recomputed
with d. tests/quant/test_ggml_formats.py checks codes and scale bytes against ggml's own C (a fixture its script
regenerates from llama.cpp's source).

Error (`error_bound`): x / d0 lies in [-127, 127], so |x - table[c] d0| <= 12 |d0| (half the largest gap, 89 to
113) up to 113 and 14 |d0| above it; with the fitted, stored scale d, |x - table[c] d| <= 14 |d0| + 127 |d - d0|.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from kvq_lab.quant.formats import CodeFormat, register_format
from kvq_lab.quant.formats.ggml import masked, signed_absmax, to_fp16, zero_invalid
from kvq_lab.quant.rounding import div

VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
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


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 codes [..., n, G], fp32 scales [..., n]) of llama.cpp's cache quantizer for each group of x (module
    docstring): codes from d0 = m / -127, the scale fitted to them by weighted least squares."""
    m = signed_absmax(x)
    ok = m.abs() >= GROUP_MAX_EPS
    d0 = div(torch.where(ok, m, torch.ones_like(m)), VALUES[0])
    codes = torch.where(ok.unsqueeze(-1), nearest(x * (torch.ones_like(d0) / d0).unsqueeze(-1)), 0)
    q = _values(str(x.device))[codes]
    w = x * x
    sqx, sq2 = (w * q * x).sum(-1), (w * q * q).sum(-1)
    d = torch.where(sq2 > 0, sqx / torch.where(sq2 > 0, sq2, 1.0), 0.0)
    return codes, torch.where(ok, d, torch.zeros_like(d))


@register_format("iq4_nl")
@dataclass(frozen=True)
class IQ4NLFormat(CodeFormat):
    """llama.cpp's iq4_nl as its KV cache quantizes it: 16 fixed non-uniform values times one fp16 scale fitted to
    the codes (module docstring)."""

    name: str = "iq4_nl"
    supported_bits = (4,)
    params = ("scale",)

    def build_table(self) -> torch.Tensor:
        return torch.tensor(VALUES, dtype=torch.float32)

    def quantize_groups(self, g, valid=None):
        x = masked(g.float(), valid, 0.0)  # a zero has weight 0 and magnitude 0: it changes no statistic
        codes, d = quantize(x)
        return zero_invalid(codes.to(torch.uint8), valid), to_fp16(d), None

    def error_bound(self, g, scale, zero):
        # |x - q d| <= |x - q d0| + |q| |d - d0|: x / d0 lies in [-127, 127], at most 12 from a table value inside
        # [-127, 113] and 14 above it; |q| <= 127; d is the stored scale
        m = signed_absmax(g.float())
        d0 = div(m, VALUES[0])
        return (14 * d0.abs() + 127 * (scale.float() - d0).abs()).unsqueeze(-1).expand(g.shape)
