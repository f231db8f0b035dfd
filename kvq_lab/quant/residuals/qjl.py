"""`qjl:<m>`: a 1-bit Johnson-Lindenstrauss sketch of the residual (QJL, Zandieh, Daliri and Han, arXiv 2406.03482;
TurboQuant's "_prod" stage, arXiv 2504.19874, spends one bit per coordinate on it: `qjl:<D>`).

Per token vector r [D] (fp32), with S an m x D matrix of independent N(0, 1) entries drawn from the seed:

    stored   sign(S r) as m bits (bit i set where (S r)_i >= 0), and n = fp16(|r|)       m / 8 + 2 bytes
    rebuild  r^ = sqrt(pi / 2) / m * n * S^T s,     s_i = +1 where bit i is set, else -1

Unbiased: for a Gaussian row g, E[g sign(<g, r>)] = sqrt(2 / pi) r / |r|, so E_S[r^] = r (up to the fp16 rounding
of |r|) and every inner product <q, r^> that attention computes is an unbiased estimate of <q, r>, with variance
about (pi / 2 - 1) |q|^2 |r|^2 / m. The rebuild is dense (it is not the residual's own direction), so it adds noise
to what attention reads; that the noise averages out in the softmax is QJL's claim, which the field_methods study
tests.

S is not stored: like the engines, it is regenerated from the seed (torch's CPU generator seeded with `seed`, m * D
normal draws, row-major), one matrix for every layer, head and token: `qjl:<m>` is seed 0, `qjl:<m>:<seed>` another.
`m` must be a multiple of 8 (whole bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from kvq_lab.quant.residuals import Residual, as_dtype, register_residual
from kvq_lab.quant.spec import QuantConfigError

if TYPE_CHECKING:
    import torch

MAX_M = 4096


@lru_cache(maxsize=8)
def byte_bits(device: str) -> torch.Tensor:
    """uint8 [8]: 1, 2, 4, ..., 128 (bit j of a byte holds sign bit 8 * byte + j)."""
    import torch

    return (1 << torch.arange(8)).to(torch.uint8).to(device)


@lru_cache(maxsize=64)
def sketch(m: int, D: int, seed: int, device: str) -> torch.Tensor:
    """fp32 [m, D]: the Gaussian sketch matrix S of a seed (the same on every device and run)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, D, generator=g, dtype=torch.float32).to(device)


@register_residual("qjl")
@dataclass(frozen=True)
class QJL(Residual):
    """m sign bits of S r plus fp16 |r| per token vector; rebuilt as sqrt(pi/2)/m * |r| * S^T sign(S r)."""

    m: int
    seed: int = 0

    arg_name = "m"
    example_arg = "32"
    scale = math.sqrt(math.pi / 2)  # the estimator's constant (a test checks a wrong one is caught)

    @classmethod
    def parse(cls, arg):
        m, _, seed = (arg or "").partition(":")
        if not m.isdigit() or not 8 <= int(m) <= MAX_M or int(m) % 8 or (seed and not seed.isdigit()):
            got = "qjl" if arg is None else f"qjl:{arg}"
            raise QuantConfigError(
                f"{got} needs the sketch size m, a multiple of 8 in [8, {MAX_M}], and optionally a seed: "
                "qjl:<m>[:<seed>] (e.g. qjl:64)"
            )
        return cls(int(m), int(seed or 0))

    @property
    def spelling(self) -> str:
        return f"qjl:{self.m}" if self.seed == 0 else f"qjl:{self.m}:{self.seed}"

    def unit_bytes(self, head_dim: int) -> int:
        return self.m // 8 + 2

    def _s(self, D: int, device) -> torch.Tensor:
        return sketch(self.m, D, self.seed, str(device))

    def encode(self, r):
        import torch

        y = r.float() @ self._s(r.shape[-1], r.device).T  # [..., m]
        bits = (y >= 0).to(torch.uint8).unflatten(-1, (self.m // 8, 8))  # [..., m/8, 8]
        packed = (bits * byte_bits(str(r.device))).sum(-1, dtype=torch.uint8)  # disjoint bits: the sum is an or
        norm = r.float().norm(dim=-1, keepdim=True).clamp(max=65504.0).to(torch.float16)
        return torch.cat([packed, norm.view(torch.uint8)], -1)

    def decode(self, stored, head_dim):
        import torch

        nb = self.m // 8
        bits = (stored[..., :nb, None] & byte_bits(str(stored.device))) != 0  # [..., m/8, 8]
        s = bits.flatten(-2).float() * 2 - 1  # [..., m]
        norm = as_dtype(stored[..., nb : nb + 2], torch.float16).float()  # [..., 1]
        return (self.scale / self.m) * norm * (s @ self._s(head_dim, stored.device))
