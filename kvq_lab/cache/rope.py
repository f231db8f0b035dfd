"""Positions for position-dependent transforms (`rope_pre`), without forking the model's attention.

Llama-style attention rotates keys (`k' = k*cos + rotate_half(k)*sin`) before calling `cache.update`, and passes
`position_ids` through to it. The cache recomputes cos/sin with the model's own rotary module at those positions
(`RopeHelper.positions`), so the `rope_pre` transform (`kvq_lab.quant.transforms.rope_pre`, the arithmetic) can undo
the rotation to store pre-RoPE keys and rotate dequantized keys back at their true positions.
"""

from __future__ import annotations

import weakref

import torch

from kvq_lab.quant.transforms import Positions
from kvq_lab.quant.transforms.rope_pre import rotate, rotate_half, unrotate

__all__ = ["RopeHelper", "position_ids_from", "positions_for", "rotate_half", "step_position_ids"]


class RopeHelper:
    """Wraps a model's rotary embedding module (`model.model.rotary_emb`): `module(x, position_ids) -> cos, sin`."""

    def __init__(self, rotary_emb: torch.nn.Module):
        self.rotary_emb = rotary_emb
        self._last: tuple | None = None  # (position ids, device, cos, sin, ids tensor ref, its version): latest call
        self._step: tuple | None = None  # the latest `step_position_ids` answer and its key

    def cos_sin(self, like: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, D] fp32 (the module's [B, T, D], broadcast over heads). Every layer of a forward asks for
        the same position ids: the latest answer is kept and returned again for equal ids on the same device (one
        rotary call per step instead of one per layer; the module's output depends on the ids alone, except for RoPE
        types that rescale with the length, `dynamic` and `longrope`, which are never reused). Read-only."""
        last = self._last
        version = _version_of(position_ids)
        if (
            last is not None
            and version is not None
            and last[4]() is position_ids
            and last[5] == version
            and (last[1] == like.device)
        ):
            return last[2], last[3]  # the very tensor of the latest call (`step_position_ids` hands every layer one)
        if (
            last is not None
            and last[1] == like.device
            and last[0].shape == position_ids.shape
            and last[0].dtype == position_ids.dtype
            and last[0].device == position_ids.device
            and torch.equal(last[0], position_ids)
        ):
            return last[2], last[3]
        with torch.no_grad():
            cos, sin = self.rotary_emb(like.float(), position_ids)
        cos, sin = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
        if getattr(self.rotary_emb, "rope_type", "default") not in ("dynamic", "longrope"):
            ref = weakref.ref(position_ids)
            self._last = (position_ids.clone(), like.device, cos, sin, ref, version)
        return cos, sin

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
    none, at the same start), so the latest answer is returned again for that very tensor, unmodified (its version),
    at the same batch, start, length and device; each layer then hands the same ids to `RopeHelper.cos_sin`."""
    inner = kwargs.get("kwargs") if isinstance(kwargs.get("kwargs"), dict) else kwargs
    raw = inner.get("position_ids") if inner else None
    key = (batch, start, length, device, None if raw is None else _version_of(raw))
    last = rope._step if rope is not None else None
    if last is not None and last[0] == key:
        if raw is None and last[1] is None:
            return last[2], last[3]
        if raw is not None and last[1] is not None and last[1]() is raw:
            # the same tensor: unmodified since (its version), or, for an inference tensor (no version), equal values
            if key[-1] is not None or torch.equal(raw, last[4]):
                return last[2], last[3]
    ids = position_ids_from(kwargs, batch, start, length, device).to(torch.int32)
    top = int(ids.max()) if ids.numel() else -1
    if rope is not None:
        held = None if raw is None or key[-1] is not None else raw.clone()
        rope._step = (key, None if raw is None else weakref.ref(raw), ids, top, held)
    return ids, top


def _version_of(t: torch.Tensor) -> int | None:
    """t's version counter (bumped by in-place writes), or None for an inference tensor, which keeps none."""
    try:
        return t._version
    except RuntimeError:
        return None
