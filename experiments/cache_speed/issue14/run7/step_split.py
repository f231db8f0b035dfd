"""Where a decode step's time goes, inside the model, for several caches side by side: every cache prefilled, then one
step each in turn (A, B, A, B, ...), each step split into the packed layers' `update`, the attention function's
Python (`kvq_sdpa_attention` less the C call), the C call (`kvq_decode_attention`) and the rest of the model.
Prints each cache's median of each part over the timed steps.

    python experiments/cache_speed/issue14/run7/step_split.py --length 4096 --dtype bf16 --steps 24

Why in the model: per-call costs of Python there are several times what they are alone (the weights streaming
through the CPU caches every step evict the interpreter's data), so a split measured alone misleads.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(Path(__file__).resolve().parents[1] / "run6")]

from bench_cache import TEXT, make_caches  # noqa: E402
from inmodel_ab import Timed  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from kvq_lab.cache import attention, packed  # noqa: E402
from kvq_lab.kernels import cpu_build  # noqa: E402
from kvq_lab.models import cache_kwarg, load_model  # noqa: E402

PARTS = ("update", "attention")


def instrument(acc: dict[str, float]) -> Timed:
    """Add the packed layers' update and the attention function's time to acc; the C call's time adds up in the
    returned library's `seconds` (it becomes the kernel library the caches call)."""
    clock = time.perf_counter
    update = packed.PackedLayer.update

    def timed_update(self, *args, **kwargs):
        t = clock()
        try:
            return update(self, *args, **kwargs)
        finally:
            acc["update"] += clock() - t

    packed.PackedLayer.update = timed_update
    attend = attention.kvq_sdpa_attention

    def timed_attention(*args, **kwargs):
        t = clock()
        try:
            return attend(*args, **kwargs)
        finally:
            acc["attention"] += clock() - t

    ALL_ATTENTION_FUNCTIONS.register(attention.ATTN_NAME, timed_attention)
    lib = cpu_build._LIB = Timed(cpu_build.load())
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--steps", type=int, default=24, help="timed steps per cache (after 3 untimed)")
    ap.add_argument("--caches", nargs="+", default=["R128 (cpu)", "preRoPE (cpu)"], help="label endings")
    args = ap.parse_args()
    torch.set_num_threads(2)
    acc = dict.fromkeys(PARTS, 0.0)
    lib = instrument(acc)
    model, tok = load_model("smollm2-135m", dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    ids = tok(TEXT * (40 + args.length // 20), return_tensors="pt").input_ids[:, : args.length]
    rows = make_caches(model, 2, 32, 128)
    runs = []
    with torch.no_grad():
        for end in args.caches:
            row = next((r for r in rows if r.label.endswith(end)), None)
            if row is None:
                raise SystemExit(f"no cache label ends with {end!r}: pick from {[r.label for r in rows]}")
            kw = {cache_kwarg(): row.make(), "use_cache": True}
            runs.append({"name": row.label, "kw": kw, "next": model(ids, **kw).logits[:, -1:].argmax(-1), "at": []})
        for _ in range(3 + args.steps):
            for r in runs:
                acc.update(dict.fromkeys(PARTS, 0.0))
                lib.seconds = 0.0
                t = time.perf_counter()
                r["next"] = model(r["next"], **r["kw"]).logits[:, -1:].argmax(-1)
                total = time.perf_counter() - t
                r["at"].append((total, acc["update"], acc["attention"] - lib.seconds, lib.seconds))
    for r in runs:
        steps = r["at"][3:]
        med = [statistics.median(s[i] for s in steps) * 1e3 for i in range(4)]
        rest = statistics.median(s[0] - s[1] - s[2] - s[3] for s in steps) * 1e3
        print(f"{r['name']:48s} step {med[0]:7.2f} ms  update {med[1]:5.2f}  attention (Python) {med[2]:5.2f}  "
              f"C {med[3]:6.2f}  rest {rest:6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
