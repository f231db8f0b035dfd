"""GPU microbenchmarks of the Triton kernels (a few minutes on one GPU); writes figures to experiments/kernels/.

    python scripts/bench_kernels.py                   # needs CUDA; --out experiments/kernels
    python scripts/bench_kernels.py --quick           # fewer sizes, batch-1 cases
    python scripts/bench_kernels.py --lengths 4096 32768 --cases pre padded-b4-pre --out ../kernels_run

1. quantize+pack throughput (GB/s of fp16 input read) vs a device-to-device copy of the same tensor, per bits
   and axis, at 4K-64K tokens. The copy is the memory-bandwidth ceiling a streaming kernel can approach.
2. fused decode attention over packed K/V (2-bit K per-channel, V per-token, G=32, R=128 fp window, 4 sinks), fp16
   model, GQA 32 query heads / 8 kv heads, D=128, at 4K-64K tokens, in the cache's configurations (`ATTN_CASES`):
   rope=post and rope=pre (keys rotated in the kernel: the general route), batch 8, and left-padded batches of 4.
   Each route the configuration can take (`tensor_cores`, `general`) is timed as the cache calls it
   (`decode_attention`, launches and allocations included), eagerly and replayed from a CUDA graph, against the
   fastest fp16 attention this machine has on un-expanded K/V: PyTorch SDPA with GQA under each backend that
   accepts it (flash, efficient, math) and flash-attn's `flash_attn_with_kvcache` where installed; the row names the
   one that won. Per row: bytes read, GB/s, and the fraction of the device copy's bandwidth (a 512 MiB copy,
   read + write counted, measured first).
3. `--sweep`: the tensor-core route's launch options (warps x pipeline stages) at 32K tokens, batch 1 and 8.

Timings: CUDA events, median of repeats after warm-up. Prints tables and saves `quantize_pack.png`,
`decode_attention.png` and `results.json` under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from kvq_lab.quant.spec import QuantSpec


def cuda_time(fn, warmup=5, repeats=30) -> float:
    """Median milliseconds of fn() measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def bench_quantize(lengths, H=8, D=128):
    from kvq_lab.kernels import triton as tk

    rows = []
    for T in lengths:
        x = torch.randn(1, H, T, D, device="cuda", dtype=torch.float16)
        nbytes = x.numel() * x.element_size()
        dst = torch.empty_like(x)
        copy_ms = cuda_time(lambda x=x, dst=dst: dst.copy_(x))
        for bits in (2, 4):
            for axis in ("channel", "token"):
                spec = QuantSpec(bits, 32, axis)
                ms = cuda_time(lambda x=x, spec=spec: tk.quantize_pack(x, spec))
                deq = tk.quantize_pack(x, spec)
                ms_d = cuda_time(lambda deq=deq, spec=spec, T=T: tk.unpack_dequantize(*deq, spec, T))
                rows.append(
                    dict(
                        T=T,
                        bits=bits,
                        axis=axis,
                        quant_ms=ms,
                        quant_gbs=nbytes / ms / 1e6,
                        dequant_ms=ms_d,
                        copy_ms=copy_ms,
                        copy_gbs=2 * nbytes / copy_ms / 1e6,
                    )  # fmt: skip
                )
                r = rows[-1]
                print(
                    f"quantize+pack T={T:6d} {bits}b {axis:7s}: {ms:.3f} ms, {r['quant_gbs']:.0f} GB/s read | "
                    f"unpack+dequant {ms_d:.3f} ms | copy {copy_ms:.3f} ms ({r['copy_gbs']:.0f} GB/s r+w)"
                )
    return rows


