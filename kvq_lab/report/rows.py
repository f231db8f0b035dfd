"""Run records -> table rows: one row per cache setting of an experiment, one cell per task measured.

One row per cache setting (the record's structured `cache_config`, see `cache_fields`) of an experiment
(`record["experiment"]` / `config.experiment_name`). For each (row, task) the record covering the most documents
wins (a full run over a `limit=` one), the newest among equals. A row with no successful record shows why:
`failed: <error>` or `incomplete` (a run that was killed or is running). Error-probe metrics (`probe/...`, from
`task=probe` or `probe=true` runs) are joined by cache and model. What a task's columns are comes from the task
itself (`Task.headline`), what a probe's columns are from the error definitions (`ErrorMetric.table`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from kvq_lab.cache.modes import MODES
from kvq_lab.common.metric import Metric
from kvq_lab.common.spellings import current
from kvq_lab.plugins import TASKS
from kvq_lab.probes.metrics import ERRORS
from kvq_lab.report.anchors import DEFAULT_MODEL, paper_values, row_name
from kvq_lab.report.study import model_of, read, samples

PROBE_TASK = "probe"
# the probe quantities experiment tables show (their decode-row errors), by short name: KIVI Table 2's quantities
PROBE_TABLE_QUANTITIES = {
    "key": "K",
    "value": "V",
    "attn_score_decode": "score",
    "attn_out_decode": "attn-out",
}


def task_metrics(task: str) -> tuple[Metric, ...]:
    """The columns a task has in tables: its headline metrics (none for a task that declares none)."""
    t = TASKS.get(task, None)
    return t.headline if t is not None else ()


def probe_metrics() -> list[tuple[str, str]]:
    """(record key, column title) of the probe columns: every error definition with a table title, for each
    quantity in PROBE_TABLE_QUANTITIES (mean over layers, heads and prompts), e.g. `probe/key/rel_fro/mean`, `K err`."""
    return [
        (f"probe/{q}/{m.name}/mean", f"{short} {m.table}")
        for m in ERRORS.values()
        if m.table
        for q, short in PROBE_TABLE_QUANTITIES.items()
    ]


@dataclass
class Cell:
    """One (row, task): the chosen record's metrics, or why there is none."""

    status: str  # ok | failed | incomplete
    metrics: dict = field(default_factory=dict)
    stderr: dict = field(default_factory=dict)  # metric -> standard error over documents (when samples exist)
    limit: int | None = None
    n: int | None = None
    error: str = ""
    path: str = ""


@dataclass
class Row:
    cache: str  # the cache label, for display
    name: str
    config: dict  # the chosen record's run config
    fields: dict = field(default_factory=dict)  # cache_fields of the row
    cells: dict[str, Cell] = field(default_factory=dict)  # task -> cell
    probes: dict = field(default_factory=dict)
    paper: dict = field(default_factory=dict)


def cache_fields(rec: dict) -> dict:
    """The cache a record measured, as flat fields (key_bits, value_bits, key_axis, value_axis, group_size, mode,
    exact_window, sink_tokens, rope, key_format, value_format, key_transform, value_transform): from the
    structured `cache_config` the runner records, or, for records made before it existed, from the run config's
    knobs. Rows, their names and the paper column are built from these fields, never from the label string."""
    cc = rec.get("cache_config")
    if cc:
        cc = current(cc)  # a record written before a knob's rename, in today's spellings
        k, v = cc["key"], cc["value"]
        return {
            "key_bits": k["bits"], "value_bits": v["bits"], "key_axis": k["axis"], "value_axis": v["axis"],
            "group_size": k["group_size"], "mode": cc["mode"], "exact_window": cc["exact_window"],
            "sink_tokens": cc["sink_tokens"], "rope": cc.get("rope", "post"),
            "key_format": k.get("format", "int"), "value_format": v.get("format", "int"),
            "key_transform": list(cc.get("key_transform") or []),
            "value_transform": list(cc.get("value_transform") or []),
        }  # fmt: skip
    c = current(rec.get("config", {}))
    kb = c.get("bits") if c.get("bits") is not None else c.get("key_bits", 16)
    vb = c.get("bits") if c.get("bits") is not None else c.get("value_bits", 16)
    return {
        "key_bits": kb, "value_bits": vb, "key_axis": c.get("key_axis", "token"),
        "value_axis": c.get("value_axis", "token"), "group_size": c.get("group_size", 32),
        "mode": c.get("mode", "simulated"), "exact_window": c.get("exact_window", 0),
        "sink_tokens": c.get("sink_tokens", 0), "rope": c.get("rope", "post"), "key_format": "int",
        "value_format": "int", "key_transform": ["rope_pre"] if c.get("rope") == "pre" else [], "value_transform": [],
    }  # fmt: skip


