"""`lowrank:<r>[:<n>]`: GEAR's low-rank term (Kang et al., arXiv 2403.05527): the quantization error of a block of n
consecutive tokens of one kv head, an n x D matrix R, approximated by its best rank-r approximation.

Per block (fp32 R [n, D], D the head dim), with the truncated SVD R ~ U_r diag(s_r) V_r^T:

    stored   A = U_r diag(s_r) as fp16 [n, r], B = V_r^T as fp16 [r, D]           2 r (n + D) bytes per block
             (R itself rounded to fp16 first: the error as the open block held it)
    rebuild  R^ = A B (fp32 product of the stored fp16 factors)

GEAR fits the factors with a few power iterations and on the heads of a layer side by side ([n, H * D]); here the
SVD is exact (LAPACK, deterministic on a device) and per kv head, so a block's factors depend on that head's error
alone and the packed cache, simulated mode and the probes compute the same bits. The rank budget is the one GEAR
states (r about 2-5 % of min(n, D)); on a 64-channel head the factors cost 2 r (n + D) / (n D) bytes per element,
e.g. 0.75 bits per element for lowrank:1 over blocks of 32 tokens, 1 bit for lowrank:2:64.

A block is stored once complete; until then its tokens keep their error in fp16 (`kvq_lab.quant.residuals`, GEAR's
streaming buffer). n = 32 by default (the packing block and the default group size); in packed mode a per-channel
tensor flushes whole windows, so its window (exact_window, or the group size when 0) must be a multiple of n.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvq_lab.quant.residuals import Residual, as_dtype, open_error, register_residual
from kvq_lab.quant.spec import QuantConfigError

DEFAULT_TOKENS = 32
MAX_TOKENS = 4096


@register_residual("lowrank")
@dataclass(frozen=True)
class LowRank(Residual):
    """The rank-`rank` SVD of each kv head's error over blocks of `tokens` tokens, as two fp16 factors."""

    rank: int
    tokens: int = DEFAULT_TOKENS

    arg_name = "r"
    example_arg = "2:16"

    @classmethod
    def parse(cls, arg):
        r, _, n = (arg or "").partition(":")
        ok = r.isdigit() and int(r) >= 1 and (not n or (n.isdigit() and 2 <= int(n) <= MAX_TOKENS))
        if not ok or int(r) >= int(n or DEFAULT_TOKENS):
            got = "lowrank" if arg is None else f"lowrank:{arg}"
            raise QuantConfigError(
                f"{got} needs a rank r >= 1 and optionally the block length n in [2, {MAX_TOKENS}] tokens (default "
                f"{DEFAULT_TOKENS}), r < n: lowrank:<r>[:<n>] (e.g. lowrank:2)"
            )
        return cls(int(r), int(n or DEFAULT_TOKENS))

    @property
    def spelling(self) -> str:
        return f"lowrank:{self.rank}" if self.tokens == DEFAULT_TOKENS else f"lowrank:{self.rank}:{self.tokens}"

    @property
    def block(self) -> int:
        return self.tokens

    def check_head_dim(self, head_dim: int) -> None:
        if self.rank >= head_dim:
            raise QuantConfigError(
                f"rank {self.rank} is not below the head dim {head_dim}: a rank-{head_dim} term stores the error "
                f"whole; give r < {head_dim}"
            )

    def unit_bytes(self, head_dim: int) -> int:
        return 2 * self.rank * (self.tokens + head_dim)

    def encode(self, r):
        import torch

        n, k, D = self.tokens, self.rank, r.shape[-1]
        m = open_error(r).reshape(*r.shape[:-2], r.shape[-2] // n, n, D)  # [..., U, n, D]
        u, s, vh = torch.linalg.svd(m, full_matrices=False)
        a = (u[..., :k] * s[..., None, :k]).clamp(-65504.0, 65504.0).to(torch.float16)  # [..., U, n, k]
        b = vh[..., :k, :].to(torch.float16)  # [..., U, k, D] (orthonormal rows: no overflow)
        return torch.cat([a.flatten(-2).view(torch.uint8), b.flatten(-2).view(torch.uint8)], -1)

    def decode(self, stored, head_dim):
        import torch

        n, k = self.tokens, self.rank
        a = as_dtype(stored[..., : 2 * n * k], torch.float16).float().unflatten(-1, (n, k))
        b = as_dtype(stored[..., 2 * n * k :], torch.float16).float().unflatten(-1, (k, head_dim))
        return (a @ b).flatten(-3, -2)  # [..., U * n, D]
