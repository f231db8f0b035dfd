"""Experiment tables and figures from run records: ours beside the paper's (scripts/make_table.py, notebooks/).

One row per cache setting (the record's structured `cache_config`, see `cache_fields`) of an experiment
(`record["experiment"]` / `config.experiment_name`); one column group per task measured. For each (row, task)
the record covering the most documents wins (a full run over a `limit=` one), the newest among equals. A row
with no successful record shows why: `failed: <error>` or `incomplete` (a run that was killed or is running).
Error-probe columns (`probe/...` metrics, from `task=probe` or `probe=true` runs) are joined by cache label and
model; the paper column comes from `kvq_lab.report.anchors`. The label (e.g. `K2b-C32_V2b-T32_sim`) is only displayed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from kvq_lab.records.index import query
from kvq_lab.report.anchors import BENCHMARKS, DEFAULT_MODEL, SOURCE, TASK_TO_BENCHMARK, paper_values, row_name

# task -> [(metric, column title, per-sample field for a standard error)]
TASK_METRICS: dict[str, list[tuple[str, str, str | None]]] = {
    "coqa_turns": [("coqa_turns/em", "CoQA-turns EM", "em"), ("coqa_turns/f1", "CoQA-turns F1", "f1")],
    "coqa": [("coqa/em", "CoQA EM", "em"), ("coqa/f1", "CoQA F1", "f1")],
    "gsm8k": [
        ("gsm8k/exact_match_strict-match", "GSM8K strict", None),
        ("gsm8k/exact_match_flexible-extract", "GSM8K flexible", None),
    ],
    "truthfulqa_gen": [("truthfulqa_gen/bleu_max", "TruthfulQA BLEU", None)],
    "ppl": [("ppl/ppl", "decode ppl", None)],
}
# error probes (relative Frobenius error, mean over layers, heads, prompts): KIVI Table 2's quantities
PROBE_METRICS = [
    ("probe/key/rel_fro/mean", "K err"),
    ("probe/value/rel_fro/mean", "V err"),
    ("probe/attn_score_decode/rel_fro/mean", "score err"),
    ("probe/attn_out_decode/rel_fro/mean", "attn-out err"),
]
PROBE_TASK = "probe"


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
    residual_length, sink_tokens, rope, key_format, value_format, key_transform, value_transform): from the
    structured `cache_config` the runner records, or, for records made before it existed, from the run config's
    knobs. Rows, their names and the paper column are built from these fields, never from the label string."""
    cc = rec.get("cache_config")
    if cc:
        k, v = cc["key"], cc["value"]
        return {
            "key_bits": k["bits"], "value_bits": v["bits"], "key_axis": k["axis"], "value_axis": v["axis"],
            "group_size": k["group_size"], "mode": cc["mode"], "residual_length": cc["residual_length"],
            "sink_tokens": cc["sink_tokens"], "rope": cc.get("rope", "post"),
            "key_format": k.get("format", "int"), "value_format": v.get("format", "int"),
            "key_transform": list(cc.get("key_transform") or []),
            "value_transform": list(cc.get("value_transform") or []),
        }  # fmt: skip
    c = rec.get("config", {})
    kb = c.get("bits") if c.get("bits") is not None else c.get("key_bits", 16)
    vb = c.get("bits") if c.get("bits") is not None else c.get("value_bits", 16)
    return {
        "key_bits": kb, "value_bits": vb, "key_axis": c.get("key_axis", "token"),
        "value_axis": c.get("value_axis", "token"), "group_size": c.get("group_size", 32),
        "mode": c.get("mode", "simulated"), "residual_length": c.get("residual_length", 0),
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
    m = rec.get("config", {}).get("model", {})
    return str(m.get("path") or m.get("name"))


def _coverage(rec: dict) -> float:
    lim = rec.get("config", {}).get("limit")
    return math.inf if lim is None else float(lim)


def mean_se(x: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample standard deviation / sqrt(n)); the error is nan for n < 2."""
    m = sum(x) / len(x)
    se = math.sqrt(sum((v - m) ** 2 for v in x) / (len(x) - 1) / len(x)) if len(x) > 1 else math.nan
    return m, se


def paired_difference(a: dict, b: dict) -> tuple[float, float, int]:
    """Per-document scores of two runs (doc_id -> score) -> (mean of b - a over the documents both scored, its
    standard error, how many). Pairing cancels the spread between documents (easy and hard questions), which
    dominates an unpaired comparison of two means."""
    ids = sorted(set(a) & set(b))
    if not ids:
        raise ValueError("paired_difference: the two runs share no document (doc_id); rerun them with the same limit")
    m, se = mean_se([b[i] - a[i] for i in ids])
    return m, se, len(ids)


def _stderr(run_dir: str, metrics: list[tuple[str, str, str | None]]) -> dict[str, float]:
    """Standard error (in %) of per-document scores from samples.json, for the metrics that have one."""
    p = Path(run_dir) / "samples.json"
    if not p.exists():
        return {}
    try:
        samples = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    out = {}
    for key, _, fld in metrics:
        vals = [float(s[fld]) for s in samples if fld and isinstance(s.get(fld), (int, float))]
        if len(vals) > 1:
            out[key] = 100 * mean_se(vals)[1]
    return out


def _sort_key(row: Row):
    c = row.fields

    def bits(k):
        return c.get(k, 16)

    return (
        c.get("mode") != "simulated",
        c.get("residual_length", 0),
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
) -> list[Row]:
    """Rows of `experiment` from `records` (see the module docstring). `limit`: only runs with that limit."""
    recs = [r for r in records if _experiment(r) == experiment and _task(r) != PROBE_TASK]
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
                specs = TASK_METRICS.get(task, [])
                n = next((v for k, v in best["metrics"].items() if k.endswith("/n") or k.endswith("/n_tokens")), None)
                row.cells[task] = Cell(
                    "ok",
                    best["metrics"],
                    _stderr(best["_path"], specs),
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
    results_dir: str | Path, experiment: str, limit: int | None = None, paper_model: str = DEFAULT_MODEL
) -> list[Row]:
    probes = [
        r
        for d in probe_folders(results_dir)
        for r in query(d, verified=True)
        if any(k.startswith("probe/") for k in r.get("metrics", {}))
    ]
    rows = query(Path(results_dir), verified=True)  # a record that does not match its digest is named and left out
    return build_rows(rows, experiment, limit=limit, paper_model=paper_model, probe_records=probes)


def _fmt(x, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return str(x)
    if isinstance(x, float) and abs(x) >= 1000:
        return f"{x:.4g}"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


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


def markdown_table(rows: list[Row], paper_model: str = DEFAULT_MODEL) -> str:
    """The table: row name, cache label, stored bits per element, our metrics (± standard error over documents),
    the paper's column for each benchmark we measured, error probes when any row has them."""
    tasks = tasks_of(rows)
    benches = [b for b in BENCHMARKS if any(TASK_TO_BENCHMARK.get(t) == b for t in tasks)]
    probe_cols = [(k, t) for k, t in PROBE_METRICS if any(k in row.probes for row in rows)]
    head = ["setting", "cache", "bits/elem"]
    for t in tasks:
        head += [title for _, title, _ in TASK_METRICS.get(t, [])] or [t]
        head.append(f"{t} n")
    head += [f"paper {b} ({paper_model})" for b in benches]
    head += [title for _, title in probe_cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row.name, f"`{row.cache}`", _fmt(row_bits(row))]
        for t in tasks:
            specs = TASK_METRICS.get(t, []) or [(None, t, None)]
            c = row.cells.get(t)
            if c is None:
                cells += ["-"] * len(specs) + ["-"]
            elif c.status != "ok":
                why = c.error.splitlines()[0][:80] if c.error else "no record finished (killed or still running)"
                cells += [f"**{c.status}**: {why}"] + ["-"] * (len(specs) - 1) + ["-"]
            else:
                for key, _, _ in specs:
                    v = c.metrics.get(key)
                    se = c.stderr.get(key)
                    cells.append(_fmt(v) + (f" ± {se:.1f}" if se is not None else ""))
                cells.append(_fmt(c.n) + ("" if c.limit is None else f" (limit={c.limit})"))
        cells += [_fmt(row.paper.get(b)) for b in benches]
        cells += [_fmt(row.probes.get(k), 3) for k, _ in probe_cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bar_chart(rows: list[Row], path: str | Path, title: str = "", paper_model: str = DEFAULT_MODEL) -> Path:
    """PNG: one panel per task (its first metric per row), the paper's value as a hatched bar beside ours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = tasks_of(rows) or ["(none)"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(max(6, 1.3 * len(rows)) * len(tasks), 4.5), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        # the first metric of each task: the one the paper's column reports (CoQA: exact match)
        key, title_m, _ = (TASK_METRICS.get(task) or [(None, task, None)])[0]
        bench = TASK_TO_BENCHMARK.get(task)
        xs = range(len(rows))
        ours = [
            row.cells[task].metrics.get(key, math.nan)
            if task in row.cells and row.cells[task].status == "ok"
            else math.nan
            for row in rows
        ]
        errs = [row.cells[task].stderr.get(key, 0.0) if task in row.cells else 0.0 for row in rows]
        w = 0.4 if bench else 0.8
        ax.bar([x - (w / 2 if bench else 0) for x in xs], ours, w, yerr=errs, capsize=3, label="ours")
        if bench:
            paper = [row.paper.get(bench, math.nan) for row in rows]
            ax.bar([x + w / 2 for x in xs], paper, w, hatch="//", alpha=0.6, label=f"paper {bench} ({paper_model})")
        for x, v, row in zip(xs, ours, rows, strict=True):
            if math.isnan(v):
                status = row.cells[task].status if task in row.cells else "missing"
                ax.text(x, 0, status, rotation=90, ha="center", va="bottom", fontsize=8)
        if key == "ppl/ppl":
            ax.set_yscale("log")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([row.name for row in rows], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(title_m)
        ax.set_title(task)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def describe(rows: list[Row], experiment: str, paper_model: str = DEFAULT_MODEL) -> str:
    """A header for the table: model, tasks, limits, and where the paper numbers come from."""
    models = sorted({_model({"config": r.config}) for r in rows})
    limits = sorted({str(c.limit) for r in rows for c in r.cells.values()})
    return (
        f"Experiment `{experiment}`: {len(rows)} settings; model {', '.join(models) or '-'}; tasks "
        f"{', '.join(tasks_of(rows)) or '-'}; limit {', '.join(limits) or '-'} (None = all documents). "
        f"Paper column: {SOURCE}, {paper_model}. ± = standard error over documents."
    )


def make_report(
    results_dir: str | Path,
    experiment: str,
    out_dir: str | Path | None = None,
    limit: int | None = None,
    paper_model: str = DEFAULT_MODEL,
) -> tuple[str, Path | None]:
    """-> (markdown, PNG path or None). Writes table.md and <experiment>.png under out_dir when given."""
    rows = load_rows(results_dir, experiment, limit=limit, paper_model=paper_model)
    if not rows:
        return f"no records for experiment `{experiment}` under {results_dir}/runs", None
    md = describe(rows, experiment, paper_model) + "\n\n" + markdown_table(rows, paper_model)
    png = None
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "table.md").write_text(md + "\n")
        png = bar_chart(rows, out / f"{experiment}.png", title=experiment, paper_model=paper_model)
    return md, png


def to_frame(rows: list[Row]):
    """A pandas DataFrame of the rows (one line per setting; our metrics, paper values, probes) for notebooks."""
    import pandas as pd

    out = []
    for row in rows:
        d = {"setting": row.name, "cache": row.cache}
        for task, c in row.cells.items():
            d[f"{task} status"] = c.status
            for key, _, _ in TASK_METRICS.get(task, []):
                d[key] = c.metrics.get(key)
                if key in c.stderr:
                    d[f"{key} se"] = c.stderr[key]
        d.update({f"paper {b}": v for b, v in row.paper.items()})
        d.update({k: row.probes[k] for k, _ in PROBE_METRICS if k in row.probes})
        out.append(d)
    return pd.DataFrame(out)
