"""Error and sparsity metrics, as small pure functions over tensors.

Every error metric compares an exact tensor `x` with its approximation `xq` (same shape) and reduces over
`dims` (default: the last two, i.e. one value per head of a `[H, T, D]` or `[H, T, T]` tensor). All arithmetic
is fp32. Three definitions are offered side by side because they disagree:

    rel_fro     ||X - X'||_F / ||X||_F                             scale-free, dominated by large entries
    sqnr_db     10 log10(||X||_F^2 / ||X - X'||_F^2)               the same information in dB (= -20 log10 rel_fro)
    kivi_ratio  sqrt(mean_{kept} ((x - x') / x)^2)                 KIVI Table 2's "||(X - X')/X||_F", RMS form

`kivi_ratio`: KIVI (arXiv 2402.02750, Table 2) writes its errors as the Frobenius norm of the element-wise ratio
and says no more. That ratio explodes where x is near zero, so entries with |x| < eps * max|x| (max over the same
reduced slice, eps = 0.01 by default) are left out, and the norm is divided by sqrt(number of kept entries) so the
value does not grow with the tensor's size (a raw Frobenius norm would: it is this value times sqrt(n_kept)). It is
dominated by the smallest kept entries, so it rewards quantizers that are accurate on small values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvq_lab.common.metric import check_direction
from kvq_lab.common.registry import Registry

from .settings import DEFAULT_KIVI_EPS


def _dims(x: torch.Tensor, dims) -> tuple[int, ...]:
    if dims is None:
        return tuple(range(x.dim()))
    return (dims,) if isinstance(dims, int) else tuple(dims)


def _energies(x: torch.Tensor, e: torch.Tensor, d: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(||e||^2, ||x||^2) over d, accumulated in fp32 (relative rounding ~1e-6, far below any reported digit)."""
    return e.square().sum(dim=d), x.square().sum(dim=d)


