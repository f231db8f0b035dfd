"""`task=lm_eval`: any lm-eval-harness task or group through the quantized-cache wrapper (kvq_lab/eval/lm_tasks.py).

`task.tasks` names them (lm-eval's own, ours from kvq_lab/eval/tasks, or YAMLs under `task.include_path`); the
names are checked against lm-eval's index before the model loads. Generation requests get a fresh cache each;
loglikelihood requests never read a generation cache, and the run warns once when a task sends them. (The key is
`task.tasks`, not `task.name`: `task.name` selects this task, `lm_eval`.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig

from kvq_lab.errors import ConfigError

from . import Task, TaskContext, register_task


def _names(v) -> list[str]:
    if isinstance(v, str):
        return [x.strip() for x in v.split(",") if x.strip()]
    if isinstance(v, (list, tuple, ListConfig)) and all(isinstance(x, str) for x in v):
        return [x.strip() for x in v if x.strip()]
    return []


def _paths(v) -> list[str]:
    if v is None:
        return []
    return [str(Path(p).expanduser().resolve()) for p in ([v] if isinstance(v, str) else v)]


class LmEvalAnyTask(Task):
    """Whatever lm-eval task(s) `task.tasks` names, scored by lm-eval, with the cache in every generate call."""

    name = "lm_eval"
    options = ("name", "tasks", "num_fewshot", "include_path")
    limit_unit = "documents per task"

    def check(self, cfg: DictConfig, data_dir: Path | None) -> None:
        super().check(cfg, data_dir)
        t = cfg.task
        names = _names(t.get("tasks"))
        if not names:
            raise ConfigError(
                f"task.tasks={t.get('tasks')!r}: name an lm-eval task or group, e.g. task.tasks=hellaswag"
            )
        shots = t.get("num_fewshot")
        if shots is not None and (isinstance(shots, bool) or not isinstance(shots, int) or shots < 0):
            raise ConfigError(f"task.num_fewshot={shots!r} must be an integer >= 0 or null (the task's default)")
        inc = t.get("include_path")
        if inc is not None and not isinstance(inc, (str, list, ListConfig)):
            raise ConfigError(f"task.include_path={inc!r} must be a folder or a list of folders")
        from kvq_lab.eval.lm_tasks import check_tasks

        try:
            check_tasks(names, _paths(inc))
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def inputs(self, cfg: DictConfig, data_dir: Path | None) -> dict[str, Any]:
        from importlib import metadata

        t = cfg.task
        return {
            "source": "lm-eval",
            "tasks": _names(t.get("tasks")),
            "include_path": _paths(t.get("include_path")),
            "lm_eval": metadata.version("lm_eval"),
            # our task YAMLs read the data folder when one is set, else lm-eval downloads from the hub
            "data_dir": str(data_dir) if data_dir is not None else None,
        }

    def run(self, ctx: TaskContext) -> dict[str, float]:
        from kvq_lab.eval.lm_tasks import run_tasks

        t = ctx.cfg.task
        ctx.progress.unit = "generate calls"
        make_cache = ctx.make_cache

        def counted():  # one cache per generate call: counts them, for an interrupted run's record
            ctx.progress.done += 1
            return make_cache()

        metrics, samples = run_tasks(
            _names(t.tasks),
            ctx.model,
            ctx.tokenizer,
            counted,
            limit=ctx.limit,
            batch_size=ctx.cfg.batch_size,
            num_fewshot=t.get("num_fewshot"),
            include_path=_paths(t.get("include_path")),
            prefix_reuse=ctx.cfg.prefix_reuse,
        )
        ctx.artifacts["samples"] = samples
        return metrics


register_task(LmEvalAnyTask())
