"""`run(cfg) -> metrics`: the whole pipeline for one config, as a plain function (run.py and tests call it).

config -> validate (no model yet) -> claim the row -> skip if already done -> model -> cache factory -> task ->
record + W&B (`kvq_lab.run.run_record` writes them). SIGINT/SIGTERM during a run mark its record `interrupted` (with
the progress reached) and raise `RunInterrupted`; run.py turns that into one line and stops (a sweep stops at the
current row).
"""

from __future__ import annotations

import logging
import math
import os
import random
import shutil
import signal
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

import torch

from kvq_lab.records.claims import Claim
from kvq_lab.records.record import (
    RECORD,
    mark_died,
    new_run_dir,
    pick_completed,
    write_record,
)
from kvq_lab.run.config import ConfigError, RunPlan, validate
from kvq_lab.run.run_record import (
    mirror,
    opening_record,
    progress_text,
    record_failure,
    seal,
    summary_line,
    write_quietly,
)

log = logging.getLogger("kvq_lab")

# Models stay loaded across the jobs of one multirun process: a sweep loads each model once.
_MODELS: dict[tuple, tuple] = {}


def get_model(name: str, dtype: str, device: str, noise: str = "none"):
    from kvq_lab.models.loading import load_model
    from kvq_lab.models.noise import apply_noise

    key = (name, dtype, device, noise)
    if key not in _MODELS:
        _MODELS.clear()  # one model in memory at a time
        model, tok = load_model(name, dtype=dtype, device=device)
        _MODELS[key] = apply_noise(model, noise), tok  # noise=permute:<seed>: the same model, other rounding
    return _MODELS[key]


def cache_factory(plan: RunPlan, model):
    from kvq_lab.cache import QuantizedKVCache

    QuantizedKVCache.for_model(model, plan.cache)  # fail now (e.g. group size vs head_dim), not mid-task
    return lambda: QuantizedKVCache.for_model(model, plan.cache)


def run_name(plan: RunPlan) -> str:
    if plan.cfg.run_name:
        return str(plan.cfg.run_name)
    noise = "" if plan.cfg.noise == "none" else f"_noise-{plan.cfg.noise.replace(':', '')}"  # a rerun says so
    return f"{plan.task}_{plan.cache.label()}{noise}_{plan.config_hash[:6]}"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


class RunFailed(RuntimeError):
    """A run failed after validation; its record (status `failed`) says why."""


class RecordNotWritten(RunFailed):
    """The run finished but its record could not be written; the metrics were printed with the reason."""


class RunInterrupted(BaseException):  # noqa: N818  (like KeyboardInterrupt: not an Exception, so nothing swallows it)
    """A signal stopped a run (SIGINT, SIGTERM, or submitit's preemption signal in a submitit job); its record says
    `interrupted` (`record` is the record's path) with `reason` where SLURM can tell one (time limit, preempted,
    cancelled). `previous`: the handler the signal had before the run (submitit's checkpoint-and-requeue)."""

    def __init__(self, signame: str, record: Path | None = None, progress: str = "", reason: str = "", previous=None):
        super().__init__(signame)
        self.signame, self.record, self.progress, self.reason = signame, record, progress, reason
        self.previous = previous

    @property
    def signum(self) -> int:
        return int(getattr(signal, self.signame, signal.SIGINT))

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def stop_signals() -> list[signal.Signals]:
    """The signals that interrupt a run: SIGINT, SIGTERM, and in a submitit job its preemption signal (SIGUSR2)."""
    from kvq_lab.run.slurm_job import preempt_signal

    pre = preempt_signal()
    return [signal.SIGINT, signal.SIGTERM, *([pre] if pre is not None else [])]


@contextmanager
def _signals_raise():
    """Within the block, the stop signals raise RunInterrupted (main thread only: elsewhere Python cannot)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.getsignal(s) for s in stop_signals()}

    def handler(signum, frame):
        raise RunInterrupted(signal.Signals(signum).name, previous=old.get(signum))

    for s in old:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class Timer:
    """`with timer("task_s"): ...` records the block's wall time (seconds) in `timer.t`, even if it raises."""

    def __init__(self):
        self.t = {}

    @contextmanager
    def __call__(self, name):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.t[name] = round(time.perf_counter() - t0, 3)


