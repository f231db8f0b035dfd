"""Where one batched decode step spends its time: DynamicCache at the batch a budget holds vs the packed 2-bit cache
at its batch (run from the repo root on an idle machine: python experiments/throughput/profile_step.py
[--length 8192] [--budget 2GiB]). Prints the top operators of torch.profiler over a few steps of each."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def bench():
    spec = importlib.util.spec_from_file_location("bench_throughput", ROOT / "scripts" / "bench_throughput.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_throughput"] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    b = bench()
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--budget", type=b.parse_bytes, default=2 * 2**30)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    model, tok = b.load_model("smollm2-135m", dtype=torch.float32)
    b.cache_bytes.text_cfg = model.config.get_text_config(decoder=True)
    ids = tok(b.TEXT * (40 + args.length // 20), return_tensors="pt").input_ids[:, : args.length]
    kv, _ = b.exact_prefill(model, ids[:, :-1])
    pair = ("DynamicCache", "ours packed 2b K-C V-T G32 R128 (")
    caches = [c for c in b.make_caches(model) if c.label.startswith(pair)]
    for c in caches:
        one, _ = b.tiled(c.make, kv, 1)
        per_seq = b.cache_bytes(one)[0]
        batch = args.budget // per_seq
        cache, _ = b.tiled(c.make, kv, batch)
        b.decode(model, cache, ids.expand(batch, -1), None, 2)  # warm
        cache, _ = b.tiled(c.make, kv, batch)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            times, _ = b.decode(model, cache, ids.expand(batch, -1), None, args.steps + 1)
        step = sum(times) / len(times)
        aten = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6 / (args.steps + 1)
        print(f"\n## {c.label}: batch {batch}, {args.length} tokens, step {step:.3f} s (profiled); PyTorch operators "
              f"{aten:.3f} s a step, the rest ({step - aten:.3f} s) outside them: the C kernel (a ctypes call) and "
              "Python\n")  # fmt: skip
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))
        del cache


if __name__ == "__main__":
    main()
