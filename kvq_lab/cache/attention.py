"""Attention routing for the packed cache: the `kvq_sdpa` attention function and its registration with transformers.

With `QuantizedKVCache.for_model` on an `sdpa` model, the model's attention is routed through `kvq_sdpa`, which hands
ordinary tensors to SDPA unchanged and, on decode steps, receives a `PackedKV` handle instead of K/V tensors: the
layer's `decode_view()` (plain tensors) then goes to its backend's `decode_attention`. Layers with pre-RoPE keys go
to the PyTorch path, the one decode attention that re-rotates dequantized keys (their view carries them dequantized).
"""

from __future__ import annotations

from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvq_lab.kernels.torch_path import decode_attention_torch

ATTN_NAME = "kvq_sdpa"


class PackedKV:
    """What a layer's `update` hands the attention function on fused decode steps: the layer, not tensors. The layer
    provides `decode_view()`, `backend` and `rope` (None unless keys are stored pre-RoPE)."""

    __slots__ = ("layer",)

    def __init__(self, layer):
        self.layer = layer


def route_model(model, layers) -> bool:
    """Route an `sdpa` model's attention through `kvq_sdpa` and mark `layers` fused; True when routed.

    The routed function passes ordinary tensors to SDPA unchanged, so other caches see the same model.
    """
    impl = getattr(model.config, "_attn_implementation", None)
    if impl == "sdpa":
        model.set_attn_implementation(ATTN_NAME)
        impl = ATTN_NAME
    if impl != ATTN_NAME:
        return False
    for layer in layers:
        layer.fused = True
    return True


def kvq_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """`kvq_sdpa`: SDPA for ordinary tensors, the packed-cache decode path for `PackedKV` handles.

    query [B, Hq, 1, D] -> ([B, 1, Hq, D], None) on decode steps, the layout `sdpa_attention_forward` returns.
    """
    if not isinstance(key, PackedKV):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    layer = key.layer
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    fused = layer.backend.decode_attention
    if layer.rope is not None:  # rope=pre re-rotates dequantized keys at their positions: only PyTorch does that
        fused = decode_attention_torch
    return fused(layer.decode_view(), query, attention_mask, scaling), None


ALL_ATTENTION_FUNCTIONS.register(ATTN_NAME, kvq_sdpa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)