def run(cfg, sweep: str | None = None, outcome: dict | None = None) -> dict[str, float]:
    """Run one config. Raises ConfigError on bad input (before loading anything, or, for what only the loaded model
    can tell, right after, with the run's folder removed: a rejected config leaves nothing). A failure inside the
    run is recorded (status `failed`, with the error) and re-raised as RunFailed so a sweep can go on;
    SIGINT/SIGTERM are recorded (status `interrupted`) and re-raised as RunInterrupted. Returns {} when another
    process holds this row's claim (it is being run right now). `sweep`: the id of the sweep this row belongs to
    (run.py passes it in multirun mode); W&B groups a sweep's rows by experiment_name, else by it. `outcome`, when
    given, receives the row key and, for a row that did not run here, why (`skipped`, `running elsewhere`)."""
    plan = validate(cfg)
    outcome = {} if outcome is None else outcome
    outcome["row_key"] = plan.row_key
    with _signals_raise():
        try:
            claim = Claim.acquire(plan.results_dir, plan.row_key)
        except OSError as e:  # a full disk or a folder that stopped being writable since validation
            msg = f"results_dir={plan.results_dir}: cannot write there ({e.strerror}); nothing was run"
            raise ConfigError(msg) from None
        if claim is None:
            holder = Claim.holder(plan.results_dir, plan.row_key)
            print(f"skip: this row is being run now by {holder}")
            outcome.update(status="running elsewhere", detail=holder)
            return {}
        with claim:
            done = _completed(plan, outcome)
            if done is not None:
                return done
            return _run(plan, sweep, outcome)


def completed_record(plan: RunPlan) -> tuple[dict | None, list[dict]]:
    """(a completed record of this run: same run key, matching its digest, or None; the completed ones passed over
    because a dirty git tree made them). None when resume is off or the run key waits for a fit."""
    if not plan.cfg.resume or not plan.run_key:
        return None, []
    from kvq_lab.records.index import query

    row = query(plan.results_dir, {"row_key": plan.row_key, "run_key": plan.run_key}, with_integrity=True)
    return pick_completed(row, plan.cfg.resume_dirty)


def _completed(plan: RunPlan, outcome: dict) -> dict[str, float] | None:
    """The metrics of a completed record of this run, printed as a skip (`completed_record`); records of the row
    still `running` are marked died first (the caller holds the row's claim, so they are stale)."""
    if not plan.cfg.resume:
        return None
    from kvq_lab.records.index import query

    for r in query(plan.results_dir, {"row_key": plan.row_key}, with_integrity=True):  # every fit of this row
        if r.get("status") == "running":
            mark_died(r)
    done, dirty = completed_record(plan)
    if done is not None:
        print(f"skip: a completed record of this run exists: {done['_path']}")
        print(summary_line(plan, done["metrics"], Path(done["_path"])))
        outcome.update(status="skipped", detail=f"a completed record exists ({Path(done['_path']) / RECORD})")
        return done["metrics"]
    if dirty:
        print(
            f"note: {len(dirty)} completed record(s) of this run came from a git tree with uncommitted "
            f"changes ({dirty[-1]['_path']}); running again (resume_dirty=true would reuse it)"
        )
    return None