def _rel_fro(err: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    out = (err / ref.clamp_min(torch.finfo(torch.float32).tiny)).sqrt()
    return torch.where(ref > 0, out, torch.where(err > 0, torch.inf, 0.0))


def _sqnr_db(err: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    out = 10 * torch.log10(ref / err.clamp_min(torch.finfo(torch.float32).tiny))
    out = torch.where(err > 0, out, torch.inf)
    return torch.where((err > 0) & (ref == 0), -torch.inf, out)


def _kivi(x: torch.Tensor, e: torch.Tensor, d: tuple[int, ...], eps: float) -> torch.Tensor:
    mag = x.abs()
    keep = (mag >= eps * mag.amax(dim=d, keepdim=True)) & (mag > 0)
    ratio2 = torch.where(keep, e.square() / torch.where(keep, x.square(), 1.0), 0.0)
    return (ratio2.sum(dim=d) / keep.sum(dim=d).clamp_min(1)).sqrt()


def rel_fro(x: torch.Tensor, xq: torch.Tensor, dims=(-2, -1)) -> torch.Tensor:
    """||x - xq||_F / ||x||_F over `dims`. 0 when the two are equal (even if x is all zeros), inf when x is zero
    and xq is not."""
    xf = x.float()
    return _rel_fro(*_energies(xf, xf - xq.float(), _dims(x, dims)))


def sqnr_db(x: torch.Tensor, xq: torch.Tensor, dims=(-2, -1)) -> torch.Tensor:
    """10 log10(||x||^2 / ||x - xq||^2) in dB over `dims`; +inf when xq equals x. Higher is better."""
    xf = x.float()
    return _sqnr_db(*_energies(xf, xf - xq.float(), _dims(x, dims)))


def kivi_ratio(x: torch.Tensor, xq: torch.Tensor, dims=(-2, -1), eps: float = DEFAULT_KIVI_EPS) -> torch.Tensor:
    """sqrt(mean over kept entries of ((x - xq) / x)^2), kept = |x| >= eps * max|x| (max over `dims`) and x != 0.

    KIVI Table 2's element-wise-ratio Frobenius norm with a guard against division by near-zero entries and an
    RMS normalisation (see the module docstring). 0 when nothing is kept.
    """
    xf = x.float()
    return _kivi(xf, xf - xq.float(), _dims(x, dims), eps)


@dataclass(frozen=True)
class ErrorMetric:
    """One definition of the error between an exact tensor and its approximation, as the probes report it.

    name: its name in records (`probe/<quantity>/<name>/mean`), tables and W&B; compute(x, xq, dims, eps) -> one
    value per slice not reduced over (`eps`: the probes' `kivi_eps`, for definitions that guard small entries);
    direction: "higher" or "lower" is better; unit: "dB" or "" (a ratio); table: a column title shown in experiment
    tables for the decode-row errors of K, V, scores and output (`K err`), or None for none."""

    name: str
    compute: Callable[..., torch.Tensor]
    direction: str = "lower"
    unit: str = ""
    table: str | None = None

    def __post_init__(self):
        check_direction(self.name, self.direction)


ERRORS: Registry[ErrorMetric] = Registry("error")
"""Error definitions reported side by side, by name (the names used in tables, records and W&B)."""


def register_error(m: ErrorMetric) -> ErrorMetric:
    """Add an error definition: every probe then reports it for every quantity (one line per definition). A name
    another definition holds is refused (kvq_lab.common.registry)."""
    return ERRORS.register(m.name, m)


register_error(ErrorMetric("kivi_ratio", kivi_ratio))
register_error(ErrorMetric("rel_fro", lambda x, xq, dims, eps: rel_fro(x, xq, dims), table="err"))
register_error(ErrorMetric("sqnr_db", lambda x, xq, dims, eps: sqnr_db(x, xq, dims), "higher", "dB"))


def all_errors(x: torch.Tensor, xq: torch.Tensor, dims=(-2, -1), eps: float = DEFAULT_KIVI_EPS) -> dict:
    """{name: tensor} for every definition in ERRORS: the built-in ones sharing the difference and the sums (the
    probes' hot path; equal to calling each function), any other by its own `compute`."""
    xf = x.float()
    e, d = xf - xq.float(), _dims(x, dims)
    err, ref = _energies(xf, e, d)
    out = {"kivi_ratio": _kivi(xf, e, d, eps), "rel_fro": _rel_fro(err, ref), "sqnr_db": _sqnr_db(err, ref)}
    out.update({n: m.compute(x, xq, dims, eps) for n, m in ERRORS.items() if n not in out})
    return out


def sparsity(a: torch.Tensor, visible: torch.Tensor | None = None, rel: float = 0.01) -> torch.Tensor:
    """Share of attention weights below `rel` x their row's max, among the row's visible (unmasked) keys.

    a: [..., Q, K] attention probabilities; visible: bool broadcastable to a (None = all visible).
    Returns [...]: the mean over rows of each row's share. KIVI quotes 84.3% sparsity without a definition;
    this is ours.
    """
    vis = torch.ones_like(a, dtype=torch.bool) if visible is None else visible.expand_as(a)
    row_max = torch.where(vis, a, -torch.inf).amax(-1, keepdim=True)
    small = (a < rel * row_max) & vis
    share = small.sum(-1).float() / vis.sum(-1).clamp_min(1).float()
    return share.mean(-1)


def topk_mass(a: torch.Tensor, k: int) -> torch.Tensor:
    """Share of each row's probability mass held by its `k` largest weights, averaged over rows.

    a: [..., Q, K] attention probabilities (masked entries are 0, so they never enter the top k of a row with
    at least k visible keys; a row with <= k visible keys scores 1). Returns [...].
    """
    k = min(k, a.shape[-1])
    top = a.float().topk(k, dim=-1).values.sum(-1)
    return (top / a.float().sum(-1).clamp_min(1e-30)).mean(-1)
