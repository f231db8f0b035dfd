"""Positions for position-dependent transforms (`rope_pre`), without forking the model's attention.

Llama-style attention rotates keys (`k' = k*cos + rotate_half(k)*sin`) before calling `cache.update`, and passes
`position_ids` through to it. The cache recomputes cos/sin with the model's own rotary module at those positions
(`RopeHelper.positions`), so the `rope_pre` transform (`kvq_lab.quant.transforms.rope_pre`, the arithmetic) can undo
the rotation to store pre-RoPE keys and rotate dequantized keys back at their true positions.
"""

from __future__ import annotations

import weakref

import torch

from kvq_lab.kernels.workspace import version_of
from kvq_lab.quant.transforms import Positions
from kvq_lab.quant.transforms.rope_pre import rotate, rotate_half, unrotate

__all__ = [
    "POS_CHUNK",
    "PositionLog",
    "RopeHelper",
    "position_ids_from",
    "positions_for",
    "rotate_half",
    "step_position_ids",
]


POS_CHUNK = 256  # columns a `PositionLog` grows by


class PositionLog:
    """The position ids (int32) of cache positions [0, N) of a cache's layers, kept for position-dependent transforms
    (rope=pre: the CPU and Triton kernels rotate each stored key at its id, read from `ids` [B, >= N]): one buffer for
    all of a cache's layers, since they hold the same tokens at the same positions. An update's ids are written by the
    first layer that brings them and found there by the others (`keep`): a decode step writes one column once, where
    each layer writing its own buffer cost about 10 us a layer. Grown POS_CHUNK columns at a time (a new tensor: a
    reader holding the old one sees that `ids` is another tensor). `top`: the largest id kept (a rope table must
    cover it)."""

    def __init__(self):
        self.ids: torch.Tensor | None = None
        self.top = -1
        self._written = None  # (answer, N) of the latest `keep` that wrote
        self._holder = None  # weakref to the layer whose `nbytes` counts the buffer (the first to keep into it)

    def keep(self, answer: tuple[torch.Tensor, int], N: int, layer) -> None:
        """Hold `answer` (`step_position_ids`: ids [B, n], their largest) at cache positions [N, N + n). The same
        answer at the same N as the latest write is there already (every layer of a forward passes the same answer
        object): nothing to do."""
        w = self._written
        if w is not None and w[0] is answer and w[1] == N:
            return
        ids, top = answer
        B, n = ids.shape
        buf = self.ids
        if buf is not None and buf.shape[0] != B:
            if N > 0:
                raise RuntimeError(f"position ids of {B} rows for a cache of {buf.shape[0]} rows at position {N}")
            buf = None  # a new generation in a reset cache, another batch size
        if buf is None or buf.shape[1] < N + n:
            grown = ids.new_zeros(B, -(-(N + n) // POS_CHUNK) * POS_CHUNK)
            if buf is not None:
                grown[:, :N] = buf[:, :N]
            self.ids = buf = grown
        buf[:, N : N + n] = ids
        self.top = max(self.top, top)
        self._written = (answer, N)
        if self._holder is None or self._holder() is None:
            self._holder = weakref.ref(layer)

    def nbytes_for(self, layer) -> int:
        """The buffer's bytes where `layer` is the one that counts them (the first layer that kept ids here), else
        0: a cache's `nbytes` counts the buffer once."""
        if self.ids is None or self._holder is None or self._holder() is not layer:
            return 0
        return self.ids.numel() * self.ids.element_size()


class RopeHelper:
    """Wraps a model's rotary embedding module (`model.model.rotary_emb`): `module(x, position_ids) -> cos, sin`. One
    per cache: it also holds the cache's `PositionLog`s (`log`)."""

    def __init__(self, rotary_emb: torch.nn.Module, layer_type: str | None = None):
        self.rotary_emb = rotary_emb
        self.layer_type = layer_type  # models whose RoPE differs by layer type (Gemma 3): the module's third argument
        self._logs: dict[torch.device, PositionLog] = {}
        self._last: _Latest | None = None  # the latest `cos_sin` answer
        self._step: _Latest | None = None  # the latest `step_position_ids` answer

    def cos_sin(self, like: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, D] fp32 (the module's [B, T, D], broadcast over heads). Every layer of a forward asks for
        the same position ids: the latest answer is kept and returned again for those ids on the same device (one
        rotary call per step instead of one per layer; the module's output depends on the ids alone, except for RoPE
        types that rescale with the length, `dynamic` and `longrope`, which are never reused). Read-only."""
        if self._last is not None and self._last.holds(like.device, position_ids):
            return self._last.value
        with torch.no_grad():
            extra = () if self.layer_type is None else (self.layer_type,)
            cos, sin = self.rotary_emb(like.float(), position_ids, *extra)
        cos, sin = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
        if getattr(self.rotary_emb, "rope_type", "default") not in ("dynamic", "longrope"):
            self._last = _Latest(like.device, position_ids, (cos, sin))
        return cos, sin

    def log(self, device: torch.device) -> PositionLog:
        """The cache's `PositionLog` on `device` (one per device: a model split over devices keeps its layers' ids
        where they attend)."""
        log = self._logs.get(device)
        if log is None:
            log = self._logs[device] = PositionLog()
        return log

    def positions(self, like: torch.Tensor, position_ids: torch.Tensor) -> Positions:
        """`Positions` of tokens at position_ids [B, T] (like: any tensor on the target device)."""
        return Positions(position_ids, *self.cos_sin(like, position_ids))

    # the rope_pre transform's arithmetic, under the names this helper has always had
    rotate = staticmethod(rotate)
    unrotate = staticmethod(unrotate)


def positions_for(rope: RopeHelper | None, like: torch.Tensor, position_ids: torch.Tensor) -> Positions:
    """Positions with cos/sin where the model has RoPE (`rope`), else position ids alone."""
    return rope.positions(like, position_ids) if rope is not None else Positions(position_ids)


def position_ids_from(kwargs: dict, batch: int, start: int, length: int, device) -> torch.Tensor:
    """The positions the attention layer rotated with: `position_ids` from the layer's kwargs, else a range."""
    inner = kwargs.get("kwargs") if isinstance(kwargs.get("kwargs"), dict) else kwargs
    pos = inner.get("position_ids") if inner else None
    if pos is None:
        pos = torch.arange(start, start + length, device=device).unsqueeze(0)
    return pos.expand(batch, length)


def step_position_ids(
    rope: RopeHelper | None, kwargs: dict, batch: int, start: int, length: int, device
) -> tuple[torch.Tensor, int]:
    """int32 position ids [batch, length] of this update (`position_ids_from`) and the largest of them. With a
    `RopeHelper` (one per cache), computed once per forward: every layer passes the same `position_ids` tensor (or
    none, at the same start), so the latest answer is returned again for those ids at the same batch, start, length
    and device; each layer then hands the same ids tensor to `RopeHelper.cos_sin`, which knows it."""
    inner = kwargs.get("kwargs") if isinstance(kwargs.get("kwargs"), dict) else kwargs
    raw = inner.get("position_ids") if inner else None
    key = (batch, start, length, device)
    if rope is not None and rope._step is not None and rope._step.holds(key, raw):
        return rope._step.value
    ids = position_ids_from(kwargs, batch, start, length, device).to(torch.int32)
    answer = ids, int(ids.max()) if ids.numel() else -1
    if rope is not None:
        rope._step = _Latest(key, raw, answer)
    return answer


class _Latest:
    """An answer computed from a tensor `ids` (or from none) under `key`, kept to be given again: for that very tensor
    unmodified since (its version counter: no comparison), else for equal values (an inference tensor keeps no
    version; another tensor may hold the same ids)."""

    __slots__ = ("key", "ref", "version", "held", "value")

    def __init__(self, key, ids: torch.Tensor | None, value):
        self.key, self.value = key, value
        self.ref = None if ids is None else weakref.ref(ids)
        self.version = None if ids is None else version_of(ids)
        self.held = None if ids is None else ids.clone()

    def holds(self, key, ids: torch.Tensor | None) -> bool:
        """Whether `value` is the answer for `ids` under `key`."""
        if key != self.key or (ids is None) != (self.held is None):
            return False
        if ids is None:
            return True
        version = version_of(ids)
        if version is not None and self.ref() is ids and version == self.version:
            return True
        held = self.held
        return (
            ids.shape == held.shape and ids.dtype == held.dtype and ids.device == held.device and torch.equal(ids, held)
        )
