"""Attention routing for the packed cache and token policies: the `kvq_sdpa` attention function and its registration
with transformers.

With `QuantizedKVCache.for_model` on an `sdpa` model, the model's attention is routed through `kvq_sdpa`, which hands
ordinary tensors to SDPA unchanged and, on decode steps, receives a `PackedKV` handle instead of K/V tensors: the
layer's `decode_view()` (plain tensors) then goes to its backend's `decode_attention`.

A token policy whose score reads queries (`kvq_lab.cache.layers.tiered`) is handed the prompt's queries and keys right
after the prompt's SDPA, through the attention module's `kvq_observer` (a weak reference to its cache layer). On a
batch's decode steps a token policy's layer hands a `MaskedKV` (each row's kept columns, right-aligned, and which
columns a row holds): the model's mask counts positions, not what each row kept, so the mask is made here instead.

Transforms (`kvq_lab.quant.transforms`): a pipeline that folds into attention (an orthogonal map M of the head dim,
e.g. hadamard) is applied here, around the kernel, which stays unaware of it: keys stored as k M are read with the
query q M (q M · k M = q · k); values stored as v M give the output (A v) M, mapped back with M^T. Once per decode
step each, whatever the cache length. The `hadamard` transform alone, with a backend that reads `hadamard` (the CPU
kernel), is mapped inside the kernel instead (`DecodeView.hadamard`: two copies and calls less per layer and step).
rope_pre alone on the keys, with a backend that reads `rope` (the CPU and Triton kernels), is undone in the kernel:
the view carries the codes and a cos/sin table, and each history key row is rotated at its position as it is read
(the window is kept as the model made it). Left-padded batches reach the kernel too where the backend reads per-row
layouts (`rows`); where it cannot take a step (a mask per query head, say: it raises `Unsupported` before any work),
the layer's K/V are materialized for the model's SDPA. Any other pipeline that does not fold comes undone in the
layer's view (history dequantized and re-rotated), which only the PyTorch path reads.
"""

from __future__ import annotations

from kvq_lab.kernels.torch_path import decode_attention_torch
from kvq_lab.kernels.view import Unsupported

ATTN_NAME = "kvq_sdpa"
_sdpa = None  # transformers' `sdpa_attention_forward`, bound by `register()`


def register() -> None:
    """Register `kvq_sdpa` (and its mask: SDPA's) with transformers, once, when a model is first routed: the modules
    that hold the registries import torch's compiler (~3 s), which a config refused before any load never needs."""
    global _sdpa
    if _sdpa is not None:
        return
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(ATTN_NAME, kvq_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)
    _sdpa = sdpa_attention_forward


class PackedKV:
    """What a layer's `update` hands the attention function on fused decode steps: the layer, not tensors. The layer
    provides `decode_view()`, `backend` and its transform pipelines `k_pipe`, `v_pipe` (None: no transform)."""

    __slots__ = ("layer",)

    def __init__(self, layer):
        self.layer = layer


class MaskedKV:
    """What a token policy's layer hands the attention function on a batch's steps (`kvq_lab.cache.layers.tiered`): K/V
    [B, Hkv, S, D], each row's columns right-aligned, and `valid` [B, S] (False: a column the row does not hold). The
    step's n new tokens are every row's last n columns."""

    __slots__ = ("keys", "valid", "values")

    def __init__(self, keys, values, valid):
        self.keys, self.values, self.valid = keys, values, valid

    def mask(self, n: int):
        """[B, 1, n, S] bool, True = attend: a row's own columns, the new tokens causally."""
        import torch

        S = self.keys.shape[2]
        i = torch.arange(n, device=self.valid.device)[:, None]
        causal = torch.arange(S, device=self.valid.device)[None, :] <= S - n + i  # [n, S]
        return self.valid[:, None, None, :] & causal[None, None]


def route_model(model, layers) -> bool:
    """Route an `sdpa` model's attention through `kvq_sdpa` and mark `layers` fused; True when routed.

    The routed function passes ordinary tensors to SDPA unchanged, so other caches see the same model.
    """
    register()
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
    """`kvq_sdpa`: SDPA for ordinary tensors, the packed-cache decode path for `PackedKV` handles, SDPA under the
    handle's own mask for `MaskedKV` ones.

    query [B, Hq, 1, D] -> ([B, 1, Hq, D], None) on decode steps, the layout `sdpa_attention_forward` returns.
    """
    if isinstance(key, MaskedKV):  # a token policy's batch: each row's own columns (the class docstring)
        mask = key.mask(query.shape[2])
        return _sdpa(module, query, key.keys, key.values, mask, dropout=dropout, scaling=scaling, **kwargs)
    if not isinstance(key, PackedKV):
        out = _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        observer = getattr(module, "kvq_observer", None)  # a token policy ranking the prompt by its queries
        layer = observer() if observer is not None else None
        if layer is not None and layer.wants_queries(query):
            layer.observe(query, key, scaling if scaling is not None else query.shape[-1] ** -0.5)
        return out
    layer = key.layer
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    kp, vp = layer.k_pipe, layer.v_pipe
    kept = layer.kept_call()  # an earlier step's call, with the maps made around it then
    if kept is not None:
        call, fold_q, fold_o = kept[:3]
        out = call(kp.fold_query(query) if fold_q else query, attention_mask, scaling, *layer.moving())
        if out is not None:
            return (vp.fold_output(out) if fold_o else out), None
    view = layer.decode_view()  # with the extensions the layer's backend reads (`Backend.features`)
    # a history dequantized in the view (a pipeline undone there, sparse outliers): only the PyTorch path reads it
    undone = view.keys.history is not None or view.values.history is not None
    fused = decode_attention_torch if undone else layer.backend.decode_attention
    maps = view.hadamard or (0, 0)  # the hadamard maps the kernel makes itself (keys', values')
    fold_q = kp is not None and kp.foldable and not maps[0]
    fold_o = vp is not None and vp.foldable and not maps[1]
    q = kp.fold_query(query) if fold_q else query  # keys as k M: q M · k M
    try:
        out = fused(view, q, attention_mask, scaling)  # [B, 1, Hq, D]
        if not undone:
            layer.keep(view, q, fold_q, fold_o)  # the next steps' call, while the layer's stored tensors stay
    except Unsupported:  # a view with an extension the kernel cannot take with this query or mask (checked first)
        if view.pads is not None:  # a padded batch: the model's SDPA over full K/V
            k, v = layer.materialize()
            return _sdpa(module, query, k, v, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        view = layer.view_for(frozenset())  # rope=pre keys as a dequantized, rotated history; the maps made here
        q = kp.fold_query(query) if kp is not None and kp.foldable else query
        fold_o = vp is not None and vp.foldable
        out = decode_attention_torch(view, q, attention_mask, scaling)
    if fold_o:
        out = vp.fold_output(out)  # values are stored as v M: the output is (A v) M
    return out, None
