"""`interleave`: the head dim's channels in llama.cpp's order for Llama keys, RoPE pairs side by side.

A Llama model rotates channel i with channel i + D/2 (transformers' `rotate_half`). llama.cpp runs Llama with
adjacent pairs (2i, 2i + 1) instead, so its GGUF converter permutes the rows of W_q and W_k, and transformers undoes
that permutation when it loads a GGUF. The two programs compute the same attention, but their keys list the same
channels in different orders, and a block format groups consecutive channels: llama.cpp's first block of 32 holds
the pairs 0..15 whole (both halves of each rotating pair), transformers' holds the first halves of pairs 0..31.

    x_t[..., 2i] = x[..., i],   x_t[..., 2i + 1] = x[..., i + D/2]      (i < D/2)

quantizes keys in llama.cpp's layout (the presets `llamacpp_<type>` use it on keys). A permutation is orthogonal and
the same at every position, so attention folds it (the query permuted alike); it changes no value, only which
channels share a group. Keys only: values are not permuted by the converter.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvq_lab.quant.spec import QuantConfigError
from kvq_lab.quant.transforms import Transform, register_transform


@register_transform("interleave")
@dataclass(frozen=True)
class Interleave(Transform):
    """Rotate-half channel order -> interleaved RoPE pairs (module docstring)."""

    tensors = ("key",)
    foldable = True

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % 2:
            raise QuantConfigError(f"interleave pairs the channels of a head: head_dim={head_dim} is odd")

    def forward(self, x, pos=None):
        D = x.shape[-1]
        return x.unflatten(-1, (2, D // 2)).transpose(-1, -2).flatten(-2)

    def inverse(self, x, pos=None):
        D = x.shape[-1]
        return x.unflatten(-1, (D // 2, 2)).transpose(-1, -2).flatten(-2)
