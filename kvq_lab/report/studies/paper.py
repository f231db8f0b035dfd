"""The generic study: one row per cache setting, ours beside the paper's numbers (`kvq_lab.report.tables`), for the
studies whose folder name is their experiment name (bits, formats, group_size, kivi_residual, rope_order).

Rows: for each task the run covering the most documents (newest among equals); failed or unfinished rows say so.
Records through `kvq_lab.report.study.read` (`kvq_lab.report.rows.load_rows`), each checked against its digest.
Writes table.md and <study>.png. scripts/make_table.py runs the same on any results folder (--results-dir, --limit).
"""

from __future__ import annotations

from pathlib import Path

from kvq_lab.report.anchors import DEFAULT_MODEL
from kvq_lab.report.rows import Row, load_rows
from kvq_lab.report.tables import bar_chart, describe, markdown_table, to_frame

MODELS = None  # every model's records; a row that mixes two is refused by load_rows (name one: kivi_axis_table)


def study_rows(folder: Path, model: str | None = None) -> tuple[str, list[Row]]:
    """(experiment name, its rows) of the records under folder/runs, of `model` (None: the only one)."""
    experiment = Path(folder).name
    rows = load_rows(folder, experiment, model=model)
    if not rows:
        raise FileNotFoundError(f"no records for experiment `{experiment}` under {folder}/runs")
    return experiment, rows


def table(experiment: str, rows: list[Row]) -> str:
    return describe(rows, experiment, DEFAULT_MODEL) + "\n\n" + markdown_table(rows, DEFAULT_MODEL) + "\n"


def records(folder: Path) -> tuple[str, list[Row]]:
    return study_rows(folder)


def tables(recs: tuple[str, list[Row]]) -> dict[str, str]:
    return {"table.md": table(*recs)}


def figure(recs: tuple[str, list[Row]], folder: Path) -> None:
    experiment, rows = recs
    bar_chart(rows, Path(folder) / f"{experiment}.png", title=experiment)


def rows(recs: tuple[str, list[Row]]):
    """The table's rows as a DataFrame (`kvq_lab.report.tables.to_frame`: ours, the paper's, the probes)."""
    return to_frame(recs[1])
