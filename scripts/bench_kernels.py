"""GPU microbenchmarks of the Triton kernels (a few minutes on one GPU); writes figures to experiments/kernels/.

    python scripts/bench_kernels.py                   # needs CUDA; --out experiments/kernels
    python scripts/bench_kernels.py --quick           # fewer sizes, batch-1 cases
    python scripts/bench_kernels.py --lengths 4096 32768 --cases pre padded-b4-pre --out /tmp/k

1. quantize+pack throughput (GB/s of fp16 input read) vs a device-to-device copy of the same tensor, per bits
   and axis, at 4K-64K tokens. The copy is the memory-bandwidth ceiling a streaming kernel can approach.
2. fused decode attention over packed K/V (2-bit K per-channel, V per-token, G=32, R=128 fp window, 4 sinks) vs
   PyTorch SDPA on fp16 K/V of the same length (GQA 32 query heads / 8 kv heads, D=128), at 4K-64K tokens, in the
   fast path's configurations (`ATTN_CASES`): rope=post and rope=pre (keys rotated in the kernel), batch 8, and
   left-padded batches of 4 (SDPA with the padding mask): latency and the bytes each reads.

Timings: CUDA events, median of repeats after warm-up. Prints a table and saves `quantize_pack.png`,
`decode_attention.png` and `results.json` under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch


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
    from kvq_lab.quant.spec import QuantSpec

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

    from kvq_lab.cache.rope import RopeHelper

    cfg = LlamaConfig(hidden_size=4 * D, num_attention_heads=4, head_dim=D, max_position_embeddings=1 << 17)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    return RopeHelper(LlamaRotaryEmbedding(cfg).to(device))


# (label, rope, batch, left-padded): the configurations the fast path serves. Padded batches: row b has b/B of
# the context as left padding (its prompt is shorter), as lm-eval's batches of unequal prompts are.
ATTN_CASES = [("post", "post", 1, False), ("pre", "pre", 1, False), ("post-b8", "post", 8, False),
              ("padded-b4", "post", 4, True), ("padded-b4-pre", "pre", 4, True)]  # fmt: skip
DEV = "cuda"  # the benchmark's device (a CPU smoke run under TRITON_INTERPRET sets "cpu")


def bench_attention(lengths, cases, Hq=32, Hkv=8, D=128):
    from kvq_lab.cache import CacheConfig
    from kvq_lab.cache.base import PaddingState
    from kvq_lab.cache.packed import PackedLayer
    from kvq_lab.kernels import triton as tk
    from kvq_lab.quant.spec import QuantSpec

    rope_helper = rotary(D, DEV)
    rows = []
    for label, rope, B, padded in cases:
        cfg = CacheConfig(
            key=QuantSpec(2, 32, "channel"), value=QuantSpec(2, 32, "token"), mode="packed", residual_length=128,
            sink_tokens=4, backend="triton", rope=rope,
        )  # fmt: skip
        for T in lengths:
            k = torch.randn(B, Hkv, T, D, device=DEV, dtype=torch.float16)
            v = torch.randn_like(k)
            padding = PaddingState()
            pads = torch.tensor([b * T // (2 * B) for b in range(B)] if padded else [0] * B, device=DEV)
            real = torch.arange(T, device=DEV)[None] >= pads[:, None]  # [B, T]
            if padded:
                padding.prompt_mask = real.long()
            ids = (real.long().cumsum(1) - 1).clamp(min=0)
            layer = PackedLayer(cfg, rope_helper, padding)
            layer.update(k, v, position_ids=ids)
            q = torch.randn(B, Hq, 1, D, device=DEV, dtype=torch.float16)
            view = layer.decode_view()
            assert (view.rope is not None) == (rope == "pre") and (view.pads is not None) == padded, label
            mask = real[:, None, None, :] if padded else None
            assert tk.supports(view, q, mask), label  # the kernel, not its PyTorch fallback
            ms_ours = cuda_time(lambda view=view, q=q, mask=mask: tk.decode_attention(view, q, mask, D**-0.5))
            ms_sdpa = cuda_time(
                lambda q=q, k=k, v=v, mask=mask: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, enable_gqa=True
                )
            )
            stored, fp16 = layer.nbytes()
            rows.append(dict(case=label, rope=rope, padded=padded, B=B, T=T, Hq=Hq, Hkv=Hkv, D=D, ours_ms=ms_ours,
                             sdpa_ms=ms_sdpa, ours_bytes=stored, fp16_bytes=fp16,
                             ours_gbs=stored / ms_ours / 1e6, sdpa_gbs=fp16 / ms_sdpa / 1e6))  # fmt: skip
            print(
                f"decode attention {label:14s} T={T:6d}: ours {ms_ours:.3f} ms ({stored / 2**20:.1f} MiB) | "
                f"SDPA fp16 {ms_sdpa:.3f} ms ({fp16 / 2**20:.1f} MiB) | {ms_sdpa / ms_ours:.2f}x"
            )
            del layer, view, k, v
            torch.cuda.empty_cache()
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
        line = ax.plot([r["T"] for r in rs], [r["ours_ms"] for r in rs], marker="o", label=f"packed 2b, {case}")
        ax.plot([r["T"] for r in rs], [r["sdpa_ms"] for r in rs], "--", marker="x", color=line[0].get_color(),
                label=f"SDPA fp16, {case}")  # fmt: skip
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
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit(
            "bench_kernels.py needs a CUDA GPU (the kernels are tested on CPU by tests/kernels/test_triton.py)"
        )
    lengths = args.lengths or ([4096, 16384, 32768] if args.quick else [4096, 8192, 16384, 32768, 65536])
    cases = [c for c in ATTN_CASES if (args.cases is None or c[0] in args.cases) and (not args.quick or c[2] == 1)]
    import triton

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    q_rows = bench_quantize(lengths)
    a_rows = bench_attention(lengths, cases)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"quantize_pack": q_rows, "decode_attention": a_rows}, indent=1))
    plot(q_rows, a_rows, out)
    print(f"wrote {out}/results.json, quantize_pack.png, decode_attention.png")


if __name__ == "__main__":
    main()
