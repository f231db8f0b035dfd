"""Experiment tables and figures from run records: ours beside the paper's (scripts/make_table.py, notebooks/).

Rows and cells come from `kvq_lab.report.rows` (one row per cache setting, the fullest run per task); here they
become a markdown table, a bar chart and a DataFrame. The paper column comes from `kvq_lab.report.anchors`; a task's
columns are its headline metrics (`Task.headline`). The label (e.g. `K2b-C32_V2b-T32_sim`) is only displayed.
"""

from __future__ import annotations

import math
from pathlib import Path

from kvq_lab.report.anchors import BENCHMARKS, DEFAULT_MODEL, SOURCE, TASK_TO_BENCHMARK
from kvq_lab.report.rows import Row, _model, load_rows, probe_metrics, row_bits, task_metrics, tasks_of


def _fmt(x, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return str(x)
    if isinstance(x, float) and abs(x) >= 1000:
        return f"{x:.4g}"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def markdown_table(rows: list[Row], paper_model: str = DEFAULT_MODEL) -> str:
    """The table: row name, cache label, stored bits per element, our metrics (± standard error over documents),
    the paper's column for each benchmark we measured, error probes when any row has them."""
    tasks = tasks_of(rows)
    benches = [b for b in BENCHMARKS if any(TASK_TO_BENCHMARK.get(t) == b for t in tasks)]
    probe_cols = [(k, t) for k, t in probe_metrics() if any(k in row.probes for row in rows)]
    head = ["setting", "cache", "bits/elem"]
    for t in tasks:
        head += [m.title for m in task_metrics(t)] or [t]
        head.append(f"{t} n")
    head += [f"paper {b} ({paper_model})" for b in benches]
    head += [title for _, title in probe_cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row.name, f"`{row.cache}`", _fmt(row_bits(row))]
        for t in tasks:
            specs = [m.key for m in task_metrics(t)] or [None]
            c = row.cells.get(t)
            if c is None:
                cells += ["-"] * len(specs) + ["-"]
            elif c.status != "ok":
                why = c.error.splitlines()[0][:80] if c.error else "no record finished (killed or still running)"
                cells += [f"**{c.status}**: {why}"] + ["-"] * (len(specs) - 1) + ["-"]
            else:
                for key in specs:
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
        first = next(iter(task_metrics(task)), None)
        key, title_m = (first.key, first.title) if first is not None else (None, task)
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
    model: str | None = None,
) -> tuple[str, Path | None]:
    """-> (markdown, PNG path or None). Writes table.md and <experiment>.png under out_dir when given."""
    rows = load_rows(results_dir, experiment, limit=limit, paper_model=paper_model, model=model)
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
            for key in (m.key for m in task_metrics(task)):
                d[key] = c.metrics.get(key)
                if key in c.stderr:
                    d[f"{key} se"] = c.stderr[key]
        d.update({f"paper {b}": v for b, v in row.paper.items()})
        d.update({k: row.probes[k] for k, _ in probe_metrics() if k in row.probes})
        out.append(d)
    return pd.DataFrame(out)
