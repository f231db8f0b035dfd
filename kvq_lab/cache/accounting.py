"""Bits per element of everything a cache config stores, so methods compare at equal memory.

`cache/bits*` (`kvq_lab.run.runner.cache_bits`) is the format's own cost: codes + per-group parameters. The totals here
add what the methods store besides, for a sequence of N tokens of one layer's [H, N, D] tensor:

    exact tokens     sink_tokens, plus residual_length in packed mode (the window: R tokens at its fullest), 16 bits
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

A token policy (`kvq_lab.cache.policies`) splits a prompt of N tokens: its sinks and last `policy.window` tokens
at the cache's own cost (the first lines above), the M tokens between them dealt to its tiers in their shares, each
at its tier's cost (nothing for a dropped tier), all over the N tokens of the prompt (`layer_bits`).

Per-head bits (`CacheConfig.head_bits`): each width's heads are one layer of their own (`kvq_lab.cache.heads`), so a
layer's bits are the heads-weighted mean of its widths' costs, each counted with its own heads (per-layer state:
a codebook or a transform's parameters, once per width).

Averaged over the layers (their fitted configs where calibration made them; skipped layers at 16 bits). N: the
task's sequence length where it has one (task=ppl: context_tokens + eval_tokens),
else 1024; reported as `cache/bits_tokens`.
"""

from __future__ import annotations

from kvq_lab.quant.outliers import entry_bytes
from kvq_lab.quant.transforms import get_transform

from .config import CacheConfig

DEFAULT_TOKENS = 1024


def tensor_bits(cache: CacheConfig, tensor: str, n_tokens: int, heads: int, head_dim: int) -> float:
    """Stored bits per element of one layer's `tensor` ("key" / "value") over n_tokens (module docstring)."""
    from kvq_lab.quant.formats import bits_per_element
    from kvq_lab.quant.reference import code_format

    spec = getattr(cache, tensor)
    if spec.is_identity:
        return 16.0
    exact = min(n_tokens, cache.sink_tokens + (cache.residual_length if cache.mode == "packed" else 0))
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


def layer_bits(cache: CacheConfig, tensor: str, n_tokens: int, heads: int, head_dim: int) -> float:
    """Stored bits per element of one layer's `tensor` over n_tokens, under its token policy's tiers where it has
    them, over its heads' widths where they differ (module docstring), else `tensor_bits`."""
    if cache.head_bits:
        H = len(cache.head_bits)
        return (
            sum(tensor_bits(c, tensor, n_tokens, len(idx), head_dim) * len(idx) for c, idx in cache.head_groups()) / H
        )
    tiers = cache.tiers()
    if not tiers:
        return tensor_bits(cache, tensor, n_tokens, heads, head_dim)
    from dataclasses import replace

    from .policies import deal

    window = cache.sink_tokens + cache.token_policy().window
    main = min(n_tokens, window)
    mid = n_tokens - main
    plain = replace(cache, policy="kivi", policy_options=())
    bits = tensor_bits(plain, tensor, main, heads, head_dim) * main if main else 0.0
    for tier, size in zip(tiers, deal([t.share for t in tiers], mid), strict=True):
        if tier.config is not None and size:
            bits += tensor_bits(tier.config, tensor, size, heads, head_dim) * size
    return bits / n_tokens


def stored_bits(cache: CacheConfig, task=None, model_config=None) -> dict[str, float]:
    """`cache/bits_total_key`, `cache/bits_total_value`, `cache/bits_total` (their mean) and `cache/bits_tokens`.
    `task`: the run's task section (task=ppl: its window length is the sequence length; protocol=chunks: n_ctx)."""
    t = task or {}
    if t.get("protocol") == "chunks" and t.get("name") in ("ppl", "fidelity"):  # llama.cpp's chunks: n_ctx each
        n = int(t["n_ctx"])
    else:
        n = int(t["context_tokens"]) + int(t["eval_tokens"]) if t.get("name") == "ppl" else DEFAULT_TOKENS
    heads, head_dim, n_layers = 1, 64, max(1, len(cache.layers))
    if model_config is not None:
        text = model_config.get_text_config(decoder=True)
        heads = text.num_key_value_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        n_layers = text.num_hidden_layers
    out = {}
    for tensor in ("key", "value"):
        per = [layer_bits(cache.for_layer(i), tensor, n, heads, head_dim) for i in range(n_layers)]
        out[f"cache/bits_total_{tensor}"] = sum(per) / len(per)
    out["cache/bits_total"] = (out["cache/bits_total_key"] + out["cache/bits_total_value"]) / 2
    out["cache/bits_tokens"] = float(n)
    return out
