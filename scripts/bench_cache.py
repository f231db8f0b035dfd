"""Decode speed and memory of KV caches, side by side, on one model and prompt (CPU or GPU).

    python scripts/bench_cache.py                      # SmolLM2-135M, prompts of 512 and 4096 tokens
    python scripts/bench_cache.py --lengths 512 --repeats 2 --new-tokens 24

Caches: DynamicCache (fp), ours packed (2-bit, K per-channel, V per-token, G=32, R=128) with the default backend
(`auto`: the C kernel on CPU, Triton on CUDA) and with the pure-PyTorch path (`backend=torch`), ours simulated
(same quantizers, fake quant), ours recompute (XQuant-like: the attention input X projected on `--recompute-rank`
singular vectors of [W_k; W_v], per-channel groups at the same bits, G and R, K and V rebuilt at every step), and
transformers' QuantizedCache with the quanto and hqq backends at the same bits, group size and residual length (their
default axes, 0). Runs are interleaved (cache A, B, C, ..., then again)
so that load from other processes hits every cache alike; each figure is the median over repeats.

Decode tokens/s: greedy steps after `--warmup` steps, each step one forward of one token, prefill excluded.
Prefill is timed on its own. Peak cache bytes: the largest size the cache reached during the run (walked
tensors, counted once each); "fp16" is the same tokens as an fp16 K/V cache. For ours, "arith" is the size the
storage arithmetic predicts from the token counts: quantized elements at bits + 32/G bits each (fp16 scale and
zero per group of G), sinks and the fixed R-token fp windows at the model dtype's size.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from transformers import DynamicCache, QuantizedCache

from kvq_lab.cache import CacheConfig, QuantizedKVCache
from kvq_lab.cache.backends import get_backend
from kvq_lab.models import cache_kwarg, load_model
from kvq_lab.quant.spec import QuantSpec

TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable metal type made it possible "
    "to reproduce books quickly and cheaply. Within decades, presses spread across Europe, and the number of books "
    "in circulation grew from thousands to millions. Scholars argue about how much this changed the way people "
    "thought, but few doubt that it changed what they could read. "
)


def make_caches(model, bits: int, G: int, R: int, rank: int = 128) -> dict:
    """name -> factory of a fresh cache."""
    spec_k, spec_v = QuantSpec(bits, G, "channel"), QuantSpec(bits, G, "token")
    packed = CacheConfig(key=spec_k, value=spec_v, mode="packed", residual_length=R)  # backend=auto, the default
    packed_torch = CacheConfig(key=spec_k, value=spec_v, mode="packed", residual_length=R, backend="torch")
    simulated = CacheConfig(key=spec_k, value=spec_v, mode="simulated")
    # one tensor (X's projection) under the key quantizer: the value spec must equal it
    recompute = CacheConfig(key=spec_k, value=spec_k, mode="recompute", residual_length=R, recompute_rank=rank)
    hf = dict(nbits=bits, q_group_size=G, residual_length=R, axis_key=0, axis_value=0)
    auto = get_backend("auto").name
    return {
        "DynamicCache": lambda: DynamicCache(config=model.config),
        f"ours packed {bits}b K-C V-T G{G} R{R} ({auto})": lambda: QuantizedKVCache.for_model(model, packed),
        f"ours packed {bits}b K-C V-T G{G} R{R} (torch)": lambda: QuantizedKVCache.for_model(model, packed_torch),
        f"ours simulated {bits}b K-C V-T G{G}": lambda: QuantizedKVCache.for_model(model, simulated),
        f"ours recompute {bits}b X-C G{G} R{R} rank {rank} ({auto})": lambda: QuantizedKVCache.for_model(
            model, recompute
        ),
        f"HF quanto {bits}b G{G} R{R}": lambda: QuantizedCache("quanto", model.config, **hf),
        f"HF hqq {bits}b G{G} R{R}": lambda: QuantizedCache("hqq", model.config, **hf),
    }


def tensor_bytes(obj, seen: set, depth: int = 0) -> int:
    """Bytes of every tensor reachable from obj's attributes (each storage counted once)."""
    if depth > 6:
        return 0
    if isinstance(obj, torch.Tensor):
        total = 0
        inner = getattr(obj, "__tensor_flatten__", None)
        if inner is not None and type(obj) is not torch.Tensor:  # quanto's packed tensor subclasses
            for name in inner()[0]:
                total += tensor_bytes(getattr(obj, name), seen, depth + 1)
            return total
        key = (obj.untyped_storage().data_ptr(), obj.untyped_storage().nbytes())
        if key in seen or obj.device.type == "meta":
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen, depth + 1) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
        return sum(tensor_bytes(v, seen, depth + 1) for v in vars(obj).values())
    return 0


