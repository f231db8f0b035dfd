"""Whole decode steps inside the model, several (cache, kernel source) pairs side by side: every cache prefilled, then
one step each in turn, so the VM's drift falls on all of them alike. Prints each pair's median step, the median
time spent in the C call (`kvq_decode_attention`) within it, and the ratio to the first pair (paired step by step).

    python experiments/cache_speed/issue14/run6/inmodel_ab.py --length 8192 --dtype bf16 \\
        post:kvq_lab/kernels/cpu_kernel.c pre:kvq_lab/kernels/cpu_kernel.c pre:/tmp/probe.c

A pair is `kind:source`, kind one of post (packed 2-bit K-C/V-T G32 R128), pre (the same, rope=pre), hadamard; the
source a cpu_kernel.c (any edit of it: a probe that is wrong on purpose, e.g. every rope=pre id pointed at one table
row, tells what the table's reads cost). Tokens are compared with the first pair's: a probe's differ, as it should.
Why in the model: alone, a layer's data stays in the CPU caches and the kernel's memory traffic costs little; in the
model ~540 MB of weights stream through them every step (the table-read probe above moved a bf16 step at 8192 by 13
ms of 114 in the model; alone, the fourth pass's probe of the same kind moved the kernel at 4096 by <2%).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_cache import TEXT, make_caches  # noqa: E402

from kvq_lab.kernels import cpu_build as cb  # noqa: E402
from kvq_lab.models import cache_kwarg, load_model  # noqa: E402

KINDS = {
    "post": "2b K-C V-T G32 R128 (cpu)",
    "pre": "2b K-C V-T G32 R128 preRoPE (cpu)",
    "hadamard": "2b K-C V-T G32 R128 hadamard (cpu)",
}


class Timed:
    """A loaded kernel library whose decode calls add their time to `seconds`."""

    def __init__(self, lib):
        self.lib, self.seconds = lib, 0.0

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def kvq_decode_attention(self, *args):
        t = time.perf_counter()
        try:
            return self.lib.kvq_decode_attention(*args)
        finally:
            self.seconds += time.perf_counter() - t


def build_kernel(src: Path):
    """The CPU kernel library built from the source `src` (any cpu_kernel.c variant), loaded; it is also left as the
    library `cpu_kernel` calls until `cb._LIB` is set to another."""
    cb.SOURCE, cb._LIB, cb._ERROR = src, None, None
    return cb.load()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pairs", nargs="+", help="kind:source (kind: post, pre, hadamard)")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=24, help="timed steps per pair (after 3 untimed)")
    args = ap.parse_args()
    pairs = []
    for p in args.pairs:
        kind, _, src = p.partition(":")
        if kind not in KINDS or not Path(src).is_file():
            raise SystemExit(f"bad pair {p!r}: write kind:path with kind in {sorted(KINDS)} and an existing file")
        pairs.append((p, kind, Path(src)))
    libs = {}
    for _, _, src in pairs:  # one build per distinct source
        if src not in libs:
            libs[src] = Timed(build_kernel(src))
    torch.set_num_threads(2)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model, tok = load_model("smollm2-135m", dtype=dtype, device="cpu")
    ids = tok(TEXT * (40 + args.length // 20), return_tensors="pt").input_ids[:, : args.length].repeat(args.batch, 1)
    rows = make_caches(model, 2, 32, 128)
    runs = []
    with torch.no_grad():
        for name, kind, src in pairs:
            cb._LIB = libs[src]
            row = next(r for r in rows if r.label == f"ours packed {KINDS[kind]}")
            kw = {cache_kwarg(): row.make(), "use_cache": True}
            nxt = model(ids, **kw).logits[:, -1:].argmax(-1)
            runs.append({"name": name, "kw": kw, "next": nxt, "lib": libs[src], "step": [], "c": [], "tokens": []})
        for _ in range(3 + args.steps):
            for r in runs:
                cb._LIB, r["lib"].seconds = r["lib"], 0.0
                t = time.perf_counter()
                r["next"] = model(r["next"], **r["kw"]).logits[:, -1:].argmax(-1)
                r["step"].append(time.perf_counter() - t)
                r["c"].append(r["lib"].seconds)
                r["tokens"].append(r["next"].flatten().tolist())
    first = runs[0]
    for r in runs:
        step, c = statistics.median(r["step"][3:]), statistics.median(r["c"][3:])
        paired = statistics.median(a / b for a, b in zip(first["step"][3:], r["step"][3:], strict=True))
        same = r["tokens"] == first["tokens"]
        print(f"{r['name']:40s} step {step * 1e3:7.2f} ms  C {c * 1e3:6.2f} ms  first/this {paired:.3f}  "
              f"tokens as the first: {same}")  # fmt: skip


if __name__ == "__main__":
    main()
