"""Capture the queries, keys and values each attention layer really consumes, without forking attention.

transformers (5.x) Llama-style attention projects q/k/v, applies RoPE, and calls the attention function found under
`config._attn_implementation` in `ALL_ATTENTION_FUNCTIONS` (eager when the name is `eager` and nothing is
registered). For one forward pass we put a wrapper under that same name: it records its inputs (post-RoPE query
`[B, H, T, D]`, key and value `[B, H_kv, T, D]`, the scaling and the GQA group count) and the attention output
`[B, T, H, D]`, then returns the original function's result unchanged, so the model computes exactly what it
would have. The override is local to the process's `ALL_ATTENTION_FUNCTIONS` instance and removed on exit.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class LayerCapture:
    """What one attention layer consumed in one forward pass (batch 1, no cache: T queries over T keys).

    query: [H, T, D] post-RoPE; key, value: [H_kv, T, D] (key post-RoPE); output: [H, T, D] the model's own
    attention output (before o_proj). scaling: the softmax scale; groups: H // H_kv (GQA). window: a sliding-window
    layer's window (a query sees itself and the window - 1 keys before it; Gemma 3: 512), None for a global layer;
    softcap: the score soft cap (tanh(s / cap) * cap, Gemma 2), None where there is none.
    """

    layer: int
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    output: torch.Tensor
    scaling: float
    groups: int
    window: int | None = None
    softcap: float | None = None


def _eager_default(module) -> Callable:
    """The eager attention function of the module's own modeling file (what `get_interface` falls back to)."""
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(
            f"{type(module).__name__} has no eager_attention_forward beside it; probes support Llama-style "
            "attention that dispatches through ALL_ATTENTION_FUNCTIONS"
        )
    return fn


@contextmanager
def capture_attention(model):
    """Within the block, every attention call of `model` is recorded in the yielded list (call order).

    Use with one unbatched, cache-free forward pass: `model(input_ids, use_cache=False)`.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = model.config._attn_implementation or "eager"
    registry = ALL_ATTENTION_FUNCTIONS
    had_local = impl in registry._local_mapping
    previous = registry._local_mapping.get(impl)
    records: list[LayerCapture] = []

    def probe_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        original = previous if had_local else (registry._global_mapping.get(impl) or _eager_default(module))
        out, weights = original(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        if query.shape[0] != 1:
            raise ValueError(f"probe capture takes one prompt at a time (batch 1), got batch {query.shape[0]}")
        records.append(
            LayerCapture(
                layer=getattr(module, "layer_idx", len(records)),
                query=query[0].detach(),
                key=key[0].detach(),
                value=value[0].detach(),
                output=out[0].transpose(0, 1).detach(),  # [T, H, D] -> [H, T, D]
                scaling=float(scaling if scaling is not None else query.shape[-1] ** -0.5),
                groups=query.shape[1] // key.shape[1],
                window=kwargs.get("sliding_window", getattr(module, "sliding_window", None)) or None,
                softcap=kwargs.get("softcap") or None,
            )
        )
        return out, weights

    registry[impl] = probe_attention
    try:
        yield records
    finally:
        if had_local:
            registry[impl] = previous
        else:
            del registry[impl]


def capture_qkv(model, input_ids: torch.Tensor) -> list[LayerCapture]:
    """One exact forward pass over `input_ids` [1, T]; returns one `LayerCapture` per attention layer."""
    base = getattr(model, "model", model)  # the decoder stack: the LM head's logits are not needed
    with torch.no_grad(), capture_attention(model) as records:
        base(input_ids=input_ids, use_cache=False)
    n = model.config.get_text_config(decoder=True).num_hidden_layers
    if len(records) != n:
        raise RuntimeError(
            f"captured {len(records)} attention calls for {n} layers; is attention dispatched elsewhere?"
        )
    return records
