"""`hadamard`: a fixed orthonormal Hadamard rotation of the head dimension (QuaRot, Ashkboos et al. 2024; the
incoherence processing of QuIP#).

    x_t = x H_n / sqrt(n)       per token, on each block of n consecutive channels (n = D, or the stated block)

H_n is Sylvester's Hadamard matrix (H_1 = [1], H_2m = [[H_m, H_m], [H_m, -H_m]]), so n is a power of two. H_n/sqrt(n)
is symmetric and orthonormal, hence its own inverse: `inverse` is `forward`. A rotation spreads an outlier channel's
energy over all n channels of its block, so per-token groups no longer carry one huge channel, and keeps q·k (rotate
the query too) and A V (rotate the output back): attention can fold it (`foldable`).

Arithmetic: the fast Walsh-Hadamard transform, log2(n) butterfly stages (a, b) -> (a + b, a - b) in fp32, then one
multiplication by n^-1/2. Elementwise, so each output depends on its own token only and comes out bit for bit the
same whatever the batch, head or token count (no matmul blocking): simulated and packed modes agree exactly, and a
row of a padded batch stores what it stores alone. A kernel module may register the same arithmetic for a device
(`register_fast`: `kvq_lab.kernels.cpu_native` does, one native call where PyTorch takes several ops per stage); it
gives the same bits (tested). The fold (the query and the attention output, once per layer and decode step, never
stored) is the registered native transform where there is one, else one matmul with the fp32 matrix H_n/sqrt(n): the
same map to fp32 rounding, without log2(n) stages of per-op overhead on a one-token tensor.

Spelling: `hadamard` rotates the whole head dim (a power of two: 64, 128); `hadamard:<n>` rotates blocks of n
channels (a power of two dividing the head dim, e.g. `hadamard:32` for head_dim 96).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from kvq_lab.quant.spec import QuantConfigError
from kvq_lab.quant.transforms import Transform, register_transform


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def block_arg(name: str, arg: str, example: int, hint: str = "") -> int:
    """The block size n of a `name:n` spelling (hadamard, rotatekv): a power of two >= 2, else one line saying so."""
    n = int(arg) if arg.isdigit() else 0
    if not _is_pow2(n) or n < 2:
        raise QuantConfigError(
            f"{name}:{arg} has a block that is not a power of two >= 2 (e.g. {name}:{example}){hint}"
        )
    return n


_FAST: dict = {}  # device type -> fn(x, n, scale): fwht(x, n) * scale in x's dtype, or None (not here)
_FAST_PAIR: dict = {}  # device type -> fn(a, b, n, scale, out): the same for two tensors at once, or None


def register_fast(device_type: str, fn, pair=None) -> None:
    """Register a native `fwht(x, n) * scale` for tensors on `device_type`: fn(x, n, scale) returns it as a new
    tensor in x's dtype with the same bits, or None where it cannot (x stays untouched either way); pair(a, b, n,
    scale, out), if given, returns (fn(a, n, scale), fn(b, n, scale)) in one call, written into `out` (a pair of
    tensors, or None) where it can, or None (`Hadamard.forward_pair`)."""
    _FAST[device_type] = fn
    if pair is not None:
        _FAST_PAIR[device_type] = pair


def _native(x, n: int):
    """fwht(x, n) * n^-1/2 in x's dtype by the native transform registered for x's device, or None (none here)."""
    fast = _FAST.get(x.device.type)
    return None if fast is None else fast(x, n, n**-0.5)


def fwht(x, n: int):
    """Unnormalized Walsh-Hadamard transform (Sylvester order) of each block of n channels: x [..., D] fp32,
    D a multiple of n -> [..., D] fp32 = x H_n blockwise."""
    import torch

    shape = x.shape
    y = x.reshape(x.numel() // shape[-1], shape[-1] // n, n)  # not -1: an empty x (no sinks) keeps its shape
    h = 1
    while h < n:
        # pairs (i, i + h) within each run of 2h channels: (a, b) -> (a + b, a - b)
        y = y.view(y.shape[0], y.shape[1], n // (2 * h), 2, h)
        a, b = y.unbind(3)
        y = torch.stack((a + b, a - b), 3).view(y.shape[0], y.shape[1], n)
        h *= 2
    return y.view(shape)


@cache
def matrix(n: int, device: str = "cpu"):
    """H_n / sqrt(n), fp32 [n, n] on `device` (Sylvester's construction; built once per size and device)."""
    import torch

    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * n**-0.5).to(device)


@register_transform("hadamard")
@dataclass(frozen=True)
class Hadamard(Transform):
    """x -> x H_n / sqrt(n) on blocks of n channels (n = `block`, or the whole head dim); see the module docstring."""

    block: int | None = None  # None: the whole head dim

    foldable = True
    kernel_feature = "hadamard"  # kernels that read `DecodeView.hadamard` map query and output themselves

    @classmethod
    def parse(cls, arg):
        if arg is None:
            return cls()
        return cls(block_arg("hadamard", arg, 32, "; write hadamard alone to rotate the whole head dim"))

    @property
    def spelling(self) -> str:
        return "hadamard" if self.block is None else f"hadamard:{self.block}"

    @property
    def label(self) -> str:
        return "had" if self.block is None else f"had{self.block}"

    def check_head_dim(self, head_dim: int) -> None:
        p = head_dim & -head_dim  # the largest power of two dividing head_dim
        if self.block is None and not _is_pow2(head_dim):
            raise QuantConfigError(
                f"hadamard needs a power-of-two head dim, not {head_dim}; rotate blocks instead: hadamard:{p}"
            )
        if self.block is not None and head_dim % self.block:
            raise QuantConfigError(
                f"block {self.block} does not divide head_dim={head_dim}; use a power of two dividing it, e.g. "
                f"hadamard:{p}"
            )

    def _n(self, D: int) -> int:
        n = self.block or D
        if D % n or not _is_pow2(n):
            raise ValueError(f"{self.spelling} cannot rotate a head dim of {D} (blocks of a power of two dividing it)")
        return n

    def forward(self, x, pos=None):
        n = self._n(x.shape[-1])
        y = _native(x, n)
        return y if y is not None else (fwht(x.float(), n) * n**-0.5).to(x.dtype)

    def forward_pair(self, a, b, pos=None, out=None):
        """`forward` of a and b in one native call where one is registered for their device (the same bits), into
        `out` where that call can write there."""
        pair = _FAST_PAIR.get(a.device.type)
        if pair is not None and b.device == a.device:
            n = self._n(a.shape[-1])
            ys = pair(a, b, n, n**-0.5, out)
            if ys is not None:
                return ys
        return self.forward(a, pos), self.forward(b, pos)

    inverse = forward  # H_n / sqrt(n) is symmetric and orthonormal: its own inverse

    def fold_query(self, q):
        """q [..., D] -> q M: the registered native transform where there is one (`forward`'s bits), else one matmul
        (see the module docstring); never used on stored tokens."""
        D = q.shape[-1]
        n = self._n(D)
        y = _native(q, n)
        if y is not None:
            return y
        blocks = q.float().reshape(*q.shape[:-1], D // n, n)
        return (blocks @ matrix(n, str(q.device))).reshape(q.shape).to(q.dtype)

    fold_output = fold_query  # M is its own inverse
