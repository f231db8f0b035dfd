"""Markdown table (ours beside the paper's) and a PNG bar chart for one experiment's run records.

    python scripts/make_table.py kivi_axis_table                      # prints; writes experiments/kivi_axis_table/
    python scripts/make_table.py kivi_axis_table --limit 20           # only the quick runs (limit=20)
    python scripts/make_table.py kivi_residual --results-dir ../mine --out ../mine/table

Rows: one per cache setting; for each task the run covering the most documents (newest among equals). Failed or
unfinished rows say so instead of disappearing. Records are read through the record index, each checked against its
digest (a record that does not match is named and left out). A results folder that does not exist or holds no runs/
(a mistyped experiment) is refused in one line, exit status 2. Logic: kvq_lab/report/tables.py; paper numbers:
kvq_lab/report/anchors.py."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]  # a clean clone

from cli_args import Parser, results_folder  # noqa: E402

from kvq_lab.report.anchors import DEFAULT_MODEL, TABLE1  # noqa: E402
from kvq_lab.report.tables import make_report  # noqa: E402


def main(argv=None) -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", help="experiment name (conf/experiment/<name>.yaml; records' experiment_name)")
    ap.add_argument(
        "--results-dir", default=None, help="records folder (default experiments/<experiment>, where its runs go)"
    )
    ap.add_argument("--out", default=None, help="folder for table.md and the PNG (default experiments/<experiment>/)")
    ap.add_argument("--limit", type=int, default=None, help="only runs made with this limit=")
    ap.add_argument("--paper-model", default=DEFAULT_MODEL, choices=sorted(TABLE1))
    ap.add_argument("--model", default=None, help="only this model's runs (model.path, e.g. gemma3-270m)")
    args = ap.parse_args(argv)
    out = args.out or Path("experiments") / args.experiment
    args.results_dir = results_folder(args.results_dir or Path("experiments") / args.experiment)
    try:
        md, png = make_report(args.results_dir, args.experiment, out, limit=args.limit, paper_model=args.paper_model,
                              model=args.model)  # fmt: skip
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(md)
    if png is None:
        return 1
    print(f"\nwrote {Path(out) / 'table.md'} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
