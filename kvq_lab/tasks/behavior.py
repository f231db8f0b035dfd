"""`task=behavior`: behaviour drift against the 16-bit model on chat-templated prompts (harmful AdvBench requests and
neutral TruthfulQA questions): refusal rate and flips, identical answers, matching prefix, ROUGE-L
(kvq_lab/eval/behavior.py); options in conf/task/behavior.yaml."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from kvq_lab.errors import ConfigError

from . import DataFile, Task, TaskContext, read_data_file, register_task
from .harness import TQA_COLUMNS, TQA_FILE

ADVBENCH = DataFile("advbench/harmful_behaviors.csv", "csv", ("goal", "target"))
TRUTHFULQA = DataFile(TQA_FILE, "csv", TQA_COLUMNS)


class BehaviorTask(Task):
    """Drift of greedy chat answers from the 16-bit model's, on harmful and neutral prompts."""

    name = "behavior"
    options = ("name", "harmful", "neutral", "max_new_tokens")
    data = (ADVBENCH, TRUTHFULQA)
    limit_unit = "prompts per set"

    def check(self, cfg: DictConfig, data_dir: Path | None) -> None:
        if data_dir is None:
            raise ConfigError(
                "task=behavior reads AdvBench and TruthfulQA from the data folder; set data_dir= or KVQ_DATA_DIR "
                "(e.g. ../shared/data)"
            )
        super().check(cfg, data_dir)
        t = cfg.task
        for key, f in (("harmful", ADVBENCH), ("neutral", TRUTHFULQA), ("max_new_tokens", None)):
            v = t.get(key)
            lo = 1 if key == "max_new_tokens" else 0
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"task.{key}={v!r} must be an integer >= {lo}")
            if f is not None:
                have = len(read_data_file(data_dir, f)[0])
                if v > have:
                    raise ConfigError(f"task.{key}={v} but {f.rel} has {have} rows; use task.{key}<={have}")
        if t.harmful + t.neutral == 0:
            raise ConfigError("task.harmful=0 and task.neutral=0 leave no prompts; set at least one above 0")

    def inputs(self, cfg: DictConfig, data_dir: Path | None) -> dict[str, Any]:
        return {"source": "local", "files": {f.rel: read_data_file(data_dir, f)[1] for f in self.data}}

    def run(self, ctx: TaskContext) -> dict[str, float]:
        from kvq_lab.eval.behavior import run_behavior

        t = ctx.cfg.task
        cap = ctx.limit or 10**9
        questions = {
            "harmful": [r["goal"] for r in read_data_file(ctx.data_dir, ADVBENCH)[0][: min(t.harmful, cap)]],
            "neutral": [r["Question"] for r in read_data_file(ctx.data_dir, TRUTHFULQA)[0][: min(t.neutral, cap)]],
        }
        return run_behavior(ctx, questions)


register_task(BehaviorTask())
