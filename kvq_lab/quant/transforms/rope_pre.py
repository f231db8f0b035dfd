"""`rope_pre`: quantize keys before RoPE (KVQuant, Hooper et al. 2024, "pre-RoPE key quantization").

Llama-style attention rotates keys before they reach the cache: k_post = k*cos + rotate_half(k)*sin, a rotation of
each channel pair (i, i + D/2) by the position's angle. Outlier channels of pre-RoPE keys are fixed; RoPE smears
them across each pair at a position-dependent angle, so quantizing per channel before RoPE keeps the structure that
per-channel groups exploit.

    forward   k_pre = (k*cos - rotate_half(k)*sin) / (cos^2 + sin^2)   un-rotate (exact for any scaling folded into
                                                                       cos/sin, as some RoPE variants do)
    inverse   k     = k_pre*cos + rotate_half(k_pre)*sin               the attention layer's own formula

cos, sin: [B, 1, T, D] fp32 at the tokens' positions (`Positions`), from the model's rotary module. Keys only;
must come first (it undoes what the model did); dropped around a 16-bit quantizer, where it would only add rounding
(so rope=pre at 16 bits is DynamicCache bit for bit, the baseline of the rope_order study). Position-dependent, so
attention cannot fold it: the dequantized keys are re-rotated at their positions. `rope=pre` is its alias.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvq_lab.quant.transforms import Positions, Transform, register_transform

if TYPE_CHECKING:
    import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: (x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    import torch

    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


_LAST: list = [None]  # (cos, sin) weak references and what `_shared` derived from them


def _shared(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos^2 + sin^2, and sin with its first half negated, for the latest cos/sin: every layer of a decode step gets
    the same cos/sin tensors (`kvq_lab.cache.routing.rope.RopeHelper` keeps them), so these are computed once per
    step."""
    import torch

    last = _LAST[0]
    if last is not None and last[0]() is cos and last[1]() is sin:
        return last[2], last[3]
    h = sin.shape[-1] // 2
    norm, signed = cos * cos + sin * sin, torch.cat((-sin[..., :h], sin[..., h:]), dim=-1)
    _LAST[0] = (weakref.ref(cos), weakref.ref(sin), norm, signed)
    return norm, signed


def rotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """k [B, H, T, D] pre-RoPE -> post-RoPE (in k's dtype), the attention layer's own formula,
    k*cos + rotate_half(k)*sin (rotate_half(k)*sin computed as roll(k)*signed sin: the same bits)."""
    kf = k.float()
    _, signed = _shared(cos, sin)
    return (kf * cos + kf.roll(kf.shape[-1] // 2, -1) * signed).to(k.dtype)


def unrotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of `rotate`: R^T k / |R|^2 = (k*cos - rotate_half(k)*sin) / (cos^2 + sin^2), exact for any attention
    scaling folded into cos/sin."""
    kf = k.float()
    norm, signed = _shared(cos, sin)
    return ((kf * cos - kf.roll(kf.shape[-1] // 2, -1) * signed) / norm).to(k.dtype)


@register_transform("rope_pre")
@dataclass(frozen=True)
class RopePre(Transform):
    """Keys quantized before RoPE and re-rotated at their positions after dequantization (module docstring)."""

    tensors = ("key",)
    positional = True
    first = True
    skip_unquantized = True
    kernel_feature = "rope"  # kernels that read `DecodeView.rope` rotate the stored pre-RoPE keys themselves

    @property
    def label(self) -> str:
        return "preRoPE"

    @staticmethod
    def _cos_sin(pos: Positions | None):
        if pos is None or pos.cos is None:
            raise ValueError(
                "rope=pre (key_transform=rope_pre) needs the cos/sin of the model's RoPE at the keys' positions; "
                "build the cache with QuantizedKVCache.for_model on a model with a rotary embedding"
            )
        return pos.cos, pos.sin

    def forward(self, x, pos=None):
        return unrotate(x, *self._cos_sin(pos))

    def inverse(self, x, pos=None):
        return rotate(x, *self._cos_sin(pos))
