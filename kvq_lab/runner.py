"""`run(cfg) -> metrics`: the whole pipeline for one config, as a plain function (run.py and tests call it).

config -> validate (no model yet) -> skip if already done -> model -> cache factory -> task -> record + W&B.
"""

from __future__ import annotations

import logging
import math
import os
import random
import traceback
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from kvq_lab.config import ConfigError, RunPlan, validate
from kvq_lab.results import RECORD, Timer, WandbMirror, environment, find_completed, new_run_dir, write_json_atomic

log = logging.getLogger("kvq_lab")

# Models stay loaded across the jobs of one multirun process: a sweep loads each model once.
_MODELS: dict[tuple, tuple] = {}


def get_model(name: str, dtype: str, device: str):
    from kvq_lab.models import load_model

    key = (name, dtype, device)
    if key not in _MODELS:
        _MODELS.clear()  # one model in memory at a time
        _MODELS[key] = load_model(name, dtype=dtype, device=device)
    return _MODELS[key]


def cache_factory(plan: RunPlan, model):
    from kvq_lab.cache import QuantizedKVCache

    QuantizedKVCache.for_model(model, plan.cache)  # fail now (e.g. group size vs head_dim), not mid-task
    return lambda: QuantizedKVCache.for_model(model, plan.cache)


def run_name(cfg: DictConfig, plan: RunPlan) -> str:
    if cfg.get("run_name"):
        return str(cfg.run_name)
    return f"{plan.task}_{plan.cache.label()}_{plan.config_hash[:6]}"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def run(cfg: DictConfig) -> dict[str, float]:
    """Run one config. Raises ConfigError on bad input (before loading anything). A failure inside the run is
    recorded (status `failed`, with the error) and re-raised as RunFailed so a sweep can go on."""
    from kvq_lab.tasks import TASKS, TaskContext

    plan = validate(cfg)
    if cfg.get("resume", True):
        done = find_completed(plan.results_dir, plan.config_hash)
        if done is not None:
            log.info(
                "already done (config %s): %s; skipping (resume=false runs it again)", plan.config_hash, done["_path"]
            )
            print(f"skip: a completed record for this config exists: {done['_path']}")
            return done["metrics"]

    name = run_name(cfg, plan)
    run_dir = new_run_dir(plan.results_dir, name)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    record = {
        "name": name,
        "status": "running",
        "config": resolved,
        "config_hash": plan.config_hash,
        "cache": plan.cache.label(),
        "experiment": cfg.get("experiment_name"),
        "env": environment(cfg.device),
        "metrics": {},
        "timings": {},
    }
    write_json_atomic(run_dir / RECORD, record)
    mirror = None
    if cfg.logger.get("name", "none") == "wandb":
        mirror = WandbMirror(cfg.logger, name, resolved, run_dir, group=cfg.get("experiment_name"))

    timer = Timer()
    # Task data loaders (lm-eval `custom_dataset` functions) read the data folder from the environment
    if plan.data_dir is not None:
        os.environ["KVQ_DATA_DIR"] = str(plan.data_dir)
    try:
        seed_everything(cfg.seed)
        with timer("model_load_s"):
            model, tok = get_model(plan.model, cfg.model.get("dtype", "float32"), cfg.device)
        make_cache = cache_factory(plan, model)
        ctx = TaskContext(model, tok, make_cache, cfg, run_dir, plan.data_dir, plan.limit)
        with timer("task_s"), torch.inference_mode():
            metrics = TASKS[plan.task].run(ctx)
            if cfg.probe:  # error geometry beside the task's score (kvq_lab/probes)
                from kvq_lab.probes.task import run_probes_for_task

                metrics.update(run_probes_for_task(ctx, plan))
        bad = [k for k, v in metrics.items() if isinstance(v, float) and math.isnan(v)]
        if bad:
            log.warning("NaN metrics: %s", bad)
        record.update(status="ok", metrics=metrics, timings=timer.t)
        # samples get a file of their own; W&B tables and images are the mirror's copy of what is already here
        extras = {k: v for k, v in ctx.artifacts.items() if k not in ("samples", "wandb_tables", "wandb_images")}
        if extras:
            record["artifacts"] = extras
        if ctx.artifacts.get("samples"):
            write_json_atomic(run_dir / "samples.json", ctx.artifacts["samples"])
        if mirror:
            mirror.log(metrics, tables=ctx.artifacts.get("wandb_tables"), images=ctx.artifacts.get("wandb_images"))
            record["wandb_dir"] = mirror.finish()
        write_json_atomic(run_dir / RECORD, record)
    except Exception as e:
        record.update(
            status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(), timings=timer.t
        )
        write_json_atomic(run_dir / RECORD, record)
        if mirror:
            mirror.finish(failed=True)
        raise RunFailed(f"run {name} failed: {type(e).__name__}: {e} (record: {run_dir / RECORD})") from e

    print(summary_line(plan, metrics, run_dir))
    return metrics


class RunFailed(RuntimeError):
    """A run failed after validation; its record (status `failed`) says why."""


def summary_line(plan: RunPlan, metrics: dict, run_dir: Path) -> str:
    shown = ", ".join(
        f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
        for k, v in metrics.items()
        if not k.startswith("probe/") or k.endswith("/mean")
    )
    return f"[{plan.cache.label()}] {shown}\nrecord: {run_dir / RECORD}"


__all__ = ["ConfigError", "RunFailed", "run"]
