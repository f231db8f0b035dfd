"""Run records: one `record.json` per run, written atomically and sealed, and how they are read back.

Layout: `<results_dir>/runs/<run name>/record.json` (+ any artifacts the task wrote beside it). A record holds
`config` (resolved), `config_hash`, `inputs` (content hashes of the data, model, code and library versions the
numbers come from), `run_key` (the resume key over both), `metrics` (flat, e.g. `coqa_turns/f1`), `env` (versions,
git hash, device, host, pid), `timings` and `status`: `running` | `ok` | `failed` (with `error`) | `interrupted`
(with the signal and the progress reached) | `died` (found `running` after its process was gone). Records are
written atomically (temp file + rename) and sealed: `digest` covers the record and the files it names beside it
(`kvq_lab.common.integrity`), and `verify_records` / `pick_completed` refuse one that no longer matches. A run never
reuses another run's folder. What else belongs to a run: its claim on the row (`claims`), the environment it ran in
(`environment`), its W&B copy (`wandb`)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

from kvq_lab.common import integrity

RECORD = "record.json"


def write_json_atomic(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False, default=_jsonable)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; records are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_record(path: Path, record: dict) -> dict:
    """Write a run record atomically, sealed with its digest (the files it names beside it must be written first);
    -> the body as written (JSON types only, with `digest`)."""
    body = json.loads(json.dumps({k: v for k, v in record.items() if k != "_path"}, default=_jsonable))
    body = integrity.seal(body, path.parent)
    write_json_atomic(path, body)
    return body


def overwrite_in_place(path: Path, record: dict) -> None:
    """Last resort when a record cannot be replaced atomically (a full disk has no room for the temporary copy):
    truncate the existing file and write the (smaller) record into the blocks that frees. Sealed like any record."""
    body = json.loads(json.dumps({k: v for k, v in record.items() if k != "_path"}, default=_jsonable))
    data = json.dumps(integrity.seal(body, path.parent), default=_jsonable).encode()
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _jsonable(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    return str(x)


def new_run_dir(results_dir: Path, name: str) -> Path:
    """A fresh folder `<results_dir>/runs/<timestamp>_<name>[_k]`: created exclusively, never shared."""
    runs = results_dir / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    for k in range(1000):
        d = runs / (f"{stamp}_{name}" + (f"_{k}" if k else ""))
        try:
            d.mkdir()
            return d
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a fresh run folder under {runs}")


SIDECAR_MIN_ROWS = 64  # tables with more rows than this leave record.json for a Parquet file beside it


def write_sidecars(run_dir: Path, artifacts: dict, prefix: str = "") -> dict:
    """A copy of `artifacts` in which every large table (a dict with `columns` and `rows`) is written to
    `<run_dir>/<path>.parquet` and replaced by `{"file", "columns", "n_rows"}`: record.json stays small (a probe
    record's per-head table is thousands of rows). `read_table` reads either form."""
    out = {}
    for k, v in artifacts.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and set(v) == {"columns", "rows"} and len(v["rows"]) > SIDECAR_MIN_ROWS:
            import pandas as pd

            fname = f"{name}.parquet"
            pd.DataFrame(v["rows"], columns=v["columns"]).to_parquet(Path(run_dir) / fname, index=False)
            out[k] = {"file": fname, "columns": list(v["columns"]), "n_rows": len(v["rows"])}
        elif isinstance(v, dict):
            out[k] = write_sidecars(run_dir, v, prefix=f"{name}.")
        else:
            out[k] = v
    return out


def read_table(rec: dict, *keys: str) -> dict:
    """The table at `rec["artifacts"][keys...]` as `{"columns", "rows"}`, inline or from its Parquet sidecar."""
    t = rec["artifacts"]
    for k in keys:
        t = t[k]
    if "file" not in t:
        return t
    import pandas as pd

    df = pd.read_parquet(Path(rec["_path"]) / t["file"])
    return {"columns": list(df.columns), "rows": df.astype(object).values.tolist()}


def load_records(results_dir: Path, verified: bool = False) -> list[dict]:
    """Every record under `<results_dir>/runs`, oldest first (by the folder's timestamp, then, within one second, by
    the record's `started`); unreadable files are skipped with a note. `verified`: only records that match their
    digest (the others are named in one line each, `verify_records`)."""
    out = []
    for p in sorted((Path(results_dir) / "runs").glob(f"*/{RECORD}")):
        try:
            rec = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"skipping unreadable record {p}: {e}")
            continue
        rec["_path"] = str(p.parent)
        out.append(rec)
    # folder names are `<second made>_<name>` (`new_run_dir`): two runs of one second sort by name there
    out.sort(key=lambda r: (Path(r["_path"]).name.split("_", 1)[0], str(r.get("started", ""))))
    return verify_records(out) if verified else out


def verify_records(records: list[dict], say=None) -> list[dict]:
    """The records that match their digests; each other one is refused in one line naming its file (`say`:
    where the line goes, default stderr)."""
    ok = []
    for r in records:
        reason = r["_integrity"] if "_integrity" in r else integrity.unsealed_reason(r)
        if reason is None:
            ok.append(r)
        else:
            refuse(r, reason, say)
    return ok


def refuse(rec: dict, reason: str, say=None) -> None:
    line = f"refusing record {Path(rec['_path']) / RECORD}: {reason}"
    if reason == "no digest":
        line += " (made before kvq_lab sealed its records, or its digest was removed); rerun it"
    (say or (lambda m: print(m, file=sys.stderr)))(line)


def is_dirty(rec: dict) -> bool:
    return str(rec.get("env", {}).get("git", "")).endswith("-dirty")


def pick_completed(records: list[dict], allow_dirty: bool = False) -> tuple[dict | None, list[dict]]:
    """Among the records of one run key (oldest first): -> (the newest successful one that matches its digest, or
    None; the successful ones passed over because they were made from a dirty git tree and `allow_dirty` is false).
    A record that does not match its digest is refused in one line and never reused."""
    ok = verify_records([r for r in records if r.get("status") == "ok"], say=print)
    usable = [r for r in ok if allow_dirty or not is_dirty(r)]
    return (usable[-1] if usable else None), [r for r in ok if r not in usable]


def mark_died(rec: dict) -> bool:
    """A `running` record whose process is gone (its row's claim was free): say so, keep everything else (a record
    that does not match its digest is left as it is: it is not ours to reseal). -> whether it was marked."""
    path = Path(rec["_path"]) / RECORD
    if integrity.unsealed_reason(rec) is not None:
        return False
    body = {k: v for k, v in rec.items() if not k.startswith("_")}
    body.update(status="died", died_noticed=datetime.now().isoformat(timespec="seconds"))
    try:
        write_record(path, body)
        rec["status"] = "died"
        return True
    except OSError:
        return False  # a read-only results folder: the record stays as it was, the row reruns all the same