def rotary(D: int, device):
    """A Llama rotary module for rope=pre layers (theta 10000, head dim D)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from kvq_lab.cache.routing.rope import RopeHelper

    cfg = LlamaConfig(hidden_size=4 * D, num_attention_heads=4, head_dim=D, max_position_embeddings=1 << 17)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    return RopeHelper(LlamaRotaryEmbedding(cfg).to(device))


# (label, rope, batch, left-padded): the configurations the fast path serves. Padded batches: row b has b/B of
# the context as left padding (its prompt is shorter), as lm-eval's batches of unequal prompts are.
ATTN_CASES = [("post", "post", 1, False), ("pre", "pre", 1, False), ("post-b8", "post", 8, False),
              ("padded-b4", "post", 4, True), ("padded-b4-pre", "pre", 4, True)]  # fmt: skip
DEV = "cuda"  # the benchmark's device (a CPU smoke run under TRITON_INTERPRET sets "cpu")


def copy_bandwidth(nbytes=512 << 20) -> float:
    """GB/s of a device-to-device copy of nbytes (read + write counted): the bandwidth ceiling rows are measured
    against."""
    x = torch.empty(nbytes // 2, device="cuda", dtype=torch.float16)
    y = torch.empty_like(x)
    return 2 * nbytes / cuda_time(lambda: y.copy_(x)) / 1e6


def graphed(fn):
    """fn replayed from a CUDA graph (captured after a warm-up on a side stream): launch overhead removed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def fp16_baselines(q, k, v, mask):
    """{name: fn} of the fp16 attentions that accept un-expanded GQA K/V here."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    F = torch.nn.functional
    out = {}
    backends = (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION),
                ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-math", SDPBackend.MATH))  # fmt: skip
    for name, backend in backends:

        def fn(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        try:
            fn()
            if q.is_cuda:
                torch.cuda.synchronize()
            out[name] = fn
        except RuntimeError:
            pass
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        flash_attn_with_kvcache = None
    if flash_attn_with_kvcache is not None and mask is None:
        qt, kt, vt = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        out["flash_attn_with_kvcache"] = lambda: flash_attn_with_kvcache(qt, kt, vt)
    return out


def bench_attention(lengths, cases, copy_gbs, Hq=32, Hkv=8, D=128, dtype=torch.float16):
    from kvq_lab.cache import CacheConfig
    from kvq_lab.cache.layers.base import PaddingState
    from kvq_lab.cache.layers.packed import PackedLayer
    from kvq_lab.kernels import triton as tk

    rope_helper = rotary(D, DEV)
    rows = []
    for label, rope, B, padded in cases:
        cfg = CacheConfig(
            key=QuantSpec(2, 32, "channel"), value=QuantSpec(2, 32, "token"), mode="packed", exact_window=128,
            sink_tokens=4, backend="triton", rope=rope,
        )  # fmt: skip
        for T in lengths:
            k = torch.randn(B, Hkv, T, D, device=DEV, dtype=dtype)
            v = torch.randn_like(k)
            padding = PaddingState()
            pads = torch.tensor([b * T // (2 * B) for b in range(B)] if padded else [0] * B, device=DEV)
            real = torch.arange(T, device=DEV)[None] >= pads[:, None]  # [B, T]
            if padded:
                padding.prompt_mask = real.long()
            ids = (real.long().cumsum(1) - 1).clamp(min=0)
            layer = PackedLayer(cfg, rope_helper, padding)
            layer.update(k, v, position_ids=ids)
            q = torch.randn(B, Hq, 1, D, device=DEV, dtype=dtype)
            view = layer.decode_view()
            assert (view.rope is not None) == (rope == "pre") and (view.pads is not None) == padded, label
            mask = real[:, None, None, :] if padded else None
            route = tk.supports(view, q, mask)
            assert route, label  # the kernel, not its PyTorch fallback
            stored, fp16 = layer.nbytes()
            base = {}
            for name, fn in fp16_baselines(q, k, v, mask).items():
                base[name] = cuda_time(fn)
            best = min(base, key=base.get)
            row = dict(case=label, rope=rope, padded=padded, B=B, T=T, Hq=Hq, Hkv=Hkv, D=D, ours_bytes=stored,
                       fp16_bytes=fp16, baseline=best, baseline_ms=base[best], baselines=base, route=route,
                       copy_gbs=copy_gbs)  # fmt: skip
            for r in ("tensor_cores", "general") if route == "tensor_cores" else ("general",):
                call = lambda view=view, q=q, mask=mask, r=r: tk.decode_attention(view, q, mask, D**-0.5, route=r)
                eager = cuda_time(call)
                graph = cuda_time(graphed(call))
                row[r] = dict(ms=eager, graph_ms=graph, gbs=stored / eager / 1e6, graph_gbs=stored / graph / 1e6,
                              speedup=base[best] / eager, graph_speedup=base[best] / graph)  # fmt: skip
            rows.append(row)
            fast = row[route]
            print(
                f"decode attention {label:14s} B={B} T={T:6d}: {route} {fast['ms']:.3f} ms "
                f"(graph {fast['graph_ms']:.3f}), {stored / 2**20:.1f} MiB at {fast['graph_gbs']:.0f} GB/s = "
                f"{fast['graph_gbs'] / copy_gbs:.2f} of copy | "
                f"{best} {base[best]:.3f} ms ({fp16 / 2**20:.1f} MiB) | {fast['speedup']:.2f}x eager, "
                f"{fast['graph_speedup']:.2f}x graphed"
                + (f" | general {row['general']['ms']:.3f} ms" if route != "general" else "")
            )
            del layer, view, k, v
            torch.cuda.empty_cache()
    return rows


def sweep(T=32768, batches=(1, 8), Hq=32, Hkv=8, D=128):
    """The tensor-core route's launch options at T tokens: ms per (warps, stages), eager, KIVI-2 fp16."""
    from kvq_lab.cache import CacheConfig
    from kvq_lab.cache.layers.base import PaddingState
    from kvq_lab.cache.layers.packed import PackedLayer
    from kvq_lab.kernels import triton as tk
    from kvq_lab.kernels.triton import attention_tc

    cfg = CacheConfig(key=QuantSpec(2, 32, "channel"), value=QuantSpec(2, 32, "token"), mode="packed",
                      exact_window=128, sink_tokens=4, backend="triton")  # fmt: skip
    rows, default = [], (attention_tc.NUM_WARPS, attention_tc.NUM_STAGES)
    for B in batches:
        layer = PackedLayer(cfg, None, PaddingState())
        layer.update(*(torch.randn(B, Hkv, T, D, device=DEV, dtype=torch.float16) for _ in "kv"))
        view, q = layer.decode_view(), torch.randn(B, Hq, 1, D, device=DEV, dtype=torch.float16)
        for warps in (2, 4, 8):
            for stages in (1, 2, 3, 4):
                attention_tc.NUM_WARPS, attention_tc.NUM_STAGES = warps, stages
                try:
                    ms = cuda_time(lambda v=view, q=q: tk.decode_attention(v, q, None, D**-0.5, route="tensor_cores"))
                except Exception as e:  # out of shared memory or registers for this combination
                    ms, err = None, f"{type(e).__name__}: {str(e)[:80]}"
                else:
                    err = None
                rows.append(dict(B=B, T=T, warps=warps, stages=stages, ms=ms, error=err))
                print(f"sweep B={B} T={T} warps={warps} stages={stages}: " + (f"{ms:.3f} ms" if ms else err))
        del layer, view
        torch.cuda.empty_cache()
    attention_tc.NUM_WARPS, attention_tc.NUM_STAGES = default
    return rows