def _row_key(rec: dict) -> str:
    """One row per cache: the fields above (16-bit tensors ignore their axis and group size, as the label does)."""
    f = cache_fields(rec)
    for t in ("key", "value"):
        if f[f"{t}_bits"] >= 16:  # an identity quantizer: axis, format and transforms change nothing
            f[f"{t}_axis"] = f[f"{t}_format"] = None
            f[f"{t}_transform"] = []
    if f["key_bits"] >= 16 and f["value_bits"] >= 16:
        f["group_size"] = None
    return json.dumps(f, sort_keys=True)


def _experiment(rec: dict) -> str | None:
    return rec.get("experiment") or rec.get("config", {}).get("experiment_name")


def _task(rec: dict) -> str:
    return rec.get("config", {}).get("task", {}).get("name", "?")


def _model(rec: dict) -> str:
    return model_of(rec)


def _coverage(rec: dict) -> float:
    lim = rec.get("config", {}).get("limit")
    return math.inf if lim is None else float(lim)


def mean_se(x: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample standard deviation / sqrt(n)); the error is nan for n < 2."""
    m = sum(x) / len(x)
    se = math.sqrt(sum((v - m) ** 2 for v in x) / (len(x) - 1) / len(x)) if len(x) > 1 else math.nan
    return m, se


def block_paired(a: list[float], b: list[float], blocks: int = 16) -> tuple[float, float, int]:
    """Per-position values of two runs (e.g. KL over decode positions) -> (mean of b - a, its standard error from
    `blocks` blocks of consecutive positions, positions): neighbouring positions correlate, so blocks, not positions,
    are the independent samples."""
    d = [y - x for x, y in zip(a, b, strict=True)]
    n = len(d) // blocks
    if n == 0:
        raise ValueError(f"{len(d)} positions cannot make {blocks} blocks")
    means = [sum(d[i * n : (i + 1) * n]) / n for i in range(blocks)]
    m = sum(means) / blocks
    se = math.sqrt(sum((v - m) ** 2 for v in means) / (blocks - 1) / blocks)
    return sum(d) / len(d), se, len(d)


def paired_difference(a: dict, b: dict) -> tuple[float, float, int]:
    """Per-document scores of two runs (doc_id -> score) -> (mean of b - a over the documents both scored, its
    standard error, how many). Pairing cancels the spread between documents (easy and hard questions), which
    dominates an unpaired comparison of two means."""
    ids = sorted(set(a) & set(b))
    if not ids:
        raise ValueError("paired_difference: the two runs share no document (doc_id); rerun them with the same limit")
    m, se = mean_se([b[i] - a[i] for i in ids])
    return m, se, len(ids)


def _stderr(run_dir: str, metrics: tuple[Metric, ...]) -> dict[str, float]:
    """Standard error (in %) of per-document scores from samples.json, for the metrics that have one."""
    if not (Path(run_dir) / "samples.json").exists():
        return {}
    try:
        docs = samples({"_path": run_dir})
    except (OSError, json.JSONDecodeError):
        return {}
    out = {}
    for m in metrics:
        fld = m.per_sample
        vals = [float(s[fld]) for s in docs if fld and isinstance(s.get(fld), (int, float))]
        if len(vals) > 1:
            out[m.key] = 100 * mean_se(vals)[1]
    return out


def _sort_key(row: Row):
    c = row.fields

    def bits(k):
        return c.get(k, 16)

    return (
        not getattr(MODES.get(c.get("mode")), "fake_quant", False),  # fake-quant rows first
        c.get("exact_window", 0),
        c.get("group_size", 32),
        -bits("key_bits"),
        -bits("value_bits"),
        c.get("value_axis") != "token",
        c.get("key_axis") != "channel",
        c.get("rope") == "pre",
        row.cache,
    )


def build_rows(
    records: list[dict],
    experiment: str,
    limit: int | None = None,
    paper_model: str = DEFAULT_MODEL,
    probe_records: list[dict] | None = None,
    model: str | None = None,
) -> list[Row]:
    """Rows of `experiment` from `records` (see the module docstring). `limit`: only runs with that limit; `model`:
    only runs of that model (`model.path`, e.g. gemma3-270m); records of several models need one named."""
    recs = [r for r in records if _experiment(r) == experiment and _task(r) != PROBE_TASK]
    if model is not None:
        recs = [r for r in recs if _model(r) == model]
    models = sorted({_model(r) for r in recs})
    if len(models) > 1:
        raise ValueError(f"experiment {experiment} has records of {len(models)} models ({', '.join(models)}): "
                         "name one (make_table.py --model <name>)")  # fmt: skip
    if limit is not None:
        recs = [r for r in recs if r.get("config", {}).get("limit") == limit]
    rows: dict[str, Row] = {}
    for r in recs:
        f = cache_fields(r)
        rows.setdefault(_row_key(r), Row(r.get("cache") or "?", row_name(f), r["config"], f))
    for key, row in rows.items():
        mine = [r for r in recs if _row_key(r) == key]
        for task in dict.fromkeys(_task(r) for r in mine):
            of_task = [r for r in mine if _task(r) == task]  # oldest first (load_records sorts by folder name)
            ok = [r for r in of_task if r.get("status") == "ok"]
            if ok:
                best = max(enumerate(ok), key=lambda ir: (_coverage(ir[1]), ir[0]))[1]
                n = next((v for k, v in best["metrics"].items() if k.endswith("/n") or k.endswith("/n_tokens")), None)
                row.cells[task] = Cell(
                    "ok",
                    best["metrics"],
                    _stderr(best["_path"], task_metrics(task)),
                    best["config"].get("limit"),
                    n,
                    path=best["_path"],
                )
                row.config = best["config"]
            else:
                last = of_task[-1]
                status = "failed" if last.get("status") == "failed" else "incomplete"
                row.cells[task] = Cell(
                    status,
                    error=str(last.get("error", "")),
                    path=last["_path"],
                    limit=last.get("config", {}).get("limit"),
                )
        row.paper = paper_values(row.fields, paper_model)
    # probes: a successful record with probe metrics, same cache and model. A record of this experiment wins (its
    # rows were probed alike), then the one over the most prompts (as a task's fullest run does), then the newest.
    pool = probe_records if probe_records is not None else records
    for key, row in rows.items():
        model = _model({"config": row.config})
        best = ((-1, -1.0), None)
        for r in pool:
            if r.get("status") == "ok" and _row_key(r) == key and _model(r) == model:
                got = {k: v for k, v in r.get("metrics", {}).items() if k.startswith("probe/")}
                rank = (int(_experiment(r) == experiment), float(got.get("probe/n_prompts", 0)))
                if got and rank >= best[0]:
                    best = (rank, got)
        if best[1]:
            row.probes = best[1]
    return sorted(rows.values(), key=_sort_key)


def probe_folders(results_dir: str | Path) -> list[Path]:
    """Where probe records for a table are looked for: the table's own folder, `results/` and every saved study
    (`experiments/<name>/`: error_geometry's probe runs serve every axis table)."""
    dirs = [
        Path(results_dir),
        Path("results"),
        *sorted(p for p in Path("experiments").glob("*") if (p / "runs").is_dir()),
    ]
    return list(dict.fromkeys(d.resolve() for d in dirs if (d / "runs").is_dir()))


def load_rows(
    results_dir: str | Path,
    experiment: str,
    limit: int | None = None,
    paper_model: str = DEFAULT_MODEL,
    model: str | None = None,
) -> list[Row]:
    # the studies' one reader (kvq_lab.report.study): a record that does not match its digest is named and left out.
    # A frontier search's screens are probes of its own protocol (frontier.screen: fewer prompts and tokens), never
    # joined into a study's table
    probes = [
        r
        for d in probe_folders(results_dir)
        for r in read(d, None, status=None)
        if any(k.startswith("probe/") for k in r.get("metrics", {}))
        and not str(r.get("experiment") or "").startswith("frontier")
    ]
    if not (Path(results_dir) / "runs").is_dir():
        return []
    rows = read(results_dir, None if model is None else (model,), status=None)
    return build_rows(rows, experiment, limit=limit, paper_model=paper_model, probe_records=probes, model=model)


def tasks_of(rows: list[Row]) -> list[str]:
    return list(dict.fromkeys(t for row in rows for t in row.cells))


def row_bits(row: Row) -> float | None:
    """Mean stored bits per element of a row's key and value quantizers (codes + per-group parameters): the
    run's `cache/bits` metric, or for older records the same arithmetic from the row's fields."""
    for c in row.cells.values():
        if "cache/bits" in c.metrics:
            return c.metrics["cache/bits"]
    from kvq_lab.quant.formats import bits_per_element
    from kvq_lab.quant.reference import code_format
    from kvq_lab.quant.spec import QuantSpec

    f, out = row.fields, []
    for t in ("key", "value"):
        if f.get(f"{t}_bits", 16) >= 16:
            out.append(16.0)
            continue
        try:
            spec = QuantSpec(f[f"{t}_bits"], f["group_size"], f[f"{t}_axis"], format=f.get(f"{t}_format") or "int")
            out.append(bits_per_element(code_format(spec), spec.group_size, spec.axis))
        except (ValueError, KeyError):
            return None
    return sum(out) / 2
