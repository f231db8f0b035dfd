"""Dense-and-sparse quantization (KVQuant, Hooper et al. 2024, section 3.5): the largest-magnitude elements are kept
exact in a sparse structure and left out of their group's statistics, so one outlier no longer sets the step of
the G - 1 ordinary values beside it.

Which elements are outliers (KVQuant's per-vector thresholds, `Outliers.mask`, x [B, H, T, D] as the quantizer sees
it, transforms applied):
    per="channel" (keys)   |x| > t[h, c], a threshold per kv head and channel, fitted on calibration data as the
                           (1 - fraction) quantile of |x| in that channel (`fit_thresholds`), so about `fraction`
                           of the elements are outliers (KVQuant calibrates key thresholds offline the same way)
    per="token"   (values) the k largest |x| of each token's D channels, k = round(fraction * D), at least 1 for
                           a positive fraction (computed online, as KVQuant does for values; D = 64 and 1% keep
                           one value per token: 1.6%)
Ties go to the lower channel index (a stable sort, not `torch.topk`, whose order among ties is unspecified), so the
mask depends on the token alone and every mode that sees the token marks the same elements.

Arithmetic (`fake_quant`): the group's codes and parameters come from the format with the outliers excluded
(`valid = ~mask`: they do not enter min/max and get code 0), and the outliers are put back exactly:
x' = where(mask, x, dequantize(quantize(x, valid=~mask))).

Storage: the packed cache (`kvq_lab.cache.storage.store.PackedStore`) keeps each outlier's value in the model's dtype
and an int32 index into the tensor; `entry_bytes` is the fp16-model price, 6 bytes, at which the byte accounting
(`kvq_lab.cache.accounting`) counts `fraction` of the elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvq_lab.quant.reference import fake_quant as _fake_quant
from kvq_lab.quant.residuals import Chain
from kvq_lab.quant.spec import QuantConfigError, QuantSpec

VALUE_BYTES, INDEX_BYTES = 2, 4  # fp16 value, int32 position in the tensor
PER = ("channel", "token")


def entry_bytes() -> int:
    """Bytes one sparse outlier costs: its fp16 value and its int32 index."""
    return VALUE_BYTES + INDEX_BYTES


@dataclass(frozen=True)
class Outliers:
    """Which elements of a [B, H, T, D] tensor stay exact (see the module docstring).

    fraction: in (0, 0.5). per: `channel` (thresholds per kv head and channel, `thresholds`: H * D floats, row-major
    [H, D]) or `token` (the top round(fraction * D) |x| of each token)."""

    fraction: float
    per: str
    thresholds: tuple[float, ...] | None = None

    def __post_init__(self):
        if isinstance(self.fraction, bool) or not 0 < self.fraction < 0.5:
            raise QuantConfigError(f"outliers fraction={self.fraction!r} must be in (0, 0.5)")
        if self.per not in PER:
            raise QuantConfigError(f"outliers per={self.per!r}; allowed: {', '.join(PER)}")
        if self.thresholds is not None:
            object.__setattr__(self, "thresholds", tuple(float(t) for t in self.thresholds))

    def k(self, D: int) -> int:
        """Outliers per token (per="token"): round(fraction * D), at least 1."""
        return max(1, round(self.fraction * D))

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, D] -> bool [B, H, T, D]: the outliers."""
        a = x.detach().float().abs()
        B, H, T, D = x.shape
        if self.per == "channel":
            if self.thresholds is None:
                raise QuantConfigError(
                    "key_outliers needs per-channel thresholds fitted on calibration data (run.py fits them; a cache "
                    "built by hand needs a CacheConfig from kvq_lab.fit.calibration.calibrate)"
                )
            t = torch.tensor(self.thresholds, dtype=torch.float32, device=x.device)
            if t.numel() % D or H % (t.numel() // D):
                raise ValueError(f"{t.numel()} key outlier thresholds do not fit heads of {D} channels x {H} heads")
            t = t.view(-1, D).repeat_interleave(H // (t.numel() // D), 0)  # [H, D]
            return a > t[None, :, None, :]
        # the k largest of each token, ties to the lower channel (a stable sort decides)
        idx = a.argsort(dim=-1, descending=True, stable=True)[..., : self.k(D)]
        return torch.zeros_like(a, dtype=torch.bool).scatter_(-1, idx, True)


def fake_quant(
    x: torch.Tensor, spec: QuantSpec, outliers: Outliers | None, partial: str = "zero", residual: Chain | None = None
) -> torch.Tensor:
    """dequantize(quantize(x)) with the outliers kept exact and out of every group's statistics, plus the residual
    corrections' rebuild of the error (`kvq_lab.quant.residuals`; computed in fp32 on the fp32 dequantized values,
    as the packed store does); x [B, H, T, D] -> [B, H, T, D] in x's dtype. outliers and residual None: the
    reference's `fake_quant`."""
    if spec.is_identity:
        return x
    m = None if outliers is None else outliers.mask(x)
    if residual is None:
        if m is None:
            return _fake_quant(x, spec, partial=partial)
        return torch.where(m, x, _fake_quant(x, spec, valid=~m, partial=partial))
    xf = x.float()
    deq = _fake_quant(xf, spec, valid=None if m is None else ~m, partial=partial)
    r = xf - deq if m is None else torch.where(m, 0.0, xf - deq)
    out = deq + residual.correction(r)
    return (out if m is None else torch.where(m, xf, out)).to(x.dtype)


def fit_thresholds(x: torch.Tensor, fraction: float) -> tuple[float, ...]:
    """Per-channel thresholds from calibration data x [B, H, T, D]: the (1 - fraction) quantile of |x| over B and T
    for each kv head and channel; H * D floats, row-major [H, D]."""
    a = x.detach().float().abs().permute(1, 3, 0, 2).reshape(x.shape[1], x.shape[3], -1)  # [H, D, B*T]
    return tuple(torch.quantile(a, 1 - fraction, dim=-1).flatten().tolist())
