"""Transforms around the quantizer: maps applied to a tensor before it is quantized and undone after dequantization
(or folded into attention). One implementation, used by simulated mode, packed mode and the probes.

A transform acts on keys or values x [B, H, T, D] of one layer:

    x_t = forward(x, pos)              what the quantizer sees
    x'  = inverse(deq(x_t), pos)       what attention sees (deq: quantize, then dequantize)

`pos` (`Positions`) says where the T tokens sit, for position-dependent transforms (`rope_pre` needs the cos/sin the
model's RoPE rotated the keys with); the others ignore it. Arithmetic is fp32; results come back in x's dtype.

Folding into attention: a transform that is an orthogonal map M of the head dimension, the same at every position
(`foldable`), need not be undone token by token. Keys: (q M)·(k M) = q·k, so the query is mapped with `forward` once
per decode step and the stored keys are read as they are. Values: A (v M) = (A v) M, so the attention output is
mapped back with `inverse` once per step (a foldable map that is not orthogonal, innerq's diagonal D, maps the
query with D^-T instead: `fold_query`; (q D^-T)·(k D) = q·k). The packed cache does this around its fused kernels
(which take plain tensors and know nothing of transforms); a pipeline that is not foldable is undone on the
dequantized tensor.

Transforms compose: a list is applied in order and undone in reverse (`Pipeline`). Tokens that are never quantized
(sinks) are never transformed, except where attention runs in a foldable pipeline's basis (the packed cache maps its
exact sinks into it for the kernel, and keeps them exact).

Spelling (the run config's `key_transform` / `value_transform`): `name` or `name:arg`, where `arg` is the
transform's one option (`hadamard:64`: blocks of 64 channels). A list composes: `key_transform=[rope_pre,hadamard]`.

Registered transforms (`TRANSFORMS`: one registry line each, imported on first lookup):
    rope_pre   keys only: undo the model's RoPE so keys are quantized before rotation, re-rotate after (KVQuant)
    hadamard   a fixed orthonormal Hadamard rotation of the head dim, whole or in blocks (QuaRot)
    rhadamard  a seeded randomized Hadamard rotation: random signs, then Hadamard (TurboQuant's engines)
    interleave keys only: channels in llama.cpp's order for Llama (RoPE pairs adjacent), as its block types group them
    innerq     keys only, fitted: per-(head, channel) power-of-two key scale, folded into the query (InnerQ)
    rotatekv   fitted: per-head channel reorder by calibration magnitude + Hadamard blocks (RotateKV)

Fitted transforms (`fitted = True`: innerq, rotatekv) take their parameters from data: the bare spelling (`innerq`)
names the method and has none (using it raises a one-line error), `kvq_lab.fit.calibration` fits one instance per layer
(`fit`), registers it with `register_fitted`, and the layer's config names it `innerq@<digest>`, a spelling that
`get_transform` resolves in this process. `example()` gives an instance fitted on synthetic keys, for tests.

This module imports neither torch nor its plugins: `TRANSFORMS` names each built-in by "module:Name" and imports it on
first lookup (its `@register_transform` runs then), and config validation (torch-free) reads the registry. Plugin
modules therefore import torch inside their functions. See README.md, "Adding a format / transform / policy", for a
new transform.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cache, cached_property
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from kvq_lab.common.registry import Registry
from kvq_lab.quant.spec import QuantConfigError

if TYPE_CHECKING:
    import torch

TENSORS = ("key", "value")
NONE = "none"  # the spelling of "no transform" in the run config

# The built-in transforms: one registry line each, imported on first lookup (kvq_lab.common.registry).
TRANSFORMS: Registry[type[Transform]] = Registry(
    "transform",
    lazy={
        "hadamard": "kvq_lab.quant.transforms.hadamard:Hadamard",
        "innerq": "kvq_lab.quant.transforms.innerq:InnerQ",
        "interleave": "kvq_lab.quant.transforms.interleave:Interleave",
        "rhadamard": "kvq_lab.quant.transforms.rhadamard:RandomizedHadamard",
        "rope_pre": "kvq_lab.quant.transforms.rope_pre:RopePre",
        "rotatekv": "kvq_lab.quant.transforms.rotatekv:RotateKV",
    },
)


class Positions(NamedTuple):
    """Where the T tokens of a [B, H, T, D] tensor sit, for position-dependent transforms.

    ids: [B, T] position ids (what the model's attention rotated the keys at).
    cos, sin: [B, 1, T, D] fp32, the RoPE rotation at those positions (broadcast over heads), or None for a model
        without RoPE (`kvq_lab.cache.routing.rope.RopeHelper.positions` computes them with the model's rotary module).
    """

    ids: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None

    def take(self, rows, t: slice) -> Positions:
        """The positions of batch rows `rows` (slice or index list) and tokens `t`."""
        f = None if self.cos is None else (lambda c: c[rows, :, t])
        return Positions(self.ids[rows, t], f and f(self.cos), f and f(self.sin))

    def cat(self, later: Positions) -> Positions:
        """These positions followed by `later`'s, along tokens."""
        import torch

        if self.cos is None:
            return Positions(torch.cat([self.ids, later.ids], 1))
        ids = torch.cat([self.ids, later.ids], 1)
        return Positions(ids, torch.cat([self.cos, later.cos], 2), torch.cat([self.sin, later.sin], 2))


class Transform(ABC):
    """One map of a [B, H, T, D] tensor around its quantizer (see the module docstring).

    Subclasses are frozen dataclasses registered with `register_transform`; their fields are their options, and the
    class attributes below declare what the cache and validation need to know:
        tensors           which tensors it may wrap ("key", "value")
        positional        forward/inverse read `Positions` (the cache records positions for it)
        foldable          an orthogonal map of the head dim, the same at every position: attention may run in its
                          basis (query mapped with `forward`, output mapped back with `inverse`)
        first             must see the tensor as the model made it (it undoes something the model did)
        skip_unquantized  dropped around a 16-bit (identity) quantizer, where it would only add rounding
        fitted            its parameters are fitted on calibration data (`fit`); the bare spelling has none
        kernel_feature    a kernel feature (`kvq_lab.cache.routing.backends.Backend.features`) that applies this
                          transform inside the decode kernel when it is a tensor's only one (`rope`, `hadamard`), or
    None and what it stores besides the codes: `stored_bits` (per layer, e.g. fitted scales), which the byte accounting
    adds to the format's own cost.
    """

    name: ClassVar[str] = ""  # set by `register_transform`
    tensors: ClassVar[tuple[str, ...]] = TENSORS
    positional: ClassVar[bool] = False
    foldable: ClassVar[bool] = False
    first: ClassVar[bool] = False
    skip_unquantized: ClassVar[bool] = False
    fitted: ClassVar[bool] = False  # parameters fitted on calibration data (`fit`); the bare spelling has none
    kernel_feature: ClassVar[str | None] = None  # the kernel feature that applies it in the decode kernel, if any

    @classmethod
    def example(cls) -> Transform:
        """An instance usable on any [B, H, T, D] tensor, for the registry-driven tests: the bare spelling, or for a
        fitted transform one fitted on synthetic keys with outlier channels (registered, so its spelling resolves)."""
        return cls.parse(None)

    @classmethod
    def parse(cls, arg: str | None) -> Transform:
        """The transform from the argument of its spelling (`hadamard:64` -> "64"; None without one)."""
        if arg is not None:
            raise QuantConfigError(f"{cls.name}:{arg} gives an argument, but {cls.name} takes none; write {cls.name}")
        return cls()

    @property
    def spelling(self) -> str:
        """How the run config writes this transform (`get_transform(t.spelling) == t`)."""
        return self.name

    @property
    def label(self) -> str:
        """Short name in cache labels (`_Khad`)."""
        return self.name

    def fit(self, x: torch.Tensor) -> Transform:
        """Fitted transforms: an instance fitted on calibration data x [B, H, T, D] (as this transform would see it),
        registered (`register_fitted`). Others need no data: themselves."""
        return self

    def stored_bits(self, heads: int, head_dim: int) -> int:
        """Bits this transform stores once per layer for a tensor of `heads` kv heads of `head_dim` channels (its
        fitted parameters), counted by the byte accounting on top of the codes: 0 for a map fixed by its spelling."""
        return 0

    def check_head_dim(self, head_dim: int) -> None:  # noqa: B027  (most transforms act on any head dim)
        """Raise a one-line QuantConfigError if the transform cannot act on heads of `head_dim` channels."""

    @abstractmethod
    def forward(self, x: torch.Tensor, pos: Positions | None = None) -> torch.Tensor:
        """x [B, H, T, D] -> what the quantizer sees, [B, H, T, D] in x's dtype."""

    @abstractmethod
    def inverse(self, x: torch.Tensor, pos: Positions | None = None) -> torch.Tensor:
        """Undo `forward`: inverse(forward(x)) == x up to fp32 rounding. [B, H, T, D] in x's dtype."""

    def forward_pair(
        self, a: torch.Tensor, b: torch.Tensor, pos: Positions | None = None, out=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(a), forward(b)): a layer's new key and value under one pipeline, every decode step. A transform
        may make both in one call where that is faster (hadamard's native transform), with the same bits, and may
        write them into `out` (two tensors of a's shape and dtype, where the cache keeps them), returning `out`:
        a hint, which the default ignores (the results are the returned pair, wherever they are)."""
        return self.forward(a, pos), self.forward(b, pos)

    def fold_query(self, q: torch.Tensor) -> torch.Tensor:
        """Foldable transforms: the query [..., D] mapped so that its product with stored keys is q·k (q M^-T, which
        is q M for an orthogonal M), in q's dtype. `forward` by default (orthogonal maps); a transform may compute
        the same map another way where that is faster (it runs once per layer and decode step), equal to it up to fp32
        rounding."""
        return self.forward(q)

    def fold_output(self, o: torch.Tensor) -> torch.Tensor:
        """Foldable transforms: an attention output over stored values [..., D] mapped back ((A v M) M^-1 = A v), in
        o's dtype. `inverse` by default; the same freedom as `fold_query`."""
        return self.inverse(o)


def register_transform(name: str):
    """Class decorator: make `name` (the spelling in the run config) resolve to the decorated `Transform`."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name == NONE:
        raise ValueError(f"transform name {name!r} must be lower-case letters, digits and '_' (and not {NONE!r})")

    def decorate(cls: type[Transform]) -> type[Transform]:
        TRANSFORMS.register(name, cls)  # refused if another class holds the name (a reloaded module may re-register)
        cls.name = name
        return cls

    return decorate


FITTED: dict[str, Transform] = {}  # `name@digest` -> a fitted instance (`register_fitted`), this process only


def register_fitted(t: Transform) -> str:
    """Make a fitted transform resolvable by its spelling (`innerq@1a2b3c4d5e6f`); returns the spelling."""
    FITTED[t.spelling] = t
    return t.spelling


@cache
def _bare(spelling: str) -> Transform:
    name, _, arg = spelling.partition(":")
    if name not in TRANSFORMS:
        raise QuantConfigError(
            f"{spelling!r} is not a registered transform; allowed: {', '.join([NONE, *sorted(TRANSFORMS)])}"
        )
    return TRANSFORMS[name].parse(arg if ":" in spelling else None)


def get_transform(spelling: str) -> Transform:
    """The transform a spelling names (`hadamard`, `hadamard:64`, `rope_pre`, a fitted `innerq@<digest>`), with
    one-line errors that start with the spelling (callers prefix the setting's name: `key_transform=`)."""
    if "@" in spelling:
        if spelling not in FITTED:
            raise QuantConfigError(
                f"{spelling!r} names a fitted transform this process has not fitted; give the bare name "
                f"({spelling.partition('@')[0]}) and let calibration fit it"
            )
        return FITTED[spelling]
    return _bare(spelling)


def check_transforms(spellings, tensor: str, knob: str) -> tuple[str, ...]:
    """Validated, canonical spellings of one tensor's transforms, from a name, `none`, or a list of names.

    knob: the setting's name in error messages (e.g. `key_transform`). Raises a one-line QuantConfigError for an
    unknown name, a transform that does not apply to `tensor`, one listed twice, or one that must come first.
    """
    items = [] if spellings is None else list(spellings) if isinstance(spellings, (list, tuple)) else [spellings]
    if items == [NONE]:
        return ()
    out = []
    for i, s in enumerate(items):
        if not isinstance(s, str) or s == NONE:
            shown = f"{knob}={s!r}" if len(items) == 1 else f"{knob}[{i}]={s!r}"
            raise QuantConfigError(
                f"{shown}: give transform names ({', '.join(sorted(TRANSFORMS))}), a list of them, or {NONE} alone"
            )
        try:
            t = get_transform(s)
        except QuantConfigError as e:
            raise QuantConfigError(f"{knob}={e}") from None
        if tensor not in t.tensors:
            which = " and ".join(x + "s" for x in t.tensors)
            raise QuantConfigError(f"{knob}={s}: {t.name} transforms {which} only; remove it from {knob}")
        if t.first and i:
            order = ",".join([s, *(x for x in items if x != s)])
            raise QuantConfigError(f"{knob}: {t.name} must come first (it undoes what the model did); write [{order}]")
        if t.name in (get_transform(x).name for x in out):
            raise QuantConfigError(f"{knob} lists {t.name} twice; give each transform once")
        out.append(t.spelling)
    return tuple(out)


def check_head_dim(spellings: tuple[str, ...], head_dim: int, knob: str) -> None:
    """Each transform can act on heads of `head_dim` channels (one-line QuantConfigError naming the knob)."""
    for s in spellings:
        try:
            get_transform(s).check_head_dim(head_dim)
        except QuantConfigError as e:
            raise QuantConfigError(f"{knob}={s}: {e}") from None


@dataclass(frozen=True)
class Pipeline:
    """Transforms applied in order before the quantizer and undone in reverse after it. x: [B, H, T, D]."""

    transforms: tuple[Transform, ...]

    @cached_property
    def positional(self) -> bool:
        """Some transform reads `Positions`."""
        return any(t.positional for t in self.transforms)

    @cached_property
    def foldable(self) -> bool:
        """Every transform folds into attention, so the whole pipeline does (query: `forward`, output: `inverse`).
        Kept once computed (the transforms are fixed): the cache reads it per layer and decode step."""
        return all(t.foldable for t in self.transforms)

    def forward(self, x: torch.Tensor, pos: Positions | None = None) -> torch.Tensor:
        for t in self.transforms:
            x = t.forward(x, pos)
        return x

    def forward_pair(
        self, a: torch.Tensor, b: torch.Tensor, pos: Positions | None = None, out=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(a), forward(b)), each transform taking both at once (`Transform.forward_pair`); `out` goes to the
        last one (the one whose results are final)."""
        last = len(self.transforms) - 1
        for i, t in enumerate(self.transforms):
            a, b = t.forward_pair(a, b, pos, out if i == last else None)
        return a, b

    def inverse(self, x: torch.Tensor, pos: Positions | None = None) -> torch.Tensor:
        for t in reversed(self.transforms):
            x = t.inverse(x, pos)
        return x

    def fold_query(self, q: torch.Tensor) -> torch.Tensor:
        """A foldable pipeline's query map (every transform's `fold_query`, in order)."""
        for t in self.transforms:
            q = t.fold_query(q)
        return q

    def fold_output(self, o: torch.Tensor) -> torch.Tensor:
        """A foldable pipeline's output map (every transform's `fold_output`, in reverse)."""
        for t in reversed(self.transforms):
            o = t.fold_output(o)
        return o


def build_pipeline(spellings: tuple[str, ...], quantized: bool = True) -> Pipeline | None:
    """The pipeline of validated spellings (`check_transforms`), or None when nothing is left to apply.

    quantized=False (a 16-bit, identity quantizer): transforms that declare `skip_unquantized` are dropped.
    """
    ts = tuple(t for t in map(get_transform, spellings) if quantized or not t.skip_unquantized)
    return Pipeline(ts) if ts else None
