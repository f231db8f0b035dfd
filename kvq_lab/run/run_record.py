"""The run's record, as the runner writes it: opened `running` before anything loads, sealed `ok` with its sidecars,
samples file and W&B mirror at the end, marked `failed` where the final write fails (a full disk), and the one-line
summary printed beside it. `kvq_lab.run.runner` decides when; this module writes (`kvq_lab.records.record` is the
format: sealed, atomic, never overwriting another run's).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

from kvq_lab.models.numerics import pin_blas
from kvq_lab.records.environment import environment
from kvq_lab.records.record import RECORD, overwrite_in_place, write_json_atomic, write_record, write_sidecars
from kvq_lab.records.wandb import WandbMirror
from kvq_lab.run.config import RunConfig, RunPlan

log = logging.getLogger("kvq_lab")

SAMPLES = "samples.json"


def opening_record(plan: RunPlan, name: str, sweep: str | None) -> dict:
    """The record of a run about to start (status `running`): its config, keys, inputs, cache and environment."""
    from kvq_lab.plugins import TASKS

    cfg = plan.cfg
    return {
        "name": name,
        "status": "running",
        "started": datetime.now().isoformat(timespec="microseconds"),  # orders records made within one second
        "config": cfg.resolved.to_dict(),
        "config_hash": plan.config_hash,
        "run_key": plan.run_key,
        "row_key": plan.row_key,
        "inputs": plan.inputs,
        "cache": plan.cache.label(),
        "cache_config": asdict(plan.cache),
        "backend": plan.cache.backend,  # the one that runs (`auto` resolved before the run key)
        "prefill": TASKS[plan.task].prompt_prefill(cfg.task, plan.cache),  # what the prompt's forward read (or None)
        "experiment": cfg.experiment_name,
        "sweep": sweep,
        "env": environment(cfg.device),
        "blas": pin_blas(),  # how CPU products are computed (kvq_lab.models.numerics): same bits at any thread count
        "metrics": {},
        "timings": {},
    }


def seal(cfg: RunConfig, record: dict, run_dir: Path, metrics: dict, artifacts: dict) -> None:
    """Write a finished run's sidecars, samples file and W&B mirror, then its record (status `ok` already set);
    OSError where a write fails (the caller marks the record failed with `record_failure`)."""
    # samples get a file of their own; W&B tables and images are the mirror's copy of what is already here
    extras = {k: v for k, v in artifacts.items() if k not in ("samples", "wandb_tables", "wandb_images")}
    if extras:
        record["artifacts"] = write_sidecars(run_dir, extras)
    if artifacts.get("samples"):
        write_json_atomic(run_dir / SAMPLES, artifacts["samples"])
        record["samples_file"] = SAMPLES
    record["wandb_dir"] = mirror(cfg, record, run_dir, metrics, artifacts)
    write_record(run_dir / RECORD, record)


def record_failure(run_dir: Path, record: dict, reason: str) -> str:
    """The final record could not be written (a full disk, permissions): leave the record `failed` with the reason
    and the metrics if any write still succeeds (atomically, else in place over the `running` record, whose blocks a
    full disk can reuse), so no record stays `running`. -> what the record now says, for the message."""
    failed = {k: v for k, v in record.items() if k not in ("artifacts", "samples_file", "wandb_dir")} | {
        "status": "failed",
        "error": f"the record could not be written: {reason}",
    }
    path = run_dir / RECORD
    for write in (write_record, overwrite_in_place):
        try:
            write(path, failed)
            return f"the record {path} says failed"
        except OSError:
            continue
    return f"the record {path} could not be updated either and still says running (it is not a result)"


def write_quietly(path: Path, record: dict) -> None:
    try:
        write_record(path, record)
    except OSError as e:
        log.error("could not update the record %s: %s", path, e)


def mirror(cfg: RunConfig, record: dict, run_dir, metrics, artifacts, failed: bool = False) -> str | None:
    """The W&B copy of a finished run (see WandbMirror); a W&B problem never costs the record.

    Grouped by experiment (else by sweep), with every config field, the structured cache config, the run key and
    the input identities in the run config, so W&B's compare and parallel-coordinates views can select on any."""
    if cfg.logger.get("name", "none") != "wandb":
        return None
    name = record["name"]
    config = {
        **record["config"],
        "cache_config": record["cache_config"],
        "cache_label": record["cache"],
        "run_key": record["run_key"],
        "config_hash": record["config_hash"],
        "inputs": record["inputs"],
    }
    group = cfg.logger.get("group") or record.get("experiment") or record.get("sweep")
    try:
        wb = WandbMirror(cfg.logger, name, config, run_dir, group=group)
        if not failed:
            artifacts = artifacts or {}
            wb.log(metrics, tables=artifacts.get("wandb_tables"), images=artifacts.get("wandb_images"))
        return wb.finish(failed=failed)
    except Exception as e:  # the record is the source of truth; say what went wrong and go on
        log.warning("W&B mirror of %s not written: %s: %s", name, type(e).__name__, e)
        return None


def progress_text(p: dict) -> str:
    total = f" of {p['total']}" if p.get("total") else ""
    return f"{p.get('done', 0)}{total} {p.get('unit', 'steps')}"


def summary_line(plan: RunPlan, metrics: dict, run_dir: Path | None) -> str:
    """The metrics in one line, then where the record is (run_dir None: no record holds them)."""
    shown = ", ".join(
        f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
        for k, v in metrics.items()
        if not k.startswith("probe/") or k.endswith("/mean")
    )
    where = f"record: {run_dir / RECORD}" if run_dir is not None else "record: not written (see the error below)"
    return f"[{plan.cache.label()}] {shown}\n{where}"