def _run(plan: RunPlan, sweep: str | None, outcome: dict) -> dict[str, float]:
    from kvq_lab.plugins import TASKS
    from kvq_lab.run.alloc import retain_freed_memory
    from kvq_lab.tasks import TaskContext

    retain_freed_memory()  # whatever launcher runs this row: freed tensors' pages stay mapped for the next ones

    cfg = plan.cfg
    name = run_name(plan)
    run_dir = new_run_dir(plan.results_dir, name)
    record = opening_record(plan, name, sweep)
    try:
        write_record(run_dir / RECORD, record)
    except OSError as e:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise RunFailed(f"cannot write the record {run_dir / RECORD}: {e}; nothing was run") from None

    timer = Timer()
    # Task data loaders (lm-eval `custom_dataset` functions) read the data folder from the environment
    if plan.data_dir is not None:
        os.environ["KVQ_DATA_DIR"] = str(plan.data_dir)
    ctx = None
    try:
        seed_everything(cfg.seed)
        with timer("model_load_s"):
            model, tok = get_model(cfg.model_source, cfg.dtype, cfg.device, cfg.noise)
        if cfg.facts is None:  # a hub model: its positions are known once it has loaded
            most = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
            TASKS[plan.task].check_positions(cfg.task, most, f"model={cfg.model_source}")
        with timer("calibration_s"):  # fitted methods (nuq, outliers, innerq, rotatekv): one config per layer
            from kvq_lab.fit.calibration import calibrate

            model_id = plan.inputs.get("model")
            cache = calibrate(model, tok, plan.cache, cfg.calibration, plan.data_dir, model_id, cfg.task)
        with timer("precision_s"):  # precision=search: per-layer key/value bits under a budget (kvq_lab.fit.precision)
            from kvq_lab.fit import precision

            cache = precision.resolve(model, tok, cache, cfg.precision, plan.data_dir, run_dir, model_id)
        if plan.refit(cache):  # the fit is part of the run key: a completed record of this fit ends the run here
            record.update(run_key=plan.run_key, inputs=plan.inputs)
            done = _completed(plan, outcome)
            if done is not None:
                shutil.rmtree(run_dir, ignore_errors=True)
                return done
        record["cache_config"] = asdict(plan.cache)
        make_cache = cache_factory(plan, model)
        ctx = TaskContext(model, tok, make_cache, cfg, run_dir, plan.data_dir, cfg.limit, cache_config=plan.cache)
        with timer("task_s"), torch.inference_mode():
            metrics = TASKS[plan.task].run(ctx)
            if cfg.probe:  # error geometry beside the task's score (kvq_lab/probes)
                from kvq_lab.tasks.probe import run_probes_for_task

                metrics.update(run_probes_for_task(ctx))
        from kvq_lab.cache import QuantizedKVCache

        n = TASKS[plan.task].cached_tokens(cfg.task)  # the sequence the task caches: each layer counts its bits
        metrics.update(QuantizedKVCache.stored_bits(plan.cache, n, model))  # codes, tables, outliers, windows, sinks
        metrics.update(precision.metrics(model, plan.cache, cfg.precision))  # per-layer bits: means and stored bits
    except RunInterrupted as e:
        from kvq_lab.run.slurm_job import stop_reason

        progress = ctx.progress.as_dict() if ctx is not None else {"unit": "model load", "done": 0, "total": None}
        reason = stop_reason(e.signame)
        record.update(
            status="interrupted",
            signal=e.signame,
            **({"reason": reason} if reason else {}),
            interrupted=datetime.now().isoformat(timespec="seconds"),
            progress=progress,
            timings=timer.t,
        )
        write_quietly(run_dir / RECORD, record)
        raise RunInterrupted(e.signame, run_dir / RECORD, progress_text(progress), reason, e.previous) from None
    except ConfigError:  # what only the loaded model could tell: rejected like any bad input, nothing left behind
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    except Exception as e:
        record.update(
            status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(), timings=timer.t
        )
        write_quietly(run_dir / RECORD, record)
        mirror(cfg, record, run_dir, {}, None, failed=True)
        raise RunFailed(f"run {name} failed: {type(e).__name__}: {e} (record: {run_dir / RECORD})") from e

    bad = [k for k, v in metrics.items() if isinstance(v, float) and math.isnan(v)]
    if bad:
        log.warning("NaN metrics: %s", bad)
    record.update(status="ok", metrics=metrics, timings=timer.t, finished=datetime.now().isoformat(timespec="seconds"))
    try:
        seal(cfg, record, run_dir, metrics, ctx.artifacts)
    except OSError as e:
        where = record_failure(run_dir, record, f"{type(e).__name__}: {e}")
        print(summary_line(plan, metrics, None))
        raise RecordNotWritten(
            f"run {name} finished (metrics above) but its record could not be written to {run_dir}: {e}; {where}"
        ) from None
    print(summary_line(plan, metrics, run_dir))
    return metrics


__all__ = ["ConfigError", "RecordNotWritten", "RunFailed", "RunInterrupted", "run"]
