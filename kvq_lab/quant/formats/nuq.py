"""`nuq`: KVQuant's non-uniform datatype (Hooper et al. 2024, "KVQuant", section 3.4): a per-layer codebook of
2^bits levels fitted by sensitivity-weighted k-means on calibration data, stored and executed as the `lut` format.

The format is `lut` with another name and a narrower width (1-4 bits, as KVQuant's 2-4): the same table formula, the
same per-group (scale, zero), the same kernels. Its codebook is what differs: `kvq_lab.fit.calibration` fits one per
layer and tensor with `fit_codebook` and hands the cache layer a `lut` spec holding it (`CacheConfig.layers`), so
what runs and what is stored is `lut` with that codebook. Without calibration (a cache built directly from a
config) `nuq` is lut's default, NormalFloat.

Fitting, in the space the table lives in: every group is mapped onto [0, 1] by its own (zero, scale) (lut's
arithmetic), so the group's min and max land on 0 and 1 exactly. The codebook keeps those two levels (t_0 = 0 and
t_last = 1 must be in the table: lut maps its first and last entries onto the group's range) and fits the
2^bits - 2 interior levels by weighted Lloyd iterations on the normalized values u of the calibration groups:

    assign   each u to its nearest level (the two fixed ones included)
    update   each interior level <- sum(w * u) / sum(w) over the u assigned to it (unchanged when none are)

Weights: KVQuant weights each element by a Fisher-information approximation, its squared gradient g^2 on the
calibration text; the error that matters is in x = u * scale + zero, so an element's weight in u-space is
g^2 * scale^2 (`fit` computes both from what calibration captures; any nonnegative weights work here). Initial
levels: the weighted quantiles of u, so an empty level is rare; Lloyd's iterations only lower the weighted squared
error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvq_lab.quant.formats import register_format
from kvq_lab.quant.formats.lut import LUTFormat

MIN_GAP = 1e-4  # fitted levels stay this far apart (lut needs strictly increasing entries in fp32)
MAX_FIT_VALUES = 400_000  # normalized values per layer and tensor handed to k-means (a seeded subsample beyond)


@register_format("nuq")
@dataclass(frozen=True)
class NUQFormat(LUTFormat):
    """KVQuant's non-uniform codes: `lut` at 1-4 bits whose codebook is fitted per layer by `fit_codebook`
    (calibration); NormalFloat where none is fitted. See the module docstring."""

    name: str = "nuq"
    supported_bits = (1, 2, 3, 4)
    default_bits = 3  # KVQuant's headline width
    allows_identity = False  # nuq at 16 bits would fit nothing: an error, not a silent fp16 cache
    fitted = True

    def fit(self, spec, x, g, mask=None):
        """A `lut` spec holding the codebook fitted on x (weights g^2 * range^2, `mask`ed outliers left out; at most
        MAX_FIT_VALUES normalized values, a seeded subsample beyond). See the module docstring."""
        from kvq_lab.quant.spec import QuantSpec

        u, w = normalized(x, g, spec, mask)
        if u.numel() > MAX_FIT_VALUES:
            pick = torch.randperm(u.numel(), generator=torch.Generator().manual_seed(0))[:MAX_FIT_VALUES]
            u, w = u[pick], w[pick]
        return QuantSpec(spec.bits, spec.group_size, spec.axis, "lut", fit_codebook(u, w, spec.bits))


def normalized(x, g, spec, mask):
    """Group-normalized values u in [0, 1] and their weights g^2 * range^2 (the lut parameter rule, outliers out of
    min/max and out of the fit): x, g [1, H, T, D] fp32, mask bool or None -> u, w fp32 [N]."""
    from kvq_lab.quant.groups import grouped

    G = spec.group_size
    T = x.shape[2] // G * G if spec.axis == "channel" else x.shape[2]
    x, g = x[:, :, :T], g[:, :, :T]
    keep = torch.ones_like(x, dtype=torch.bool) if mask is None else ~mask[:, :, :T]
    xg, gg, kg = grouped(x, spec), grouped(g, spec), grouped(keep, spec)
    mn = torch.where(kg, xg, float("inf")).amin(-1, keepdim=True)
    mx = torch.where(kg, xg, -float("inf")).amax(-1, keepdim=True)
    r = mx - mn
    ok = kg & (r > 0)
    u = ((xg - mn) / torch.where(r > 0, r, 1.0))[ok]
    w = (gg.pow(2) * r.pow(2)).expand_as(xg)[ok]
    return u, w


def fit_codebook(
    u: torch.Tensor, w: torch.Tensor | None, bits: int, iters: int = 30, seed_levels: torch.Tensor | None = None
) -> tuple[float, ...]:
    """Weighted k-means levels on [0, 1] with 0 and 1 fixed: u, w fp32 [N] (w >= 0; None: all 1) -> 2^bits sorted
    floats, strictly increasing by at least MIN_GAP (a lut codebook). See the module docstring.

    seed_levels: fp32 [2^bits - 2] initial interior levels (default: the weighted quantiles of u)."""
    n = 1 << bits
    u = u.detach().float().flatten().clamp(0, 1)
    w = torch.ones_like(u) if w is None else w.detach().float().flatten().clamp(min=0)
    if u.numel() != w.numel():
        raise ValueError(f"fit_codebook: {u.numel()} values but {w.numel()} weights")
    if n == 2:
        return (0.0, 1.0)
    if float(w.sum()) <= 0:
        w = torch.ones_like(u)
    inner = n - 2
    if seed_levels is None:
        order = u.argsort()
        cw = w[order].cumsum(0)
        targets = torch.arange(1, inner + 1, dtype=torch.float32) / (inner + 1) * cw[-1]
        idx = torch.searchsorted(cw, targets).clamp(max=u.numel() - 1)
        levels = u[order][idx]
    else:
        levels = seed_levels.float().clone()
    levels = _separate(levels)
    for _ in range(iters):
        table = torch.cat([levels.new_zeros(1), levels, levels.new_ones(1)])  # [n]
        mids = (table[:-1] + table[1:]) / 2
        code = torch.searchsorted(mids, u)  # [N] in 0..n-1
        sw = torch.zeros(n).index_add_(0, code, w)
        swu = torch.zeros(n).index_add_(0, code, w * u)
        new = torch.where(sw[1:-1] > 0, swu[1:-1] / sw[1:-1].clamp(min=1e-30), levels)
        new = _separate(new)
        if torch.equal(new, levels):
            break
        levels = new
    return (0.0, *levels.tolist(), 1.0)


def _separate(levels: torch.Tensor) -> torch.Tensor:
    """Interior levels sorted and kept MIN_GAP apart and from 0 and 1 (identical levels would waste a code and make
    an invalid lut codebook). [k] -> [k]."""
    v = levels.sort().values.clamp(MIN_GAP, 1 - MIN_GAP)
    k = v.numel()
    lo = MIN_GAP * torch.arange(1, k + 1, dtype=v.dtype)  # the i-th level is at least (i + 1) gaps above 0
    hi = 1 - MIN_GAP * torch.arange(k, 0, -1, dtype=v.dtype)  # and (k - i) gaps below 1
    out = v.clone()
    for i in range(k):  # k <= 14: a short forward pass keeps each level a gap above the previous one
        floor = lo[i] if i == 0 else torch.maximum(lo[i], out[i - 1] + MIN_GAP)
        out[i] = torch.minimum(torch.maximum(out[i], floor), hi[i])
    return out
