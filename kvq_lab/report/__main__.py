"""Tables and figures of one study from its committed records.

    python -m kvq_lab.report <study>            # writes experiments/<study>/'s tables and figures
    python -m kvq_lab.report <study> --check    # compares its tables with the committed ones; exit 1 on a difference
    python -m kvq_lab.report --list             # the studies (kvq_lab/report/studies/__init__.py: STUDIES)

Run from the repo root (or name `--experiments`). An unknown study is refused in one line naming the known ones,
exit status 2. `--check` compares tables only: PNGs are not byte-stable across matplotlib builds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvq_lab.report.studies import STUDIES, load


def run(study: str, experiments: Path = Path("experiments"), check: bool = False) -> int:
    """Make `study`'s tables (and figures, unless `check`) in experiments/<study>/; -> exit status."""
    mod = load(study)
    folder = Path(experiments) / study
    recs = mod.records(folder)
    differ = []
    for name, text in mod.tables(recs).items():
        path = folder / name
        if check:
            if not path.is_file() or path.read_text() != text:
                differ.append(path)
                print(f"differs: {path} (not what {study}'s records make now)", file=sys.stderr)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if hasattr(mod, "text"):
        print(mod.text(recs))
    if check:
        return 1 if differ else 0
    if hasattr(mod, "figure"):
        mod.figure(recs, folder)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvq_lab.report", description=__doc__.splitlines()[0])
    ap.add_argument("study", nargs="?", help="the study: its folder under experiments/ (see --list)")
    ap.add_argument("--check", action="store_true", help="compare its tables with the committed ones, write nothing")
    ap.add_argument("--list", action="store_true", help="list the studies")
    ap.add_argument("--experiments", type=Path, default=Path("experiments"), help="the folder holding the studies")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(sorted(STUDIES)))
        return 0
    if args.study not in STUDIES:
        print(f"error: unknown study {args.study!r}; known: {', '.join(sorted(STUDIES))}", file=sys.stderr)
        return 2
    return run(args.study, args.experiments, args.check)


if __name__ == "__main__":
    sys.exit(main())
