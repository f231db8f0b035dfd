"""Sweeps (`python run.py -m ...`) that are honest about their rows: every row validated before the first one runs,
and an end that says, row by row, what happened.

`SweepCheck` is a Hydra callback (conf/config.yaml, `hydra.callbacks`). When a sweep starts it expands the
overrides into rows as Hydra's basic sweeper does, composes each row's config as the launcher will, and validates it
(`kvq_lab.run.config.validate`: no model loads). A bad value anywhere stops the sweep before the first row runs, with
one line per bad row naming it; nothing is written. (Other sweepers choose rows as they go; their rows are validated one
at a time, as single runs are.)

When the sweep ends, interrupted or not, `finish` prints one line per row, from the records the rows wrote (found
by their row key in their results folder, so the summary holds for every launcher: in-process, local processes,
SLURM) and from what the rows of this process reported (`note`): ok, skipped (a completed record existed), failed,
rejected, interrupted, died, running elsewhere (another process holds the row's claim), not run. run.py exits 1
when a row failed, was rejected, died or did not run.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict, read_write

try:
    from hydra.experimental.callback import Callback
except ImportError:  # hydra < 1.1
    Callback = object  # type: ignore[assignment,misc]

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
BAD = ("failed", "rejected", "died", "not run", "interrupted")


@dataclass
class Row:
    """One row of the sweep: its overrides, where its record goes and the key it is found by."""

    number: int
    overrides: list[str]  # the row's own overrides: those not shared by every row of the sweep
    results_dir: Path
    row_key: str
    outcome: str | None = None  # what this process saw (the basic launcher runs rows here)
    detail: str = ""


@dataclass
class Sweep:
    started: str
    rows: list[Row] = field(default_factory=list)


_SWEEP: Sweep | None = None


def rows_of(config: DictConfig) -> list[list[str]] | None:
    """The rows (each a list of overrides) Hydra's basic sweeper makes of this sweep config; None for another
    sweeper."""
    if config.hydra.sweeper.get("_target_") != BASIC_SWEEPER:
        return None
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    task = OmegaConf.to_container(config.hydra.overrides.task, resolve=False)
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    batches = BasicSweeper.split_arguments(parser.parse_overrides([*params, *task]), None)
    return [list(row) for batch in batches for row in batch]


def row_config(config: DictConfig, overrides: list[str]) -> DictConfig:
    """The config a launcher hands the row with these overrides (the hydra node removed, as Hydra's run_job does)."""
    from hydra.core.global_hydra import GlobalHydra

    cfg = copy.deepcopy(GlobalHydra.instance().config_loader().load_sweep_config(config, overrides))
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]
    return cfg


class SweepCheck(Callback):
    """Validates every row before the first runs; remembers the rows for `finish`."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _SWEEP
        from kvq_lab.run.config import ConfigError, validate

        rows = rows_of(config)
        if rows is None:
            return
        sweep, bad = Sweep(started=datetime.now().isoformat(timespec="microseconds")), []
        shared = set.intersection(*(set(r) for r in rows)) if len(rows) > 1 else set()
        for i, overrides in enumerate(rows, 1):
            own = [o for o in overrides if o not in shared]
            try:
                plan = validate(row_config(config, overrides))
            except ConfigError as e:
                bad.append(f"error: row {i} of {len(rows)} ({' '.join(own) or 'defaults'}): {e}")
                continue
            sweep.rows.append(Row(i, own, plan.results_dir, plan.row_key))
        if bad:
            print("\n".join(bad), file=sys.stderr)
            print(f"error: {len(bad)} of {len(rows)} rows are invalid; nothing was run", file=sys.stderr)
            raise SystemExit(2)
        _SWEEP = sweep


def note(row_key: str, outcome: str, detail: str = "") -> None:
    """What a row run in this process ended as (run.py reports each row's end here)."""
    for row in _SWEEP.rows if _SWEEP is not None else ():
        if row.row_key == row_key and row.outcome is None:
            row.outcome, row.detail = outcome, detail
            return


def outcome(row: Row, started: str) -> tuple[str, str]:
    """(status, detail) of a row: from this process's note where it has one, else from the row's records."""
    from kvq_lab.records.index import query

    recs = query(row.results_dir, {"row_key": row.row_key})
    new = [r for r in recs if str(r.get("started", "")) >= started]
    if row.outcome in ("skipped", "running elsewhere", "rejected"):
        return row.outcome, row.detail
    if new:
        r = max(new, key=lambda r: str(r.get("started", "")))
        status = str(r.get("status"))
        if status == "running":  # launched elsewhere and not finished, or killed with nothing after it
            status = "died" if row.outcome is not None else "running"
        detail = r.get("error", "") if status == "failed" else ""
        if status == "interrupted":
            p = r.get("progress") or {}
            why = f" ({r['reason']})" if r.get("reason") else ""
            detail = f"{r.get('signal', '')}{why} after {p.get('done', 0)} {p.get('unit', '')}".strip()
        where = Path(r["_path"]) / "record.json"
        return status, f"{detail}; {where}" if detail else str(where)
    if row.outcome is not None:
        return row.outcome, row.detail
    if any(r.get("status") == "ok" for r in recs):
        return "skipped", "a completed record existed"
    return "not run", ""


def finish() -> int:
    """Print one line per row of the sweep this process started; -> the exit status it earns (0, or 1 when a row
    failed, was rejected, died or did not run). 0 when no sweep was started here."""
    global _SWEEP
    if _SWEEP is None:
        return 0
    sweep, _SWEEP = _SWEEP, None
    lines, bad = [], 0
    for row in sweep.rows:
        status, detail = outcome(row, sweep.started)
        bad += status in BAD
        tail = f": {detail}" if detail else ""
        lines.append(f"  row {row.number} ({' '.join(row.overrides) or 'defaults'}): {status}{tail}")
    n = len(sweep.rows)
    print(f"sweep: {n - bad} of {n} rows ok or skipped", file=sys.stderr)
    print("\n".join(lines), file=sys.stderr)
    return 1 if bad else 0
