"""`rhadamard`: a seeded randomized Hadamard rotation of the head dimension, the random rotation engines use for
TurboQuant and QJL (random signs, then a Hadamard transform: Ailon and Chazelle's fast Johnson-Lindenstrauss map).

    x_t = (x * s) H_D / sqrt(D)        per token; s in {-1, +1}^D drawn from the seed, D the head dim (a power of two)

M = diag(s) H_D / sqrt(D) is orthogonal, so x = (x_t H_D / sqrt(D)) * s undoes it and attention folds it
(`foldable`: the query is mapped with `forward`, the output back with `inverse`). Unlike `hadamard`, whose fixed
matrix aligns with whatever structure the channels have, the random signs make every coordinate of x_t distributed
alike for any input direction (near N(0, |x|^2 / D) for large D), which is what a per-coordinate codebook such as
TurboQuant's assumes.

The signs are not stored: like the engines, they are regenerated from the seed (torch's CPU generator, seeded with
it, D draws of {0, 1}), so the seed is part of the spelling, the config and the record: `rhadamard` is seed 0,
`rhadamard:<seed>` another one. The arithmetic is `hadamard`'s fast Walsh-Hadamard transform in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from kvq_lab.quant.spec import QuantConfigError
from kvq_lab.quant.transforms import Transform, register_transform
from kvq_lab.quant.transforms.hadamard import _is_pow2, fwht


@cache
def signs(seed: int, D: int, device: str):
    """fp32 [D] of -1 and +1 drawn from the seed (the same on every device and run)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (D,), generator=g).float() * 2 - 1).to(device)


@register_transform("rhadamard")
@dataclass(frozen=True)
class RandomizedHadamard(Transform):
    """x -> (x * s) H_D / sqrt(D), s random signs from `seed` (module docstring)."""

    seed: int = 0

    foldable = True

    @classmethod
    def parse(cls, arg):
        if arg is None:
            return cls()
        if not arg.isdigit():
            raise QuantConfigError(f"rhadamard:{arg} needs a seed, a non-negative integer (e.g. rhadamard:1)")
        return cls(int(arg))

    @property
    def spelling(self) -> str:
        return "rhadamard" if self.seed == 0 else f"rhadamard:{self.seed}"

    @property
    def label(self) -> str:
        return "rhad" if self.seed == 0 else f"rhad{self.seed}"

    def check_head_dim(self, head_dim: int) -> None:
        if not _is_pow2(head_dim):
            raise QuantConfigError(f"rhadamard needs a power-of-two head dim, not {head_dim}")

    def _s(self, x):
        D = x.shape[-1]
        if not _is_pow2(D):
            raise ValueError(f"{self.spelling} cannot rotate a head dim of {D} (a power of two)")
        return signs(self.seed, D, str(x.device)), D

    def forward(self, x, pos=None):
        s, D = self._s(x)
        return (fwht(x.float() * s, D) * D**-0.5).to(x.dtype)

    def inverse(self, x, pos=None):
        s, D = self._s(x)
        return (fwht(x.float(), D) * D**-0.5 * s).to(x.dtype)
