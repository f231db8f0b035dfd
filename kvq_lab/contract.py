"""The contract every layer reads: the validated run config (`RunConfig`) and what a task is handed (`TaskContext`).

Defined here, below the tasks and fits that read them, and built above them: `kvq_lab.preflight` checks a composed
config and builds the `RunConfig` (run.py, a sweep's rows); the runner builds the `TaskContext`. The model's facts
(`kvq_lab.models.files.ModelFacts`) and the cache (`kvq_lab.cache.config.CacheConfig`) are defined where they are made
and only named here. Nothing in this module checks a value: it holds what has been checked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvq_lab.cache.config import CacheConfig
from kvq_lab.common.section import Section
from kvq_lab.models.files import ModelFacts
from kvq_lab.probes.settings import ProbeSettings

__all__ = ["Progress", "RunConfig", "TaskContext"]


@dataclass(frozen=True)
class RunConfig:
    """A validated run config: typed values and read-only sections (`kvq_lab.common.section.Section`).

    cache: the cache the knobs describe (precision=file's per-layer bits applied; `backend` the one that will run).
    task, model, logger: their sections as given; calibration, precision: their validated settings (defaults
    filled); probes: `ProbeSettings` when `probe=true`, else None. model_source: what `model` resolves to (registry
    name, hub id, folder, GGUF). facts: the model's shape from its files (`ModelFacts`), None for a hub id.
    resolved: the whole resolved config as Hydra composed it (what the record and W&B carry)."""

    cache: CacheConfig
    task: Section
    model: Section
    logger: Section
    calibration: Section
    precision: Section
    probes: ProbeSettings | None
    limit: int | None
    seed: int
    batch_size: int
    prefix_reuse: bool
    noise: str
    probe: bool
    device: str
    data_dir: Path | None
    results_dir: Path
    run_name: str | None
    resume: bool
    resume_dirty: bool
    experiment_name: str | None
    model_source: str
    facts: ModelFacts | None
    resolved: Section

    @property
    def dtype(self) -> str:
        return self.model.get("dtype") or "float32"


@dataclass
class Progress:
    """How far a running task got, for the record of an interrupted run: `done` units of `unit` out of `total`."""

    unit: str = "steps"
    done: int = 0
    total: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"unit": self.unit, "done": self.done, "total": self.total}


@dataclass
class TaskContext:
    """Everything a task needs. `make_cache()` returns a fresh cache for one generation (None = model default)."""

    model: Any
    tokenizer: Any
    make_cache: Callable[[], Any]
    cfg: RunConfig
    run_dir: Path
    data_dir: Path | None
    limit: int | None
    cache_config: Any = None  # the run's CacheConfig (what make_cache builds), for tasks that quantize themselves
    artifacts: dict[str, Any] = field(default_factory=dict)  # extra outputs (tables, figures) for the record/W&B
    progress: Progress = field(default_factory=Progress)

    def counted_caches(self, unit: str = "generate calls") -> Callable[[], Any]:
        """`make_cache`, counting generate calls as progress for an interrupted run's record: one cache per call,
        so asking for the next cache means the previous call finished (`done` counts finished calls, not started
        ones; a run that ends normally records no progress)."""
        self.progress.unit = unit
        made = 0

        def make():
            nonlocal made
            self.progress.done = made  # the calls before this one have finished
            made += 1
            return self.make_cache()

        return make
