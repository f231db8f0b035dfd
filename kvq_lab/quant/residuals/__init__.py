"""Residual corrections: what a method stores, besides the codes, about the error the code format left behind.

After the format (and the sparse outliers, `kvq_lab.quant.outliers`) a token's vector x [D] (as the quantizer sees it,
transforms applied) is x' = deq(x), with error r = x - x'. A residual correction stores a compact description of r
and adds its rebuild r^ to the dequantized vector, so any attention kernel that reads x' + r^ computes what the method
computes (QJL's unbiased inner-product estimator included, since it is linear in r^):

    x'' = x' + r^,     r^ = decode(encode(r))          per token vector, in fp32; the outliers stay exact

Corrections compose (`key_residual=[sparse:0.01,qjl:64]`): each one encodes what the ones before it left,
r_1 = r, r_{i+1} = r_i - r^_i, and x'' = x' + sum_i r^_i.

A correction is stored in units of `block` consecutive quantized tokens of one kv head: `unit_bytes(D)` bytes per
unit (`encode`'s raw bytes, exactly what the method stores: sign bits, an fp16 norm, fp16 values and channel
indices, low-rank factors). Most corrections are per token vector (`block` = 1), so they depend on the token alone.
A block correction (`lowrank`: GEAR's low-rank term, fitted to a block of tokens at once) can only be stored once
its block is complete: until then the tokens of the open block keep their error as fp16 and are read as
deq(x) + fp16(r), i.e. at about the precision of the model (GEAR's streaming buffer; the byte accounting counts that
buffer at 16 bits per element), and the completed block is encoded from that fp16 error (in every mode, so that a
block completed over several writes and one encoded at once store the same bytes). Blocks start at the first quantized
token (after the sinks). Every mode (simulated, packed, the probes) computes the same bits: the packed cache stores the
units and the open block's fp16 error, and the byte accounting counts them.

Spelling (the run config's `key_residual` / `value_residual`, `residual` for both): `name:arg`, a list composes in
order; `none` (default) stores nothing. This registry imports neither torch nor its plugins (config validation reads
it); `RESIDUALS` names each built-in by "module:Name" and imports it on first lookup.

Registered corrections:
    qjl:<m>        QJL (Zandieh et al., arXiv 2406.03482): m sign bits of a Gaussian sketch S r plus |r|; the rebuild
                   sqrt(pi/2) / m * |r| * S^T sign(S r) makes every inner product with it unbiased. TurboQuant's
                   "_prod" stage is `qjl` on the residual of its MSE stage.
    sparse:<frac>  the round(frac * D) largest |r| of each vector kept as fp16 values with their channel indices
                   (GEAR's sparse term, on the residual; `*_outliers` is the other reading, outliers kept out of the
                   groups before quantization)
    lowrank:<r>[:<n>]  GEAR's low-rank term (Kang et al., arXiv 2403.05527): the rank-r truncated SVD of each kv
                   head's error over blocks of n tokens (default 32), two fp16 factors per block

Adding a correction: one file `kvq_lab/quant/residuals/<name>.py` with a frozen dataclass registered by
`@register_residual("<name>")` implementing `parse`, `unit_bytes`, `encode`, `decode` (`block` where a unit is more than
one token; `check_head_dim` where a head dim can be wrong for it), and its registry line in `RESIDUALS`;
`tests/quant/test_residuals.py` iterates `RESIDUALS` (`example()` gives an instance to test).
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, ClassVar

from kvq_lab.common.registry import Registry
from kvq_lab.quant.spec import QuantConfigError

if TYPE_CHECKING:
    import torch

NONE = "none"
# The built-in corrections: one registry line each, imported on first lookup (kvq_lab.common.registry).
RESIDUALS: Registry[type[Residual]] = Registry(
    "residual",
    lazy={
        "lowrank": "kvq_lab.quant.residuals.lowrank:LowRank",
        "qjl": "kvq_lab.quant.residuals.qjl:QJL",
        "sparse": "kvq_lab.quant.residuals.sparse:Sparse",
    },
)


class Residual(ABC):
    """One correction of the quantization error of token vectors [..., D] (see the module docstring).

    Subclasses are frozen dataclasses whose fields are their options; `parse` reads the spelling's argument."""

    name: ClassVar[str] = ""  # set by `register_residual`
    arg_name: ClassVar[str] = "arg"  # what the spelling's argument is, in error messages (`qjl:<m>`)
    example_arg: ClassVar[str] = ""  # an argument `example()` parses, for the registry-driven tests

    @classmethod
    def example(cls) -> Residual:
        return cls.parse(cls.example_arg)

    @classmethod
    @abstractmethod
    def parse(cls, arg: str | None) -> Residual:
        """The correction from its spelling's argument (`qjl:64` -> "64"; None without one), one-line errors."""

    @property
    @abstractmethod
    def spelling(self) -> str:
        """How the run config writes it (`get_residual(r.spelling) == r`)."""

    @property
    def label(self) -> str:
        """Short name in cache labels (`_Kqjl64`)."""
        return self.spelling.replace(":", "").replace(".", "p")

    def check_head_dim(self, head_dim: int) -> None:  # noqa: B027  (most act on any head dim)
        """Raise a one-line QuantConfigError if the correction cannot act on vectors of `head_dim` channels."""

    @property
    def block(self) -> int:
        """Consecutive tokens one stored unit covers (1: a per-token correction)."""
        return 1

    @abstractmethod
    def unit_bytes(self, head_dim: int) -> int:
        """Bytes stored per unit (`block` token vectors of `head_dim` channels, one kv head)."""

    def token_bytes(self, head_dim: int) -> float:
        """Bytes stored per token vector, on average over a unit."""
        return self.unit_bytes(head_dim) / self.block

    @abstractmethod
    def encode(self, r: torch.Tensor) -> torch.Tensor:
        """r fp32 [..., T, D] (T a multiple of `block`) -> uint8 [..., T / block, unit_bytes(D)]: exactly what the
        method stores."""

    @abstractmethod
    def decode(self, stored: torch.Tensor, head_dim: int) -> torch.Tensor:
        """uint8 [..., U, unit_bytes(D)] -> fp32 [..., U * block, D], the rebuild r^ added to the dequantized
        vectors."""


