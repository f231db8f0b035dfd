"""The CPU kernel alone, several kernel sources side by side: one fp32 layer of SmolLM2's attention shape (3 kv heads, 9
query heads, D = 64; 2-bit K per-channel / V per-token, G = 32, R = 128) prefilled with random keys and values, for
rope=post and rope=pre (or the configurations `--cfgs` names), calls alternating between sources and configurations;
prints each one's median call time and its largest output difference to the first source's (a probe that is wrong on
purpose differs, as it should).

    python experiments/cache_speed/issue14/run8/kernel_alone.py --length 8192 \\
        kvq_lab/kernels/cpu_kernel.c /tmp/probe.c

    python experiments/cache_speed/issue14/run8/kernel_alone.py --length 4096 OLD.c kvq_lab/kernels/cpu_kernel.c \\
        --cfgs int-post fp8_e4m3-post lut-post int-pre

`--cfgs` (run 15 on): FORMAT-ROPE layers (int, fp8_e4m3, lut: 2 bits except fp8; K per-channel, V per-token). Besides
each median, the paired ratios (median over rounds of a ratio of two calls in the same round, which cancels the
machine's drift): each configuration against the first source's first configuration, and each source's second
configuration against its first (rope=pre over rope=post with the defaults).

Alone, the layer's packed bytes and the rope table stay in the CPU caches between calls: this measures arithmetic.
What memory traffic costs shows only inside the model (`run6/inmodel_ab.py`), where the weights stream through them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [
    str(ROOT),
    str(ROOT / "scripts"),
    str(ROOT / "tests"),
    str(Path(__file__).resolve().parents[1] / "run6"),
]

from inmodel_ab import build_kernel  # noqa: E402
from test_fast_path import layer_of  # noqa: E402

from kvq_lab.kernels import cpu_build as cb  # noqa: E402
from kvq_lab.kernels import cpu_kernel as ck  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sources", nargs="+", type=Path, help="cpu_kernel.c variants (the first is the reference)")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=60, help="timed calls per (source, rope), after 5 untimed")
    ap.add_argument("--cfgs", nargs="+", default=["int-post", "int-pre"], help="FORMAT-ROPE layers to call")
    args = ap.parse_args()
    for src in args.sources:
        if not src.is_file():
            raise SystemExit(f"no kernel source {src}: give paths of cpu_kernel.c variants")
    torch.set_num_threads(2)
    libs = [build_kernel(src) for src in args.sources]
    N = args.length
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 3, N, 64, generator=g), torch.randn(1, 3, N, 64, generator=g)
    k[..., 5] *= 10  # an outlier channel
    views = {}
    for cfg in args.cfgs:
        fmt, rope = cfg.rsplit("-", 1)
        bits = 8 if fmt.startswith("fp8") else 2
        layer = layer_of((bits, 32, "channel", fmt), (bits, 32, "token", fmt), 128, 0, 64, rope=rope)
        layer.update(k[:, :, : N - 1], v[:, :, : N - 1])  # prefill, then one decode step
        layer.update(k[:, :, N - 1 :], v[:, :, N - 1 :])
        views[cfg] = layer.view_for(frozenset({"rope"}))
    q = torch.randn(1, 9, 1, 64, generator=g)
    times = {(i, r): [] for i in range(len(libs)) for r in views}
    outs = {}
    for _ in range(5 + args.calls):
        for i, lib in enumerate(libs):
            for r, view in views.items():
                cb._LIB = lib
                t = time.perf_counter()
                outs[i, r] = ck.decode_attention(view, q, None, 0.125)
                times[i, r].append(time.perf_counter() - t)
    first = (0, args.cfgs[0])
    for (i, r), ts in times.items():
        diff = (outs[i, r] - outs[0, r]).abs().max().item()
        paired = statistics.median(t / t0 for t, t0 in zip(ts[5:], times[first][5:], strict=True))
        print(f"{str(args.sources[i]):40s} {r:14s} {statistics.median(ts[5:]) * 1e6:8.1f} us  "
              f"paired / the first's {args.cfgs[0]}: {paired:.3f}  max |out - first's| {diff:.2e}")  # fmt: skip
    if len(args.cfgs) > 1:
        a, b = args.cfgs[:2]
        for i, src in enumerate(args.sources):
            paired = statistics.median(t / t0 for t, t0 in zip(times[i, b][5:], times[i, a][5:], strict=True))
            print(f"{str(src):40s} {b} / {a}, paired: {paired:.3f}")


if __name__ == "__main__":
    main()
