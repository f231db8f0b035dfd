"""What each cache mode supports, as data: checks ask a capability, never compare a mode's name (vLLM's backends
declare what they support the same way).

`CacheConfig.caps` (and `capabilities(mode)` for a record's mode string) is the one lookup; each mode's layer class
carries its own entry as `caps` (`kvq_lab.cache.layers.base.register_layer`). A new mode is one layer module plus one
entry here, and every check that reads a capability then knows it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    """What one cache mode does and supports (every field a yes/no the checks read).

    stores_kv: caches K and V (False: one tensor, the attention input X, under the key quantizer; K and V are
        rebuilt from it, so transforms, per-head bits and token tiers, which act on K/V, do not apply).
    residual_window: keeps the last `exact_window` tokens exact and flushes whole groups (KIVI streaming); False:
        every cached token is quantized, partial groups zero-padded.
    fake_quant: every cached token, the prompt's included, is quantized and dequantized at once (KIVI Table 1):
        what `policy=fakequant` means.
    exact_prefill: with `prefill` unset, the prompt's forward reads the K/V the model computed.
    quantized_prefill: `prefill=quantized` can make the prompt's forward read what the cache stores.
    packed_storage: stores codes and parameters, so its `nbytes()` is what it keeps (not a dequantized copy).
    kernels: runs the C and Triton backends (False: the pure-PyTorch reference only).
    fused_decode: decode attention reads the stored K/V codes through the backend's kernels (the formats are checked
        against the kernel; what kernels cannot read, sparse outliers and residuals, is read dequantized).
    token_policies: a token policy's tiers can hold its tokens (`kvq_lab.cache.layers.tiered`).
    per_layer_precision: per-layer and per-head bits, and skipped layers, apply.
    """

    stores_kv: bool
    residual_window: bool
    fake_quant: bool
    exact_prefill: bool
    quantized_prefill: bool
    packed_storage: bool
    kernels: bool
    fused_decode: bool
    token_policies: bool
    per_layer_precision: bool


MODES: dict[str, Capabilities] = {
    "simulated": Capabilities(
        stores_kv=True, residual_window=False, fake_quant=True, exact_prefill=False, quantized_prefill=True,
        packed_storage=False, kernels=False, fused_decode=False, token_policies=True, per_layer_precision=True,
    ),
    "packed": Capabilities(
        stores_kv=True, residual_window=True, fake_quant=False, exact_prefill=True, quantized_prefill=True,
        packed_storage=True, kernels=True, fused_decode=True, token_policies=True, per_layer_precision=True,
    ),
    "recompute": Capabilities(
        stores_kv=False, residual_window=True, fake_quant=False, exact_prefill=True, quantized_prefill=False,
        packed_storage=True, kernels=True, fused_decode=False, token_policies=False, per_layer_precision=False,
    ),
}  # fmt: skip


def capabilities(mode: str) -> Capabilities:
    """The capabilities of `mode` (KeyError for a name that is not a mode: `CacheConfig` refuses it first)."""
    return MODES[mode]
