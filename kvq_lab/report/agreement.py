"""Turn-by-turn agreement of two runs of the axis table (e.g. prefix reuse vs one prefill per turn).

    python -m kvq_lab.report.agreement experiments/kivi_axis_table experiments/kivi_axis_table/prefix_reuse

For each cache label found in both folders, one model's records (`--model`, default SmolLM2-135M: the folder also
holds Gemma's runs of the same labels), the completed coqa_turns record over the most turns (the newest among
equals; records read through `kvq_lab.report.study.read`, each checked against its digest): identical responses, F1
of each, and the paired F1 difference (B - A) with its standard error over the turns both scored.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvq_lab.report.rows import paired_difference
from kvq_lab.report.study import read, samples


def fullest(folder: Path, model: str) -> dict[str, dict]:
    """cache label -> the completed coqa_turns record of `model` over the most turns (the newest among equals)."""
    best: dict[str, dict] = {}
    for r in read(folder, (model,), where={"config.task.name": "coqa_turns"}):  # oldest first
        n = r["metrics"].get("coqa_turns/n", 0)
        if r["cache"] not in best or n >= best[r["cache"]]["metrics"].get("coqa_turns/n", 0):
            best[r["cache"]] = r
    return best


def table(a: Path, b: Path, model: str = "smollm2-135m") -> str:
    A, B = fullest(a, model), fullest(b, model)
    lines = ["| cache | identical responses | F1 A | F1 B | B - A (paired) |", "|---|---|---|---|---|"]
    for label in [k for k in A if k in B]:
        sa, sb = ({s["doc_id"]: s for s in samples(r)} for r in (A[label], B[label]))
        ids = sorted(set(sa) & set(sb))
        same = sum(sa[i]["response"] == sb[i]["response"] for i in ids)
        mean, se, _ = paired_difference(*({i: 100 * s[i]["f1"] for i in ids} for s in (sa, sb)))
        fa = 100 * sum(sa[i]["f1"] for i in ids) / len(ids)
        fb = 100 * sum(sb[i]["f1"] for i in ids) / len(ids)
        lines.append(f"| `{label}` | {same}/{len(ids)} | {fa:.2f} | {fb:.2f} | {mean:+.2f} ± {se:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvq_lab.report.agreement", description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="results folder A (holding runs/)")
    ap.add_argument("b", type=Path, help="results folder B")
    ap.add_argument("--model", default="smollm2-135m", help="whose records (model.path or name, e.g. gemma3-270m)")
    args = ap.parse_args(argv)
    for folder in (args.a, args.b):
        if not (folder / "runs").is_dir():
            why = "holds no runs/ folder: name a results folder (e.g. experiments/kivi_axis_table)"
            print(f"error: {str(folder)!r} {why}", file=sys.stderr)
            return 2
    print(table(args.a, args.b, args.model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
