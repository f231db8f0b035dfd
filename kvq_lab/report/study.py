"""The one reader of every study's records: what experiments/<study>/ tables and figures are made from.

    recs = read("experiments/policies", models=("smollm2-135m", "gemma3-270m"))

`read` takes the records under `<folder>/runs` through the record index (`kvq_lab.records.index.query` with
`verified=True`, as compare.py and make_table.py read them): a record that no longer matches its digest (an edited
metric, a changed samples.json) is named in one line on stderr and left out, never shown. Then only the records of
the study's models (`model_of`: `config.model.path`, else `config.model.name`, e.g. `smollm2-135m`), by default only
completed ones, oldest first: by run folder (`<second made>_<name>`), then by `started` within one second, so "the
newest record of a row wins" means the same in every study. A study names its models: a folder that holds two
models' runs (the KIVI axis table: SmolLM2 and Gemma) never mixes them into one row.

What a record's numbers rest on beside it is read here too (`samples`, `per_doc`): the files its digest covers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path
from typing import Any

from kvq_lab.records.index import query
from kvq_lab.records.record import is_dirty


def model_of(rec: dict) -> str:
    """The model a record measured, as runs name it (`model.path`, else `model.name`)."""
    m = (rec.get("config") or {}).get("model") or {}
    return str(m.get("path") or m.get("name"))


def task_of(rec: dict) -> str | None:
    return ((rec.get("config") or {}).get("task") or {}).get("name")


def _order(rec: dict) -> tuple[str, str]:
    return Path(rec["_path"]).name.split("_", 1)[0], str(rec.get("started", ""))


def read(
    folder: str | Path,
    models: Iterable[str] | None,
    *,
    status: str | None = "ok",
    where: dict[str, Any] | None = None,
    clean: bool = False,
) -> list[dict]:
    """The verified records under `<folder>/runs` of `models`, oldest first (module docstring). `models=None`: every
    model's, only for a caller that refuses a mix itself (make_table's rows name the model or raise). `status`: only
    records with it (None: every status, e.g. to show a failed row); `where`: the index's selection (dotted record
    paths -> value, `kvq_lab.records.index.query`); `clean`: leave out records made from a git tree with uncommitted
    changes. Raises FileNotFoundError for a folder without runs/ (a mistyped study path, not an empty study)."""
    if models is not None:
        models = {models} if isinstance(models, str) else set(models)
        if not models:
            raise ValueError("read: name the study's model(s), e.g. models=('smollm2-135m',)")
    runs = Path(folder) / "runs"
    if not runs.is_dir():
        raise FileNotFoundError(f"{folder}: no runs/ folder here, so no records to read (a mistyped study folder?)")
    recs = [
        r
        for r in query(Path(folder), where, verified=True)
        if (models is None or model_of(r) in models)
        and (status is None or r.get("status") == status)
        and not (clean and is_dirty(r))
    ]
    return sorted(recs, key=_order)


def newest(records: Iterable[dict], key: Callable[[dict], Hashable | None]) -> dict:
    """key -> the newest record with that key (records oldest first, as `read` gives them); a None key is skipped."""
    out: dict = {}
    for r in records:
        k = key(r)
        if k is not None:
            out[k] = r
    return out


def samples(rec: dict) -> list[dict]:
    """The per-document samples of a record read by `read` (samples.json beside it, covered by its digest)."""
    return json.loads((Path(rec["_path"]) / (rec.get("samples_file") or "samples.json")).read_text())


def per_doc(rec: dict, field: str, scale: float = 1.0) -> dict[int, float]:
    """doc_id -> `field` of each scored document (e.g. `f1`, 0..1; `scale=100` for %), in the samples' order."""
    return {int(s["doc_id"]): scale * float(s[field]) for s in samples(rec)}


def bench_runs(folder: str | Path) -> list[tuple[str, dict]]:
    """(file name, run) of every benchmark run kept under `<folder>/records/*.json` (scripts/bench_throughput.py and
    bench_cache.py write them with `--json`), by file name. Unlike run records these carry no digest: the
    benchmarks write them unsealed, and git's history is what guards the committed ones."""
    return [(p.name, json.loads(p.read_text())) for p in sorted((Path(folder) / "records").glob("*.json"))]
