"""An A/A test of the benchmark's step order: DynamicCache, ours packed rope=post and rope=pre, and the same two again
(fresh caches of the same configuration), decoded in turn one step each as `scripts/bench_cache.py` does, with the
benchmark's order (`step_orders`: changing from round to round) or with one fixed order (`--fixed-order`: A, B, C, D,
E, A, B, ...). Prints each cache's median step and ratio to DynamicCache per repeat, and the speed of one cache
relative to another both as a ratio of medians and paired (`bench_cache.paired_ratio`): two caches of one
configuration should measure alike (1.000), whatever their place in the round.

    python experiments/cache_speed/issue14/run14/aa_test.py --length 4096 --dtype bf16 --repeats 3 [--fixed-order]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import bench_cache  # noqa: E402

from kvq_lab.models import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--fixed-order", action="store_true", help="one fixed order of steps (the benchmark before)")
    args = ap.parse_args()
    if args.fixed_order:
        bench_cache.step_orders = lambda n: [list(range(n))]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model, tok = load_model("smollm2-135m", dtype=dtype)
    bench_cache.cache_bytes.text_cfg = model.config.get_text_config(decoder=True)
    rows = bench_cache.make_caches(model, 2, 32, 128, full=False)  # DynamicCache, rope=post, rope=pre
    rows += [bench_cache.Row(r.kind, r.label + " again", r.make, r.backend, r.rope) for r in rows[1:]]
    ids = tok(bench_cache.TEXT * (40 + args.length // 20), return_tensors="pt").input_ids[:, : args.length]
    order = "fixed order" if args.fixed_order else "step_orders"
    print(f"# {args.dtype}, {args.length} tokens, {args.new_tokens} steps ({args.warmup} untimed), {order}")
    post, pre, post2, pre2 = (r.label for r in rows[1:])
    for rep in range(args.repeats):
        res = bench_cache.run_alternating(model, rows, ids, None, args.new_tokens, args.warmup)
        med = {k: statistics.median(v["step_s"]) * 1e3 for k, v in res.items()}
        for k, v in med.items():
            print(f"repeat {rep}  {k:50s} {v:7.2f} ms  vs Dynamic {med['DynamicCache'] / v:.3f}x")
        for a, b, what in ((post, post2, "post again / post"), (pre, pre2, "pre again / pre"),
                           (post, pre, "pre / post"), (post2, pre2, "pre again / post again")):  # fmt: skip
            paired = bench_cache.paired_ratio([res[a]], [res[b]])
            print(f"repeat {rep}  speed {what:24s} medians {med[a] / med[b]:.3f}  paired {paired:.3f}")


if __name__ == "__main__":
    main()
