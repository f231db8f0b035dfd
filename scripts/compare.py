"""Select run records by any config field, across experiments, and print them as one table.

    python scripts/compare.py --where task.name=ppl --where key_axis=channel
    python scripts/compare.py --where cache_config.key.bits=2 --metrics ppl/ppl --cols key_axis,value_axis
    python scripts/compare.py experiments/bits experiments/group_size --where task.name=ppl --csv rows.csv
    python scripts/compare.py --verify                  # check every record against its digest; exit 1 on a mismatch

Folders: results folders, each holding runs/ (default: results/ and every experiments/<name>/ with runs/); a folder
that does not exist or has no runs/ is refused in one line, exit status 2, as a --where that does not parse. --where
FIELD=VALUE: a dotted path into the record; a bare name means config.<name> (key_axis = config.key_axis); VALUE is
YAML (2, true, null, channel); FIELD=V1,V2 allows either. Records come from the SQLite index beside each folder's runs/
(kvq_lab.records.index, rebuilt from record.json files as needed). Only records that match their digests are shown; each
other one is named in one line (kvq_lab.common.integrity). --verify checks every record of the folders (and the files
they name) and lists those that do not match."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]  # a clean clone

from cli_args import Parser, fail, results_folder  # noqa: E402

from kvq_lab.records.index import query, records_of  # noqa: E402

TOP = ("status", "run_key", "experiment", "cache", "config", "cache_config", "metrics", "inputs", "env", "name")


def parse_where(items: list[str]) -> dict:
    where = {}
    for item in items:
        field, sep, raw = item.partition("=")
        if not sep or not field:
            fail(f"--where {item!r} must be FIELD=VALUE, e.g. --where key_axis=channel")
        if field.split(".")[0] not in TOP:
            field = f"config.{field}"
        try:
            values = [yaml.safe_load(v) for v in raw.split(",")] if "," in raw else yaml.safe_load(raw)
        except yaml.YAMLError as e:
            why = str(getattr(e, "problem", None) or e).splitlines()[0]
            name = item.partition("=")[0]
            fail(f"--where {item!r}: the value {raw!r} is not YAML ({why}); quote text (--where '{name}=\"{raw}\"') "
                 "or write a plain value, e.g. --where bits=2 or --where key_axis=channel,token")  # fmt: skip
        if any(isinstance(v, (dict, list)) for v in (values if isinstance(values, list) else [values])):
            fail(f"--where {item!r}: a value is a scalar (2, true, null, channel) or V1,V2 for either, not {raw!r}")
        where[field] = values
    return where


def _get(rec: dict, dotted: str):
    cur = rec
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def verify(dirs: list[str], where: dict) -> int:
    """One line per record that does not match its digest, then a count; -> 1 if any, else 0."""
    n = bad = 0
    for d in dirs:
        for r in query(d, where, with_integrity=True):
            n += 1
            if r["_integrity"] is not None:
                bad += 1
                print(f"MISMATCH {Path(r['_path']) / 'record.json'}: {r['_integrity']}")
    print(f"{n - bad} of {n} records match their digests" + (f"; {bad} do not" if bad else ""))
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="*", help="results folders (default: results/ and experiments/*/)")
    ap.add_argument("--where", action="append", default=[], help="FIELD=VALUE (repeatable)")
    ap.add_argument("--metrics", default=None, help="comma-separated metric names (default: all non-probe ones)")
    ap.add_argument("--cols", default="experiment,cache,task.name,limit", help="config fields to show")
    ap.add_argument("--csv", default=None, help="also write the rows to this CSV file")
    ap.add_argument("--verify", action="store_true", help="check every record against its digest (exit 1: mismatch)")
    args = ap.parse_args(argv)
    where = parse_where(args.where)  # a bad --where or folder stops here, before any index is made or read
    if args.dirs:
        dirs = [str(results_folder(d)) for d in args.dirs]
    else:
        dirs = [str(p) for p in [Path("results"), *sorted(Path("experiments").glob("*"))] if (p / "runs").is_dir()]
    if args.verify:
        return verify(dirs, where)
    recs = records_of(dirs, where, verified=True)
    if not recs:
        print(f"no records match in {', '.join(dirs)}")
        return 1
    metrics = args.metrics.split(",") if args.metrics else list(
        dict.fromkeys(k for r in recs for k in r.get("metrics", {}) if not k.startswith("probe/"))
    )  # fmt: skip
    cols = args.cols.split(",")
    head = ["status", *cols, *metrics]
    rows = []
    for r in recs:
        vals = [r.get("status")]
        for c in cols:
            vals.append(r.get(c) if c in ("experiment", "cache") else _get(r, f"config.{c}"))
        vals += [r.get("metrics", {}).get(m) for m in metrics]
        rows.append(["-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v)) for v in vals])
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\n{len(rows)} records")
    if args.csv:
        import csv

        with open(args.csv, "w", newline="") as f:
            csv.writer(f).writerows([head, *rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
