"""`innerq`: per-channel normalization of the keys, folded into the query (InnerQ, Tayaranian Hosseini et al. 2026,
"InnerQ: Hardware-aware Tuning-free Quantization of KV Cache", arXiv 2602.23200, technique iii).

    k_t = k / s          per kv head h and channel c: s[h, c] = 2^round(alpha * log2(max |k[h, :, c]|))   (fitted)
    q_t = q * s          the query of kv head h's query heads (GQA), so q_t · k_t = q · k

Per-token key groups (InnerQ groups keys along the inner, channel dimension) share one range across all channels of
a token, so a channel that is large on every token sets every group's step; dividing each channel by its own
magnitude gives the channels equal range before grouping. The scale is a power of two, so k / s and q * s are
exact in floating point (short of underflow): q_t · k_t equals q · k bit for bit before quantization, and the round
trip k_t * s returns k exactly. Per-channel key groups (KIVI's K-C) gain nothing: each group is one channel already.

Partial scaling (`innerq:<alpha>`, 0 < alpha <= 1; `innerq` is alpha = 1, the paper's full normalization): s is
max|k|^alpha, SmoothQuant's migration strength (Xiao et al. 2023) with the query in the weight's place. Why: after
full normalization every channel spends the same step in normalized units, so a large channel, which dominates q·k,
gets an error s times larger once multiplied back (measured on SmolLM2: experiments/methods). alpha < 1 flattens the
channel ranges only partly, keeping finer steps where the scores need them.

Fitting (`fit`): InnerQ computes s once at prefill; here `kvq_lab.fit.calibration` computes it once per layer on the
calibration text (never on the evaluated text), from the keys as this transform sees them (after rope_pre when it
comes first). Keys only; foldable: the packed cache stores k_t, maps the query with `fold_query` (q * s) once per
decode step, and its kernels never see s. Dropped around a 16-bit quantizer (it would change nothing).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from kvq_lab.quant.spec import QuantConfigError
from kvq_lab.quant.transforms import Transform, register_fitted, register_transform


def per_head(p, H: int):
    """Per-head parameters p [Hp, D] for a tensor of H heads: [H, D]. H == Hp (keys), H a multiple of Hp (the
    queries of a GQA model: query head i reads kv head i // (H / Hp), as repeat_kv orders them), or Hp == 1."""
    Hp = p.shape[0]
    if H == Hp:
        return p
    if Hp == 1 or H % Hp == 0:
        return p.repeat_interleave(H // Hp, 0)
    raise ValueError(f"parameters fitted for {Hp} heads cannot act on {H} heads")


def digest(*tensors) -> str:
    """12 hex digits identifying fitted parameters (their bytes), for the fitted spelling `name@digest`."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


@register_transform("innerq")
@dataclass(frozen=True, eq=False)
class InnerQ(Transform):
    """keys / s, query * s, s a fitted power of two per (kv head, channel); see the module docstring.

    alpha: the migration strength, s = 2^round(alpha * log2 max|k|), 0 < alpha <= 1 (1: full normalization).
    scale: fp32 [H_kv, D] (or [1, D]: every head), None for the bare spelling (not fitted: unusable)."""

    alpha: float = 1.0
    scale: Any = None

    tensors = ("key",)
    foldable = True
    fitted = True
    skip_unquantized = True

    @classmethod
    def parse(cls, arg):
        if arg is None:
            return cls()
        try:
            alpha = float(arg)
        except ValueError:
            alpha = float("nan")
        if not 0 < alpha <= 1:  # nan fails too
            raise QuantConfigError(
                f"innerq:{arg} needs a migration strength alpha in (0, 1] (e.g. innerq:0.5); write innerq for alpha=1"
            )
        return cls(alpha)

    def fit(self, x) -> InnerQ:
        """Fitted on keys x [B, H, T, D] (fp32): s = 2^round(alpha * log2(max over B, T of |x|)), 1 where a channel
        is 0."""
        import torch

        m = x.detach().float().abs().amax(dim=(0, 2))  # [H, D]
        e = torch.round(self.alpha * torch.log2(m.clamp(min=1e-30)))  # the exponent of s^alpha, rounded
        s = torch.where(m > 0, torch.exp2(e), torch.ones_like(m))
        t = type(self)(self.alpha, s.cpu())
        register_fitted(t)
        return t

    @classmethod
    def example(cls) -> InnerQ:
        import torch

        x = torch.randn(1, 1, 256, 64, generator=torch.Generator().manual_seed(0))
        x[..., 5] *= 20  # an outlier channel, as LLM keys have
        return cls().fit(x)

    @property
    def spelling(self) -> str:
        bare = self.name if self.alpha == 1 else f"{self.name}:{self.alpha:g}"
        return bare if self.scale is None else f"{bare}@{digest(self.scale)}"

    @property
    def label(self) -> str:
        return self.name if self.alpha == 1 else f"{self.name}{self.alpha:g}"

    def stored_bits(self, heads: int, head_dim: int) -> int:
        return 16 * heads * head_dim  # one fp16 scale per (kv head, channel)

    def _s(self, x):
        if self.scale is None:
            raise QuantConfigError(
                "innerq has no fitted scales: calibration fits them (run.py does; a cache built by hand needs a "
                "CacheConfig from kvq_lab.fit.calibration.calibrate)"
            )
        return per_head(self.scale.to(x.device), x.shape[1])[:, None, :]  # [H, 1, D]

    def forward(self, x, pos=None):
        return (x.float() / self._s(x)).to(x.dtype)

    def inverse(self, x, pos=None):
        return (x.float() * self._s(x)).to(x.dtype)

    def fold_query(self, q):
        """q [B, Hq, T, D] -> q * s (query heads mapped to their kv head): (q * s) · (k / s) = q · k."""
        return self.inverse(q)

    def fold_output(self, o):
        """An output over stored values A (v / s) -> times s (innerq wraps keys only; kept for the protocol)."""
        return self.inverse(o)