def as_dtype(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., n * size] bytes read as `dtype` [..., n] (a copy: a slice of stored bytes may start anywhere)."""
    import torch

    return raw.clone(memory_format=torch.contiguous_format).view(dtype)


def register_residual(name: str):
    """Class decorator: make `name` (the spelling's name) resolve to the decorated `Residual`."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name == NONE:
        raise ValueError(f"residual name {name!r} must be lower-case letters, digits and '_' (and not {NONE!r})")

    def decorate(cls: type[Residual]) -> type[Residual]:
        RESIDUALS.register(name, cls)  # refused if another class holds the name (a reloaded module may re-register)
        cls.name = name
        return cls

    return decorate


@cache
def get_residual(spelling: str) -> Residual:
    """The correction a spelling names (`qjl:64`), one-line errors that start with the spelling."""
    name, _, arg = spelling.partition(":")
    if name not in RESIDUALS:
        allowed = ", ".join([NONE, *(f"{n}:<{RESIDUALS[n].arg_name}>" for n in sorted(RESIDUALS))])
        raise QuantConfigError(f"{spelling!r} is not a registered residual correction; allowed: {allowed}")
    return RESIDUALS[name].parse(arg if ":" in spelling else None)


def check_residuals(spellings, knob: str) -> tuple[str, ...]:
    """Validated, canonical spellings of one tensor's corrections, from a name, `none`, or a list; one-line
    QuantConfigErrors that name the knob (`key_residual`)."""
    items = [] if spellings is None else list(spellings) if isinstance(spellings, (list, tuple)) else [spellings]
    if items == [NONE]:
        return ()
    out = []
    for i, s in enumerate(items):
        if not isinstance(s, str) or s == NONE:
            shown = f"{knob}={s!r}" if len(items) == 1 else f"{knob}[{i}]={s!r}"
            raise QuantConfigError(f"{shown}: give corrections (e.g. qjl:64, sparse:0.01), a list of them, or none")
        try:
            out.append(get_residual(s).spelling)
        except QuantConfigError as e:
            raise QuantConfigError(f"{knob}={e}") from None
    twice = next((s for i, s in enumerate(out) if s in out[:i]), None)
    if twice is not None:
        raise QuantConfigError(f"{knob} lists {twice} twice; give each correction once")
    return tuple(out)


def check_head_dim(spellings: tuple[str, ...], head_dim: int, knob: str) -> None:
    """Each correction can act on vectors of `head_dim` channels (one-line QuantConfigError naming the knob)."""
    for s in spellings:
        try:
            get_residual(s).check_head_dim(head_dim)
        except QuantConfigError as e:
            raise QuantConfigError(f"{knob}={s}: {e}") from None


@dataclass(frozen=True)
class Chain:
    """Corrections applied in order, each to what the ones before left (module docstring). Vectors [..., T, D].

    Stored in units of `block` tokens (the least common multiple of the members' blocks): a unit's bytes are each
    member's bytes for those tokens, in order."""

    residuals: tuple[Residual, ...]

    @property
    def block(self) -> int:
        return math.lcm(*(r.block for r in self.residuals))

    def unit_bytes(self, head_dim: int) -> int:
        return sum(self.block // r.block * r.unit_bytes(head_dim) for r in self.residuals)

    def token_bytes(self, head_dim: int) -> float:
        return self.unit_bytes(head_dim) / self.block

    def encode(self, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """r fp32 [..., T, D] (T a multiple of `block`) -> (stored uint8 [..., T / block, unit_bytes(D)], the
        correction r^ fp32 [..., T, D] it decodes to)."""
        import torch

        T, D, n = r.shape[-2], r.shape[-1], self.block
        if T % n:
            raise ValueError(f"a correction in units of {n} tokens encodes whole units; got {T} tokens")
        if n > 1:  # a block's error is held in fp16 until the block completes (module docstring): fit to that
            r = open_error(r)
        parts, total = [], torch.zeros_like(r)
        for c in self.residuals:
            b = c.encode(r - total)
            parts.append(b.reshape(*b.shape[:-2], T // n, n // c.block * b.shape[-1]))
            total = total + c.decode(b, D)
        return torch.cat(parts, -1), total

    def decode(self, stored: torch.Tensor, head_dim: int) -> torch.Tensor:
        """stored uint8 [..., U, unit_bytes(D)] -> the correction fp32 [..., U * block, D] (the sum `encode`
        returned)."""
        out, at, n = None, 0, self.block
        for c in self.residuals:
            per, ub = n // c.block, c.unit_bytes(head_dim)  # the member's units in one of the chain's, their bytes
            own = stored[..., at : at + per * ub]
            part = c.decode(own.reshape(*own.shape[:-2], own.shape[-2] * per, ub), head_dim)
            out, at = part if out is None else out + part, at + per * ub
        return out

    def correction(self, r: torch.Tensor) -> torch.Tensor:
        """r fp32 [..., T, D] (any T) -> r^ fp32 [..., T, D]: what the stored bytes rebuild (`encode`'s second
        result) for the whole units, and the fp16 error itself for the open unit's last T mod block tokens."""
        import torch

        whole = r.shape[-2] // self.block * self.block
        if whole == r.shape[-2]:
            return self.encode(r)[1]
        open_ = open_error(r[..., whole:, :])
        return torch.cat([self.encode(r[..., :whole, :])[1], open_], -2) if whole else open_


def open_error(r: torch.Tensor) -> torch.Tensor:
    """The error of an open unit's tokens as it is held until the unit completes: fp16, read back as fp32."""
    import torch

    return r.clamp(-65504.0, 65504.0).to(torch.float16).float()


def build_chain(spellings: tuple[str, ...]) -> Chain | None:
    """The chain of validated spellings (`check_residuals`), or None when there is none."""
    return Chain(tuple(map(get_residual, spellings))) if spellings else None
