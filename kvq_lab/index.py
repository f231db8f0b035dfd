"""A query index over run records: SQLite at `<results_dir>/index.sqlite`, rebuilt from the record.json files.

The records are the source of truth; the index is a cache of them. Each query first refreshes it: one `stat` per
run folder, and only records whose size or mtime changed are read again (a folder of 10,000 records refreshes in
well under a second when nothing changed; `scripts/bench_index.py` measures it). A missing, stale or corrupt
index is rebuilt; where the folder is read-only the index lives in memory for the call. Delete it at any time.

Rows hold the whole record as JSON, so any field selects, e.g. `where={"config.key_axis": "channel",
"config.task.name": "ppl", "status": "ok"}` (dotted paths into the record; `cache_config.key.bits` too).
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvq_lab.results import RECORD

INDEX = "index.sqlite"
SCHEMA_VERSION = 2
_COLUMNS = ("run_key", "status", "experiment", "task", "cache")


def _open(results_dir: Path) -> sqlite3.Connection:
    path = Path(results_dir) / INDEX
    try:
        Path(results_dir).mkdir(parents=True, exist_ok=True)
        con = sqlite3.connect(path, timeout=60)
        con.execute("PRAGMA journal_mode=WAL")  # readers never wait for a sweep that is writing
        ver = con.execute("PRAGMA user_version").fetchone()[0]
        if ver != SCHEMA_VERSION:
            con.executescript("DROP TABLE IF EXISTS records; DROP TABLE IF EXISTS meta;")
            con.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    except sqlite3.DatabaseError:  # corrupt: it is only a cache of the records
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        con = sqlite3.connect(path, timeout=60)
        con.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    except OSError:
        con = sqlite3.connect(":memory:")
    con.execute(
        "CREATE TABLE IF NOT EXISTS records (path TEXT PRIMARY KEY, size INTEGER, mtime_ns INTEGER, run_key TEXT, "
        "status TEXT, experiment TEXT, task TEXT, cache TEXT, record TEXT, fields TEXT)"
    )
    con.execute("CREATE INDEX IF NOT EXISTS by_key ON records (run_key)")
    con.execute("CREATE INDEX IF NOT EXISTS by_experiment ON records (experiment)")
    return con


def _scan(runs: Path) -> dict[str, tuple[int, int]]:
    """{run folder path: (size, mtime_ns) of its record.json} for every run folder with a record."""
    out = {}
    try:
        entries = list(os.scandir(runs))
    except FileNotFoundError:
        return out
    for e in entries:
        if not e.is_dir():
            continue
        try:
            st = os.stat(os.path.join(e.path, RECORD))
        except FileNotFoundError:
            continue
        out[e.path] = (st.st_size, st.st_mtime_ns)
    return out


def refresh(con: sqlite3.Connection, results_dir: Path) -> int:
    """Bring the index in line with the record files; -> how many records were (re)read."""
    on_disk = _scan(Path(results_dir) / "runs")
    known = {p: (s, m) for p, s, m in con.execute("SELECT path, size, mtime_ns FROM records")}
    gone = [p for p in known if p not in on_disk]
    changed = [p for p, sm in on_disk.items() if known.get(p) != sm]
    rows = []
    for p in changed:
        try:
            rec = json.loads(Path(p, RECORD).read_text())
        except (OSError, ValueError) as e:
            print(f"skipping unreadable record {p}: {e}")
            continue
        task = (rec.get("config") or {}).get("task", {})
        exp = rec.get("experiment") or (rec.get("config") or {}).get("experiment_name")
        size, mtime = on_disk[p]
        rows.append(
            (p, size, mtime, rec.get("run_key"), rec.get("status"), exp, task.get("name"), rec.get("cache"),
             json.dumps(rec), _strict_json(rec))
        )  # fmt: skip
    with con:
        con.executemany("DELETE FROM records WHERE path = ?", [(p,) for p in gone])
        con.executemany("INSERT OR REPLACE INTO records VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    return len(rows)


def _strict_json(rec: dict) -> str:
    """The record as strict JSON for SQLite's json functions: NaN and infinities (a probe's kivi_ratio can be
    inf) become null. `record` keeps Python's JSON, so queries return the record exactly as written."""

    def clean(x):
        if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(rec))


def _sql_where(where: dict[str, Any] | None) -> tuple[str, list]:
    clauses, args = [], []
    for field, value in (where or {}).items():
        if field in _COLUMNS:
            expr = field
        else:
            expr = "json_extract(fields, ?)"
            args.append("$." + field)
        if value is None:
            clauses.append(f"{expr} IS NULL")
        elif isinstance(value, (list, tuple, set)):
            clauses.append(f"{expr} IN ({', '.join('?' * len(value))})")
            args.extend(_sql_value(v) for v in value)
        else:
            clauses.append(f"{expr} = ?")
            args.append(_sql_value(value))
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", args


def _sql_value(v):
    return int(v) if isinstance(v, bool) else v  # json_extract gives 1/0 for true/false


def query(results_dir: Path | str, where: dict[str, Any] | None = None) -> list[dict]:
    """Records under `results_dir` matching `where` (dotted record paths -> value, or a list of allowed values),
    oldest first (by run folder name, as `results.load_records`); each with `_path` set."""
    con = _open(Path(results_dir))
    try:
        refresh(con, Path(results_dir))
        sql, args = _sql_where(where)
        out = []
        for path, blob in con.execute(f"SELECT path, record FROM records{sql} ORDER BY path", args):
            rec = json.loads(blob)
            rec["_path"] = path
            out.append(rec)
        return out
    finally:
        con.close()


def records_of(dirs: Iterable[Path | str], where: dict[str, Any] | None = None) -> list[dict]:
    """`query` over several results folders (e.g. results/ and every experiments/<name>/)."""
    return [r for d in dirs for r in query(d, where)]