def cache_bytes(cache) -> tuple[int, int]:
    """(stored, fp16-equivalent) bytes of a cache."""
    if isinstance(cache, QuantizedKVCache) and cache.cfg.mode in ("packed", "recompute"):
        nb = cache.nbytes()
        return nb["stored"], nb["fp16"]
    # others: every tensor the layers hold (the simulated cache keeps exact K/V plus its dequantized copy)
    stored = sum(tensor_bytes(layer, set()) for layer in cache.layers)
    n = cache.get_seq_length()
    cfg = cache_bytes.text_cfg
    fp16 = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * n * 2
    return stored, fp16


def arithmetic_bytes(cache: QuantizedKVCache) -> int:
    """Storage arithmetic for our packed cache from its token counts (see the module docstring)."""
    total = 0
    for layer in cache.layers:
        B, H, _, D = layer.sink_k.shape
        el = layer.sink_k.element_size()
        N, S = layer.N, layer.cfg.sink_tokens
        for stream in (layer.k_stream, layer.v_stream):
            spec = stream.spec
            q = stream.n_quantized(N) if hasattr(stream, "n_quantized") else max(stream.q)
            total += B * H * D * (q * (spec.bits + 32 / spec.group_size) / 8 + stream.window.shape[2] * el)
        total += 2 * B * H * S * D * el
    return int(total)


@torch.no_grad()
def run_once(model, make, ids, new_tokens: int, warmup: int) -> dict:
    cache = make()
    t0 = time.perf_counter()
    out = model(ids, **{cache_kwarg(): cache}, use_cache=True)
    prefill = time.perf_counter() - t0
    nxt = out.logits[:, -1:].argmax(-1)
    peak = cache_bytes(cache)
    steps = []
    tokens = [nxt.item()]
    for _ in range(new_tokens):
        t0 = time.perf_counter()
        out = model(nxt, **{cache_kwarg(): cache}, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        steps.append(time.perf_counter() - t0)
        tokens.append(nxt.item())
        b = cache_bytes(cache)
        if b[0] > peak[0]:
            peak = b
    timed = steps[warmup:]
    res = {"prefill_s": prefill, "decode_tps": len(timed) / sum(timed), "peak": peak, "tokens": tokens}
    if isinstance(cache, QuantizedKVCache) and cache.cfg.mode == "packed":
        res["arith"] = arithmetic_bytes(cache)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--residual", type=int, default=128)
    ap.add_argument("--recompute-rank", type=int, default=128, help="rank of the recompute cache's projection of X")
    ap.add_argument("--only", nargs="*", default=None, help="substrings of cache names to run")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tok = load_model(args.model, dtype=torch.float32)
    cache_bytes.text_cfg = model.config.get_text_config(decoder=True)
    caches = make_caches(model, args.bits, args.group_size, args.residual, args.recompute_rank)
    if args.only:
        caches = {k: v for k, v in caches.items() if k == "DynamicCache" or any(s in k for s in args.only)}
    text_ids = tok(TEXT * 400, return_tensors="pt").input_ids
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print(
        f"# {args.model} fp32 on {dev} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} "
        f"threads), torch {torch.__version__}, batch 1, greedy, {args.new_tokens} new tokens ({args.warmup} warm-up "
        f"steps untimed), median of {args.repeats} interleaved runs"
    )
    for L in args.lengths:
        ids = text_ids[:, :L].to(model.device)
        results = {name: [] for name in caches}
        for _ in range(args.repeats):
            for name, make in caches.items():
                results[name].append(run_once(model, make, ids, args.new_tokens, args.warmup))
        base = statistics.median(r["decode_tps"] for r in results["DynamicCache"])
        print(f"\n## prompt {L} tokens\n")
        print("| cache | decode tok/s | vs Dynamic | prefill s | peak cache MB | / fp16 | measured / arith |")
        print("|---|---|---|---|---|---|---|")
        for name, rs in results.items():
            tps = statistics.median(r["decode_tps"] for r in rs)
            pre = statistics.median(r["prefill_s"] for r in rs)
            stored, fp16 = rs[-1]["peak"]
            arith = f"{stored / rs[-1]['arith']:.3f}" if "arith" in rs[-1] else ""
            print(
                f"| {name} | {tps:.1f} | {tps / base:.2f}x | {pre:.2f} | {stored / 2**20:.2f} | "
                f"{stored / fp16:.3f} | {arith} |"
            )
        same = [n for n, rs in results.items() if rs[-1]["tokens"] == results["DynamicCache"][-1]["tokens"]]
        print(f"\nsame greedy tokens as DynamicCache: {', '.join(same)}")


if __name__ == "__main__":
    main()
