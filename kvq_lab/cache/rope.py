"""Positions for position-dependent transforms (`rope_pre`), without forking the model's attention.

Llama-style attention rotates keys (`k' = k*cos + rotate_half(k)*sin`) before calling `cache.update`, and passes
`position_ids` through to it. The cache recomputes cos/sin with the model's own rotary module at those positions
(`RopeHelper.positions`), so the `rope_pre` transform (`kvq_lab.quant.transforms.rope_pre`, the arithmetic) can undo
the rotation to store pre-RoPE keys and rotate dequantized keys back at their true positions.
"""

from __future__ import annotations

import torch

from kvq_lab.quant.transforms import Positions
from kvq_lab.quant.transforms.rope_pre import rotate, rotate_half, unrotate

__all__ = ["RopeHelper", "position_ids_from", "positions_for", "rotate_half"]


class RopeHelper:
    """Wraps a model's rotary embedding module (`model.model.rotary_emb`): `module(x, position_ids) -> cos, sin`."""

    def __init__(self, rotary_emb: torch.nn.Module):
        self.rotary_emb = rotary_emb
        self._last: tuple | None = None  # (position ids, device, cos, sin) of the latest call

    def cos_sin(self, like: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, D] fp32 (the module's [B, T, D], broadcast over heads). Every layer of a forward asks for
        the same position ids: the latest answer is kept and returned again for equal ids on the same device (one
        rotary call per step instead of one per layer; the module's output depends on the ids alone, except for RoPE
        types that rescale with the length, `dynamic` and `longrope`, which are never reused). Read-only."""
        last = self._last
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
            self._last = (position_ids.clone(), like.device, cos, sin)
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