def plot(q_rows, a_rows, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for bits in (2, 4):
        for axis in ("channel", "token"):
            rs = [r for r in q_rows if r["bits"] == bits and r["axis"] == axis]
            ax.plot([r["T"] for r in rs], [r["quant_gbs"] for r in rs], marker="o", label=f"{bits}b {axis}")
    rs = [r for r in q_rows if r["bits"] == 2 and r["axis"] == "channel"]
    ax.plot([r["T"] for r in rs], [r["copy_gbs"] for r in rs], "k--", label="device copy (r+w)")
    ax.set(xscale="log", xlabel="tokens", ylabel="GB/s", title=f"quantize+pack, {torch.cuda.get_device_name()}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "quantize_pack.png", dpi=120)

    fig, ax = plt.subplots(figsize=(6, 4))
    for case in dict.fromkeys(r["case"] for r in a_rows):
        rs = [r for r in a_rows if r["case"] == case]
        ms = [r[r["route"]]["graph_ms"] for r in rs]
        line = ax.plot([r["T"] for r in rs], ms, marker="o", label=f"packed 2b, {case} ({rs[0]['route']})")
        ax.plot([r["T"] for r in rs], [r["baseline_ms"] for r in rs], "--", marker="x", color=line[0].get_color(),
                label=f"fp16 {rs[0]['baseline']}, {case}")  # fmt: skip
    ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="ms", title="decode attention (GQA 32/8, D=128)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "decode_attention.png", dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="experiments/kernels")
    ap.add_argument("--quick", action="store_true", help="lengths 4K 16K 32K, the batch-1 cases only")
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="default 4096 8192 16384 32768 65536")
    ap.add_argument("--cases", nargs="+", default=None, choices=[c[0] for c in ATTN_CASES],
                    help="decode attention cases (default: all)")  # fmt: skip
    ap.add_argument("--sweep", action="store_true", help="also time the tensor-core route's warps x stages at 32K")
    args = ap.parse_args(argv)
    if any(n < 1 for n in args.lengths or []):
        raise SystemExit(f"bench_kernels.py: --lengths {args.lengths}: every length must be at least 1 token")
    if not torch.cuda.is_available():
        raise SystemExit(
            "bench_kernels.py needs a CUDA GPU (the kernels are tested on CPU by tests/kernels/test_triton.py)"
        )
    lengths = args.lengths or ([4096, 16384, 32768] if args.quick else [4096, 8192, 16384, 32768, 65536])
    cases = [c for c in ATTN_CASES if (args.cases is None or c[0] in args.cases) and (not args.quick or c[2] == 1)]
    import triton

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    copy_gbs = copy_bandwidth()
    print(f"device copy (512 MiB, read + write): {copy_gbs:.0f} GB/s")
    q_rows = bench_quantize(lengths)
    a_rows = bench_attention(lengths, cases, copy_gbs)
    s_rows = sweep() if args.sweep else []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"copy_gbs": copy_gbs, "quantize_pack": q_rows, "decode_attention": a_rows, "sweep": s_rows}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(q_rows, a_rows, out)
    print(f"wrote {out}/results.json, quantize_pack.png, decode_attention.png")


if __name__ == "__main__":
    main()
