"""Per-layer, per-head error of a key/value quantizer pair, measured where the tensors are consumed.

For one layer's captured (exact) query q [H, T, D], key k and value v [H_kv, T, D] (KIVI Table 2's setting: the
quantizer in isolation, exact inputs at every layer):

    k', v'  = simulated mode's view of the whole prompt's K and V (`kvq_lab.cache.layers.simulated_stream.simulate`:
              fake quant, partial per-channel groups zero-padded as KIVI's fake quant; sink tokens exact; the cache
              config's transforms applied before quantization and undone after, e.g. rope=pre: K un-rotated,
              quantized, re-rotated at its positions; hadamard: rotated, quantized, rotated back)
    A       = softmax(q K^T * scaling + mask)          A' = softmax(q K'^T * scaling + mask)
              (mask: causal; on a sliding-window layer also the window, as the model attends; the score soft cap
              where the model has one)
    O       = A V        O_k = A' V  (only K quantized)        O_v = A V'  (only V quantized, A exact, as KIVI)
    O_kv    = A' V'  (both)

Quantities (one value per head; key/value per KV head, the rest per query head; GQA: query head h reads KV head
h // groups):
    key, value          reconstruction error of K', V' over [T, D]
    attn_score          A vs A' over the masked [T, T] (all prefill rows)
    attn_out_k, attn_out_v, attn_out     O vs O_k, O_v, O_kv over [T, D]
    *_decode            the same on the last query row only ([T] for scores, [D] for outputs): what one decode
                        step after this prompt would see
    sparsity(_decode)   share of A's visible weights below `sparsity_rel` x the row max (exact A, a property of
                        the model), mean over rows
    top{k}_mass(_decode) share of each row's mass in its k largest weights (exact A), mean over rows
Each error quantity is reported in every definition of `kvq_lab.probes.metrics.ERRORS`.
"""

from __future__ import annotations

import torch

from kvq_lab.cache.config import CacheConfig
from kvq_lab.cache.layers.simulated_stream import simulate
from kvq_lab.cache.routing.rope import RopeHelper

from .capture import LayerCapture
from .metrics import all_errors, sparsity, topk_mass
from .settings import KV_QUANTITIES, ProbeSettings


def quantize_kv(
    key: torch.Tensor, value: torch.Tensor, cache: CacheConfig, rope: RopeHelper | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake-quantize one layer's whole-prompt K and V ([H_kv, T, D], post-RoPE keys, fp32 out) as the cache config
    says, with simulated mode's arithmetic (`kvq_lab.cache.layers.simulated_stream.simulate`, the one implementation).

    Sink tokens stay exact and groups start at the first non-sink token; the config's transforms wrap each
    quantizer. Position-dependent transforms (rope=pre) need `rope` (the model's rotary module): the tokens sit at
    positions 0..T-1. `mode`/`exact_window` are not modelled: every non-sink token is quantized (KIVI Table 1/2's
    fake quant). Per-head bits (`head_bits`): each width's heads quantized at their width.
    """
    if cache.head_bits:
        kq, vq = torch.empty_like(key, dtype=torch.float32), torch.empty_like(value, dtype=torch.float32)
        for c, idx in cache.head_groups():
            kq[idx], vq[idx] = quantize_kv(key[idx], value[idx], c, rope)
        return kq, vq
    kp, vp = cache.pipelines()
    pos = None
    if any(p is not None and p.positional for p in (kp, vp)):
        if rope is None:
            raise ValueError("rope=pre (key_transform=rope_pre) needs the model's rotary embedding (RopeHelper)")
        pos = rope.positions(key[None], torch.arange(key.shape[-2], device=key.device)[None])
    s = cache.sink_tokens
    kq, vq = (
        simulate(x[None].float(), getattr(cache, t), pipe, pos, s, cache.outliers(t), cache.residual(t))[0]
        for x, t, pipe in ((key, "key", kp), (value, "value", vp))
    )
    return kq, vq


def visible(T: int, window: int | None, device=None) -> torch.Tensor:
    """[T, T] bool: which keys each query sees. Causal; with a sliding window, query i sees keys i - window + 1..i
    (transformers' sliding-window mask)."""
    i = torch.arange(T, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) if window is None else (d >= 0) & (d < window)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    scaling: float,
    groups: int,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention probabilities A [H, T, T] (fp32) from q [H, T, D] and k [H_kv, T, D], GQA expanded: causal, within
    `window` on a sliding-window layer, scores soft-capped where the model caps them."""
    kx = k.float().repeat_interleave(groups, dim=0)
    s = torch.matmul(q.float(), kx.transpose(-1, -2)) * scaling
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~visible(q.shape[-2], window, q.device), -torch.inf)
    return torch.softmax(s, dim=-1)


def layer_errors(
    cap: LayerCapture, cache: CacheConfig, settings: ProbeSettings, rope: RopeHelper | None = None
) -> dict[str, dict[str, torch.Tensor]]:
    """{quantity: {definition: tensor [heads]}} for one captured layer (see the module docstring).

    Sparsity quantities have one definition, `value`. Key/value tensors have H_kv entries, the others H.
    """
    g = cap.groups
    q, k, v = cap.query.float(), cap.key.float(), cap.value.float()
    kq, vq = quantize_kv(k, v, cache.for_layer(cap.layer), rope)  # the layer's fitted quantizers (calibration)
    vx, vqx = v.repeat_interleave(g, dim=0), vq.repeat_interleave(g, dim=0)

    a = attention(q, k, cap.scaling, g, cap.window, cap.softcap)
    # 16-bit keys, no transform: A itself
    aq = a if torch.equal(kq, k) else attention(q, kq, cap.scaling, g, cap.window, cap.softcap)
    o = a @ vx
    pairs = {
        "key": (k, kq),
        "value": (v, vq),
        "attn_score": (a, aq),
        "attn_out_k": (o, aq @ vx),
        "attn_out_v": (o, a @ vqx),
        "attn_out": (o, aq @ vqx),
    }
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, (x, xq) in pairs.items():
        out[name] = all_errors(x, xq, dims=(-2, -1), eps=settings.kivi_eps)
        if name not in KV_QUANTITIES:  # decode row: the last query attends to the whole prompt (or its window)
            out[f"{name}_decode"] = all_errors(x[:, -1], xq[:, -1], dims=-1, eps=settings.kivi_eps)
    seen = visible(a.shape[-1], cap.window, a.device)
    out["sparsity"] = {"value": sparsity(a, seen, settings.sparsity_rel)}
    out["sparsity_decode"] = {"value": sparsity(a[:, -1:], seen[-1:], settings.sparsity_rel)}
    kname = f"top{settings.topk}_mass"
    out[kname] = {"value": topk_mass(a, settings.topk)}
    out[f"{kname}_decode"] = {"value": topk_mass(a[:, -1:], settings.topk)}
    return out


def reference_output(cap: LayerCapture) -> torch.Tensor:
    """A V [H, T, D] recomputed from the captured q/k/v: must equal `cap.output` (the model's own attention)."""
    a = attention(cap.query, cap.key, cap.scaling, cap.groups, cap.window, cap.softcap)
    return a @ cap.value.float().repeat_interleave(cap.groups, dim=0)
