"""The CPU kernel alone, two versions side by side: both builds loaded in one process, their calls alternating over
the 30 layers' decode views of SmolLM2's packed cache (2-bit K-C/V-T, G32, R128) after a prefill and one step.

    python experiments/cache_speed/issue14/run2/kernel_ab.py --base 149ca85 --lengths 512 4096

Prints, per prompt length and rope order, each version's median time per layer call (1 thread) and whether the
outputs are equal bit for bit. `--base`: the commit whose kvq_lab/kernels/cpu_kernel.c is compared with this tree's.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_cache import TEXT, make_caches  # noqa: E402

from kvq_lab.kernels import cpu_build as cb  # noqa: E402
from kvq_lab.kernels import cpu_kernel as ck  # noqa: E402
from kvq_lab.models import cache_kwarg, load_model  # noqa: E402


def build(source: Path):
    cb.SOURCE, cb._LIB, cb._ERROR = source, None, None
    return cb.load()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--calls", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    old_src = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.base}:kvq_lab/kernels/cpu_kernel.c"],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
    tmp = Path(tempfile.mkdtemp()) / "cpu_kernel_base.c"
    tmp.write_text(old_src)
    new_source = cb.SOURCE
    libs = {args.base: build(tmp), "this tree": build(new_source)}
    model, tok = load_model("smollm2-135m", dtype=torch.float32, device="cpu")
    text = tok(TEXT * (40 + max(args.lengths) // 20), return_tensors="pt").input_ids
    cfg = model.config
    q = torch.randn(1, cfg.num_attention_heads, 1, cfg.head_dim, generator=torch.Generator().manual_seed(0))
    for L in args.lengths:
        for row in make_caches(model, 2, 32, 128, full=False)[1:]:  # rope=post, rope=pre (backend cpu)
            cache = row.make()
            kw = {cache_kwarg(): cache, "use_cache": True}
            with torch.no_grad():
                out = model(text[:, :L], **kw)
                model(out.logits[:, -1:].argmax(-1), **kw)
            views = [layer.decode_view() for layer in cache.layers]
            outs, times = {}, {k: [] for k in libs}
            for name, lib in libs.items():
                cb._LIB = lib
                outs[name] = [ck.decode_attention(v, q, None, 0.125) for v in views]
            for _ in range(args.calls):
                for name, lib in libs.items():
                    cb._LIB = lib
                    t = time.perf_counter()
                    for v in views:
                        ck.decode_attention(v, q, None, 0.125)
                    times[name].append((time.perf_counter() - t) / len(views))
            a, b = outs.values()
            same = all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
            med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
            base, new = med.values()
            print(f"{L} tokens, {row.label}: " + ", ".join(f"{k} {v:.0f} us" for k, v in med.items())
                  + f" -> {new / base:.2f}x; outputs bit for bit equal: {same}")  # fmt: skip


if __name__ == "__main__":
    main()
