"""How fast the record index (kvq_lab/records/index.py) builds and answers on a large synthetic results folder.

    python scripts/bench_index.py                 # 10,000 records in a temporary folder
    python scripts/bench_index.py --n 50000

Prints wall times (median of --repeat) for: a build from scratch, a refresh with nothing changed, a refresh after
100 new records, a lookup by run key (what resume does), a selection by config fields, and, for comparison, reading
every record.json (what resume did before the index).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvq_lab.records import index  # noqa: E402
from kvq_lab.records.record import load_records  # noqa: E402


def make_records(root: Path, n: int, start: int = 0, seed: int = 0) -> list[str]:
    rng = random.Random(seed + start)
    keys = []
    for i in range(start, start + n):
        key = f"{rng.getrandbits(64):016x}"
        cfg = {
            "key_axis": rng.choice(["token", "channel"]),
            "value_axis": rng.choice(["token", "channel"]),
            "key_bits": rng.choice([2, 3, 4, 8]),
            "group_size": rng.choice([16, 32, 64]),
            "limit": None,
            "task": {"name": rng.choice(["ppl", "coqa_turns", "gsm8k"])},
            "model": {"path": "smollm2-135m"},
        }
        rec = {"name": f"run{i}", "status": rng.choice(["ok"] * 9 + ["failed"]), "run_key": key,
               "config": cfg, "experiment": f"exp{i % 20}", "cache": "K2b-C32_V2b-T32_sim",
               "metrics": {"ppl/ppl": rng.uniform(15, 40)}, "env": {"git": "abc"}}  # fmt: skip
        d = root / "runs" / f"20261130-{i:08d}_run{i}"
        d.mkdir(parents=True)
        (d / "record.json").write_text(json.dumps(rec))
        keys.append(key)
    return keys


def timed(fn, repeat: int) -> float:
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        keys = make_records(root, args.n)
        print(f"{args.n} synthetic records written in {time.perf_counter() - t0:.1f} s under {root}")

        def build():
            (root / index.INDEX).unlink(missing_ok=True)
            index.query(root, {"run_key": "none"})

        rows = [("build from scratch", timed(build, args.repeat))]
        rows.append(
            (
                "refresh, nothing changed + lookup by run key",
                timed(lambda: index.query(root, {"run_key": keys[7]}), args.repeat),
            )
        )
        sel = {"config.key_axis": "channel", "config.task.name": "ppl", "config.key_bits": [2, 3], "status": "ok"}
        n_sel = len(index.query(root, sel))
        rows.append((f"select by 4 config fields ({n_sel} rows)", timed(lambda: index.query(root, sel), args.repeat)))
        make_records(root, 100, start=args.n)
        t0 = time.perf_counter()
        index.query(root, {"run_key": keys[0]})
        rows.append(("refresh after 100 new records", time.perf_counter() - t0))
        rows.append(("for comparison: read every record.json", timed(lambda: load_records(root), args.repeat)))
        print(f"\nmachine: {os.cpu_count()} CPUs; median of {args.repeat}")
        print("| operation | seconds |\n|---|---|")
        for name, t in rows:
            print(f"| {name} | {t:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
