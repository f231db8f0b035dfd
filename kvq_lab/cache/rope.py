"""RoPE bookkeeping for pre-RoPE key quantization, without forking the model's attention.

Llama-style attention rotates keys (`k' = k*cos + rotate_half(k)*sin`) before calling `cache.update`, and
passes `position_ids` through to it. The cache recomputes cos/sin with the model's own rotary module, undoes
the rotation to store pre-RoPE keys, and rotates dequantized keys back at their true positions.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RopeHelper:
    """Wraps a model's rotary embedding module (`model.model.rotary_emb`): `module(x, position_ids) -> cos, sin`."""

    def __init__(self, rotary_emb: torch.nn.Module):
        self.rotary_emb = rotary_emb

    def cos_sin(self, like: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # cos, sin: [B, T, D] in fp32 -> [B, 1, T, D] to broadcast over heads
        with torch.no_grad():
            cos, sin = self.rotary_emb(like.float(), position_ids)
        return cos.float().unsqueeze(1), sin.float().unsqueeze(1)

    @staticmethod
    def rotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """k [B, H, T, D] pre-RoPE -> post-RoPE (in k's dtype), the attention layer's own formula."""
        kf = k.float()
        return (kf * cos + rotate_half(kf) * sin).to(k.dtype)

    @staticmethod
    def unrotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Inverse of `rotate`: R^T k / |R|^2, exact for any attention scaling folded into cos/sin."""
        kf = k.float()
        return ((kf * cos - rotate_half(kf) * sin) / (cos * cos + sin * sin)).to(k.dtype)


def position_ids_from(kwargs: dict, batch: int, start: int, length: int, device) -> torch.Tensor:
    """The positions the attention layer rotated with: `position_ids` from the layer's kwargs, else a range."""
    inner = kwargs.get("kwargs") if isinstance(kwargs.get("kwargs"), dict) else kwargs
    pos = inner.get("position_ids") if inner else None
    if pos is None:
        pos = torch.arange(start, start + length, device=device).unsqueeze(0)
    return pos.expand(batch, length)
