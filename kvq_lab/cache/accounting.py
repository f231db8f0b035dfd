"""Bits per element of everything a cache config stores, so methods compare at equal memory: the parts every layer
kind's `stored_bits(cfg, n_tokens, shape)` is made of (`QuantizedKVCache.stored_bits` asks each layer's once).

`cache/bits*` (`format_bits`) is the format's own cost: codes + per-group parameters. The totals (`tensor_bits`) add
what the methods store besides, for a sequence of N tokens of one layer's [H, N, D] tensor:

    exact tokens     sink_tokens, plus exact_window (the window of a mode that keeps one: R tokens at its
                     fullest; a mode without a window has R = 0), 16 bits
    quantized        the other N - S - R tokens at the format's bits per element (codes + scale/zero, whole groups)
    outliers         `fraction` of the quantized elements kept exact: fp16 value + int32 index, 48 bits each, on top
                     of their (unused) dense codes; values: round(fraction * D) per token, as `Outliers` keeps them
    residuals        each quantized token's residual corrections (`kvq_lab.quant.residuals`: `token_bytes(D)` per token
                     and head, e.g. qjl:64 on D = 64: 8 sign bytes + an fp16 norm, 1.25 bits per element; a block
                     correction's incomplete last block holds its error at 16 bits per element)
    per layer        what the format keeps per tensor (`CodeFormat.table_bytes`: a lut/nuq codebook, fp32, 2^bits
                     entries; nvfp4's fp32 tensor scale), key outlier thresholds (fp16, H * D), and what each
                     transform stores (`Transform.stored_bits`: innerq scales, fp16, H * D; rotatekv channel orders,
                     1 byte, H * D)

A token policy (`kvq_lab.cache.policies`, `Policy.stored_bits`) splits a prompt of N tokens: its sinks and last
`policy.window` tokens at the cache's own cost (the first lines above), the M tokens between them dealt to its tiers
in their shares, each at its tier's cost (nothing for a dropped tier), all over the N tokens of the prompt
(`kvq_lab.cache.layers.tiered.TieredLayer.stored_bits`).

Per-head bits (`CacheConfig.head_bits`): each width's heads are one layer of their own (`kvq_lab.cache.layers.heads`),
so a layer's bits are the heads-weighted mean of its widths' costs, each counted with its own heads (per-layer state:
a codebook or a transform's parameters, once per width).

A mode that caches one tensor instead of K and V (`Capabilities.stores_kv` False: recompute's X) counts its bytes as
its layer stores them (`stored_bytes`), over the bytes the same tokens take as fp16 K/V.

Averaged over the layers (their fitted configs where calibration made them; skipped layers at 16 bits). N: the
sequence the run's task caches (`Task.cached_tokens`), reported as `cache/bits_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvq_lab.cache.config import CacheConfig
from kvq_lab.quant.outliers import entry_bytes
from kvq_lab.quant.transforms import get_transform

DEFAULT_TOKENS = 1024


@dataclass(frozen=True)
class Shape:
    """What the byte count reads of a model: decoder layers, KV heads and head dim of one layer's [H, N, D] tensors,
    the attention input's width (`hidden`) and the dtype its exact tensors are kept in. Without a model: one head
    of 64 per layer (bits per element do not depend on H where nothing is stored per layer)."""

    layers: int = 1
    heads: int = 1
    head_dim: int = 64
    hidden: int | None = None
    dtype: Any = None

    @classmethod
    def of(cls, model) -> Shape:
        text = model.config.get_text_config(decoder=True)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        dtype = next(model.parameters()).dtype
        return cls(text.num_hidden_layers, text.num_key_value_heads, head_dim, text.hidden_size, dtype)


def format_bits(cache: CacheConfig) -> dict[str, float]:
    """Stored bits per element of each quantizer, codes plus per-group parameters (int2 G32: 3.0; fp8 G32: 8.5;
    16 = kept as is), whole groups, exact windows and sinks not counted: the format's own cost, as a table compares
    formats at equal bytes (`cache/bits_key`, `cache/bits_value`, `cache/bits`; the mean over per-layer configs)."""
    from kvq_lab.quant.formats import bits_per_element
    from kvq_lab.quant.reference import code_format

    def one(spec):
        return 16.0 if spec.is_identity else bits_per_element(code_format(spec), spec.group_size, spec.axis)

    layers = [cache.for_layer(i) for i in range(len(cache.layers))] or [cache]  # per-layer precision: the mean
    k = sum(one(c.key) for c in layers) / len(layers)
    v = sum(one(c.value) for c in layers) / len(layers)
    return {"cache/bits_key": k, "cache/bits_value": v, "cache/bits": (k + v) / 2}


def tensor_bits(cache: CacheConfig, tensor: str, n_tokens: int, heads: int, head_dim: int) -> float:
    """Stored bits per element of one layer's `tensor` ("key" / "value") over n_tokens (module docstring)."""
    from kvq_lab.quant.formats import bits_per_element
    from kvq_lab.quant.reference import code_format

    spec = getattr(cache, tensor)
    if spec.is_identity:
        return 16.0
    exact = min(n_tokens, cache.sink_tokens + cache.exact_window)  # R = 0 where the mode keeps no window
    quant = n_tokens - exact
    fmt = code_format(spec)
    bits = exact * 16.0 + quant * bits_per_element(fmt, spec.group_size, spec.axis)
    f = getattr(cache, f"{tensor}_outliers")
    if f:
        share = f if tensor == "key" else max(1, round(f * head_dim)) / head_dim
        bits += quant * share * 8 * entry_bytes()
    chain = cache.residual(tensor)
    if chain is not None:
        whole = quant // chain.block * chain.block  # the rest: an incomplete unit, its error held in fp16
        bits += whole * 8 * chain.token_bytes(head_dim) / head_dim + (quant - whole) * 16.0
    per_layer = 8 * fmt.table_bytes  # bytes -> bits, over H*N*D elements
    if tensor == "key" and cache.key_outlier_thresholds is not None:
        per_layer += 16 * heads * head_dim
    per_layer += sum(get_transform(s).stored_bits(heads, head_dim) for s in getattr(cache, f"{tensor}_transform"))
    return bits / n_tokens + per_layer / (heads * n_tokens * head_dim)


def kv_bits(cache: CacheConfig, n_tokens: int, shape: Shape) -> tuple[float, float]:
    """(keys, values): `tensor_bits` of each, for one layer of `shape` (what a K/V layer of the mode stores)."""
    return tuple(tensor_bits(cache, t, n_tokens, shape.heads, shape.head_dim) for t in ("key", "value"))
