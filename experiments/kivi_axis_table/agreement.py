"""Turn-by-turn agreement of two runs of the axis table (e.g. prefix reuse vs one prefill per turn).

    python experiments/kivi_axis_table/agreement.py experiments/kivi_axis_table experiments/kivi_axis_table/prefix_reuse

For each cache label found in both folders (the newest completed record of each): identical responses, F1 of each,
and the paired F1 difference (B - A) with its standard error over the turns both scored.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))  # kvq_lab of this checkout

from kvq_lab.report.rows import paired_difference  # noqa: E402


def newest(folder: Path) -> dict[str, Path]:
    """cache label -> run folder of the newest completed coqa_turns record under folder/runs."""
    out: dict[str, tuple[str, Path]] = {}
    for rec in sorted((folder / "runs").glob("*/record.json")):
        r = json.loads(rec.read_text())
        if r.get("status") == "ok" and (r.get("config") or {}).get("task", {}).get("name") == "coqa_turns":
            out[r["cache"]] = (rec.parent.name, rec.parent)
    return {k: v[1] for k, v in out.items()}


def samples(run: Path) -> dict[int, dict]:
    return {s["doc_id"]: s for s in json.loads((run / "samples.json").read_text())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    args = ap.parse_args()
    A, B = newest(args.a), newest(args.b)
    print("| cache | identical responses | F1 A | F1 B | B - A (paired) |")
    print("|---|---|---|---|---|")
    for label in [k for k in A if k in B]:
        sa, sb = samples(A[label]), samples(B[label])
        ids = sorted(set(sa) & set(sb))
        same = sum(sa[i]["response"] == sb[i]["response"] for i in ids)
        mean, se, _ = paired_difference(*({i: 100 * s[i]["f1"] for i in ids} for s in (sa, sb)))
        fa = 100 * sum(sa[i]["f1"] for i in ids) / len(ids)
        fb = 100 * sum(sb[i]["f1"] for i in ids) / len(ids)
        print(f"| `{label}` | {same}/{len(ids)} | {fa:.2f} | {fb:.2f} | {mean:+.2f} ± {se:.2f} |")


if __name__ == "__main__":
    main()
