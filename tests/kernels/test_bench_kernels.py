"""scripts/bench_kernels.py's decode-attention rows and launch sweep, run on CPU tensors under the Triton interpreter
with a stand-in clock (a GPU run is rare and short: a script that breaks there wastes it). In a fresh process: the
interpreter must be chosen before triton is imported."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("bench_kernels", "scripts/bench_kernels.py")
bk = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bk)
bk.DEV = "cpu"
calls = []
bk.cuda_time = lambda fn, **kw: (calls.append(fn()), 1.0)[1]  # one call, a constant time
bk.graphed = lambda fn: fn
cases = [c for c in bk.ATTN_CASES if c[0] in ("post", "pre", "padded-b4")]
rows = bk.bench_attention([200], cases, 100.0, Hq=4, Hkv=2, D=64)
bk.torch.float16  # noqa
sweep = bk.sweep(T=96, batches=(1,), Hq=4, Hkv=2, D=64)
print(json.dumps({"rows": rows, "sweep": sweep}))
"""


def test_bench_kernels_rows_and_sweep():
    """Every case gives a row naming its route (tensor cores for rope=post, plain and padded; general for rope=pre),
    both routes timed where the fast one runs, the fastest fp16 baseline named, GB/s and the copy fraction derived;
    the sweep gives a time per (warps, stages) and restores the defaults."""
    import json

    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    routes = {row["case"]: row["route"] for row in out["rows"]}
    assert routes == {"post": "tensor_cores", "pre": "general", "padded-b4": "tensor_cores"}
    for row in out["rows"]:
        assert row["baseline"] in row["baselines"] and row["baseline_ms"] == 1.0
        for route in ("tensor_cores", "general") if row["route"] == "tensor_cores" else ("general",):
            t = row[route]
            assert t["ms"] == t["graph_ms"] == 1.0 and t["gbs"] == row["ours_bytes"] / 1e6
    assert len(out["sweep"]) == 12 and all(s["ms"] == 1.0 for s in out["sweep"])
