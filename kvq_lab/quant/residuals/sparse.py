"""`sparse:<frac>`: the largest entries of the residual kept exactly (GEAR's sparse term, Kang et al.,
arXiv 2403.05527, applied to the quantization error).

Per token vector r [D] (fp32): the k = round(frac * D) entries of largest |r| (at least 1; ties to the lower channel,
a stable sort, as `kvq_lab.quant.outliers` breaks them) are stored as fp16 values with their channel indices (one
byte each for D <= 256, else two), 3k (or 4k) bytes per vector; the rebuild is r at those channels (rounded to fp16)
and 0 elsewhere.

GEAR itself takes the outliers out of the tensor *before* quantizing (so they do not stretch the groups) and fits its
low-rank term to what is left; in kvq_lab that first reading is `key_outliers` / `value_outliers` (KVQuant's
dense-and-sparse), and this correction is the second: it spends the same kind of entry on the largest errors the
format left, whatever caused them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvq_lab.quant.residuals import Residual, as_dtype, register_residual
from kvq_lab.quant.spec import QuantConfigError


@register_residual("sparse")
@dataclass(frozen=True)
class Sparse(Residual):
    """The round(frac * D) largest |r| of each vector, as fp16 values and channel indices."""

    frac: float

    arg_name = "frac"
    example_arg = "0.1"

    @classmethod
    def parse(cls, arg):
        try:
            f = float(arg)
        except (TypeError, ValueError):
            f = None
        if f is None or not 0 < f < 0.5:
            got = "sparse" if arg is None else f"sparse:{arg}"
            raise QuantConfigError(f"{got} needs the fraction kept, in (0, 0.5) (e.g. sparse:0.01)")
        return cls(f)

    @property
    def spelling(self) -> str:
        return f"sparse:{self.frac:g}"

    def k(self, D: int) -> int:
        return max(1, round(self.frac * D))

    @staticmethod
    def index_bytes(D: int) -> int:
        return 1 if D <= 256 else 2

    def unit_bytes(self, head_dim: int) -> int:
        return self.k(head_dim) * (2 + self.index_bytes(head_dim))

    def encode(self, r):
        import torch

        D, k = r.shape[-1], self.k(r.shape[-1])
        idx = r.float().abs().argsort(dim=-1, descending=True, stable=True)[..., :k]  # [..., k]
        val = r.float().gather(-1, idx).clamp(-65504.0, 65504.0).to(torch.float16)
        if self.index_bytes(D) == 1:
            i = idx.to(torch.uint8)
        else:
            i = idx.to(torch.int16).contiguous().view(torch.uint8)  # little-endian pairs
        return torch.cat([val.contiguous().view(torch.uint8), i], -1)

    def decode(self, stored, head_dim):
        import torch

        k = self.k(head_dim)
        val = as_dtype(stored[..., : 2 * k], torch.float16).float()
        raw = stored[..., 2 * k :]
        idx = raw.long() if self.index_bytes(head_dim) == 1 else as_dtype(raw, torch.int16).long()
        out = torch.zeros(*stored.shape[:-1], head_dim, device=stored.device)
        return out.scatter_(-1, idx, val)
