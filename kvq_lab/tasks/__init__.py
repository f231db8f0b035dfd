"""Task registry: what `task=<name>` runs. A task checks its inputs cheaply (`check`, before any model load)
and then produces flat metrics (`run`). Adding a task is one class here or in its own module plus a
`conf/task/<name>.yaml` holding `name: <name>` and its options."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from kvq_lab.config import ConfigError


@dataclass
class TaskContext:
    """Everything a task needs. `make_cache()` returns a fresh cache for one generation (None = model default)."""

    model: Any
    tokenizer: Any
    make_cache: Callable[[], Any]
    cfg: DictConfig
    run_dir: Path
    data_dir: Path | None
    limit: int | None
    artifacts: dict[str, Any] = field(default_factory=dict)  # extra outputs (tables, figures) for the record/W&B


class Task:
    name: str = ""
    # files a task reads under the data dir when one is given (else it uses the hub)
    data_files: tuple[str, ...] = ()

    def check(self, cfg: DictConfig, data_dir: Path | None) -> None:
        for rel in self.data_files:
            if data_dir is not None and not (data_dir / rel).exists():
                raise ConfigError(
                    f"task={self.name} needs {rel} under data_dir={data_dir}; point data_dir= or KVQ_DATA_DIR at the "
                    "data folder (e.g. ../shared/data), or unset both to download from the hub"
                )

    def run(self, ctx: TaskContext) -> dict[str, float]:
        raise NotImplementedError


TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    TASKS[task.name] = task
    return task


class LmEvalTask(Task):
    """A generation task through lm-eval-harness, with the cache handed to every `generate` call."""

    def __init__(self, name: str, data_files: tuple[str, ...] = (), lm_eval_name: str | None = None):
        self.name = name
        self.data_files = data_files
        self.lm_eval_name = lm_eval_name or name

    def run(self, ctx: TaskContext) -> dict[str, float]:
        from kvq_lab.eval.harness import run_lm_eval

        metrics, samples = run_lm_eval(
            self.lm_eval_name,
            ctx.model,
            ctx.tokenizer,
            ctx.make_cache,
            limit=ctx.limit,
            batch_size=ctx.cfg.batch_size,
            num_fewshot=ctx.cfg.task.get("num_fewshot"),
            log_samples=True,
        )
        ctx.artifacts["samples"] = [
            {
                "doc_id": s.get("doc_id"),
                "target": s.get("target"),
                "response": (s.get("filtered_resps") or [None])[0],
                **{k: s[k] for k in ("em", "f1", "exact_match") if k in s},
            }
            for s in samples
        ]
        return metrics


COQA_FILE = "coqa/coqa-validation.first20.lm_eval.jsonl"
register_task(LmEvalTask("coqa", (COQA_FILE,)))
register_task(LmEvalTask("coqa_turns", (COQA_FILE,)))


class PplTask(Task):
    """Decode-mode perplexity through the cache (kvq_lab/eval/ppl.py); options in conf/task/ppl.yaml."""

    name = "ppl"
    data_files = (COQA_FILE,)

    def check(self, cfg: DictConfig, data_dir: Path | None) -> None:
        from kvq_lab.eval.ppl import check_options

        super().check(cfg, data_dir)
        try:
            check_options(cfg.task)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def run(self, ctx: TaskContext) -> dict[str, float]:
        from kvq_lab.eval.ppl import run_ppl

        return run_ppl(ctx)


register_task(PplTask())
register_task(LmEvalTask("gsm8k", ("gsm8k/test.jsonl", "gsm8k/train.jsonl")))
register_task(LmEvalTask("truthfulqa_gen", ("truthfulqa/TruthfulQA.csv",)))

from kvq_lab.probes import task as _probe_task  # noqa: E402,F401  (registers task=probe)
