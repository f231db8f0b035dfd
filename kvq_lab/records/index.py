"""A query index over run records: SQLite at `<results_dir>/index.sqlite`, rebuilt from the record.json files.

The records are the source of truth; the index is a cache of them. Each query first refreshes it: one `scandir` per
run folder, and only records whose folder changed (the size and mtime of any file in it) are read again and checked
against their digests (`kvq_lab.common.integrity`; the verdict is kept in the index). A missing, stale or corrupt index,
or one that fails with any SQLite error (corrupt pages, a full disk), is rebuilt from the records in one line; where
that fails too (a read-only or full folder) the index lives in memory for the call. Delete it at any time.

Rows hold the whole record as JSON, so any field selects, e.g. `where={"config.key_axis": "channel",
"config.task.name": "ppl", "status": "ok"}` (dotted paths into the record; `cache_config.key.bits` too).
`verified=True` returns only records that match their digests and names each other one in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kvq_lab.common import integrity
from kvq_lab.records.record import RECORD, refuse

INDEX = "index.sqlite"
SCHEMA_VERSION = 3
_COLUMNS = ("run_key", "row_key", "status", "experiment", "task", "cache")


def _open(path: Path | str) -> sqlite3.Connection:
    """The index database at `path` (":memory:" for a throwaway one), schema in place. Raises sqlite3.DatabaseError
    for a corrupt file, OSError for a folder it cannot be made in."""
    if path != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(path, timeout=60)
    try:
        if path != ":memory:":
            con.execute("PRAGMA journal_mode=WAL")  # readers never wait for a sweep that is writing
        if con.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:
            con.executescript("DROP TABLE IF EXISTS records; DROP TABLE IF EXISTS meta;")
            con.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        con.execute(
            "CREATE TABLE IF NOT EXISTS records (path TEXT PRIMARY KEY, sig TEXT, run_key TEXT, row_key TEXT, "
            "status TEXT, experiment TEXT, task TEXT, cache TEXT, integrity TEXT, record TEXT, fields TEXT)"
        )
        con.execute("CREATE INDEX IF NOT EXISTS by_key ON records (run_key)")
        con.execute("CREATE INDEX IF NOT EXISTS by_row ON records (row_key)")
        con.execute("CREATE INDEX IF NOT EXISTS by_experiment ON records (experiment)")
    except BaseException:
        con.close()
        raise
    return con


def _with_index(results_dir: Path, fn: Callable[[sqlite3.Connection], Any]) -> Any:
    """fn(connection) on the refreshed index of `results_dir`. Any SQLite error (a corrupt file, corrupt pages, a
    full disk) rebuilds the index from the records once, with one line; if that fails too, an in-memory index
    serves the call."""
    path = Path(results_dir) / INDEX
    error = None
    for target in (path, path, ":memory:"):
        if target == ":memory:" and error is not None:
            print(f"note: the record index {path} is unusable ({error}); reading the records without it",
                  file=sys.stderr)  # fmt: skip
        try:
            con = _open(target)
        except (sqlite3.DatabaseError, OSError) as e:
            error = error or e
            _delete(path)
            continue
        try:
            refresh(con, Path(results_dir))
            out = fn(con)
            if error is not None and target != ":memory:":
                print(f"note: the record index {path} was unusable ({error}); rebuilt it from the records",
                      file=sys.stderr)  # fmt: skip
            return out
        except sqlite3.DatabaseError as e:
            if target == ":memory:":
                raise
            error = error or e
            con.close()
            _delete(path)
        finally:
            con.close()


def _delete(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        try:
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        except OSError:
            pass


def _scan(runs: Path) -> dict[str, str]:
    """{run folder path: signature} for every run folder with a record; the signature changes with the size or mtime
    of any file in the folder (the record and the files its digest covers)."""
    out = {}
    try:
        entries = list(os.scandir(runs))
    except FileNotFoundError:
        return out
    for e in entries:
        if not e.is_dir():
            continue
        parts = []
        try:
            for f in os.scandir(e.path):
                if f.is_file():
                    st = f.stat()
                    parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
        except FileNotFoundError:
            continue
        if not any(p.startswith(RECORD + ":") for p in parts):
            continue
        out[e.path] = hashlib.sha1("|".join(sorted(parts)).encode()).hexdigest()
    return out


def refresh(con: sqlite3.Connection, results_dir: Path) -> int:
    """Bring the index in line with the record files (checking each re-read record against its digest); -> how many
    records were (re)read."""
    on_disk = _scan(Path(results_dir) / "runs")
    known = dict(con.execute("SELECT path, sig FROM records"))
    gone = [p for p in known if p not in on_disk]
    changed = [p for p, sig in on_disk.items() if known.get(p) != sig]
    rows = []
    for p in changed:
        try:
            rec = json.loads(Path(p, RECORD).read_text())
        except (OSError, ValueError) as e:
            print(f"skipping unreadable record {p}: {e}")
            continue
        task = (rec.get("config") or {}).get("task", {})
        exp = rec.get("experiment") or (rec.get("config") or {}).get("experiment_name")
        rows.append(
            (p, on_disk[p], rec.get("run_key"), rec.get("row_key"), rec.get("status"), exp, task.get("name"),
             rec.get("cache"), integrity.unsealed_reason(rec, p), json.dumps(rec), _strict_json(rec))
        )  # fmt: skip
    with con:
        con.executemany("DELETE FROM records WHERE path = ?", [(p,) for p in gone])
        con.executemany("INSERT OR REPLACE INTO records VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
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


def query(
    results_dir: Path | str, where: dict[str, Any] | None = None, verified: bool = False, with_integrity: bool = False
) -> list[dict]:
    """Records under `results_dir` matching `where` (dotted record paths -> value, or a list of allowed values),
    oldest first (by run folder name, as `results.load_records`); each with `_path` set. `verified`: only those
    that match their digests (each other one refused in one line, `results.refuse`). `with_integrity`: each record also
    carries `_integrity`, None or why it does not match its digest."""
    if not (Path(results_dir) / "runs").is_dir():
        return []  # no records here: nothing is made (a mistyped folder must not gain an index, nor be created)
    sql, args = _sql_where(where)

    def select(con):
        return list(con.execute(f"SELECT path, integrity, record FROM records{sql} ORDER BY path", args))

    out = []
    for path, bad, blob in _with_index(Path(results_dir), select):
        rec = json.loads(blob)
        rec["_path"] = path
        if verified and bad is not None:
            refuse(rec, bad)
            continue
        if with_integrity:
            rec["_integrity"] = bad
        out.append(rec)
    return out


def records_of(dirs: Iterable[Path | str], where: dict[str, Any] | None = None, verified: bool = False) -> list[dict]:
    """`query` over several results folders (e.g. results/ and every experiments/<name>/)."""
    return [r for d in dirs for r in query(d, where, verified=verified)]
