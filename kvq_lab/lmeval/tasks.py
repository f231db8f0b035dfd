"""The tasks that run through lm-eval-harness (`evaluate`, with a fresh quantized cache for every `generate`).

- `coqa`, `coqa_turns`, `gsm8k`, `truthfulqa_gen`: our task YAMLs (kvq_lab/lmeval/yaml/: lm-eval's prompts and
  scoring, local data), scores in percent as the papers report them.
- `lm_eval`: any lm-eval task or group, `task.tasks` names them (lm-eval's own, ours, or YAMLs under
  `task.include_path`); the names are checked against lm-eval's index before the model loads. Generation requests get
  a fresh cache each; loglikelihood requests never read a generation cache, and the run warns once when a task sends
  them. (The key is `task.tasks`, not `task.name`: `task.name` selects this task, `lm_eval`.) Metrics are lm-eval's
  values as it reports them (fractions for accuracies).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvq_lab.common.errors import ConfigError
from kvq_lab.common.metric import Metric
from kvq_lab.tasks import DataFile, Task, TaskContext, register_task
from kvq_lab.tasks.datasets import (
    COQA_DATA,
    COQA_HUB,
    GSM8K_CONFIG,
    GSM8K_DATA,
    GSM8K_HUB,
    TQA_CONFIG,
    TQA_DATA,
    TQA_HUB,
)

if TYPE_CHECKING:  # built above the tasks (kvq_lab.preflight); tasks only read it
    from kvq_lab.contract import RunConfig


class LmEvalTask(Task):
    """A generation task through lm-eval-harness, with the cache handed to every `generate` call.

    headline: the metrics tables show (percent); count: documents `limit` selects from, from the rows of the first
    data file (default: one per row)."""

    options = ("name", "num_fewshot")

    def __init__(
        self,
        name: str,
        data: tuple[DataFile, ...],
        hub: tuple[str, ...],
        headline: tuple[Metric, ...],
        count=len,
        lm_eval_name=None,
    ):
        self.name = name
        self.headline = headline
        self.data = data
        self.hub = hub
        self.count = count
        self.lm_eval_name = lm_eval_name or name

    def count_docs(self, rows):
        return self.count(rows[self.data[0].rel])

    def run(self, ctx: TaskContext) -> dict[str, float]:
        from .evaluate import evaluate

        out = evaluate(
            [self.lm_eval_name],
            ctx.model,
            ctx.tokenizer,
            ctx.counted_caches(),
            limit=ctx.limit,
            batch_size=ctx.cfg.batch_size,
            num_fewshot=ctx.cfg.task.get("num_fewshot"),
            prefix_reuse=ctx.cfg.prefix_reuse,
            scale=100.0,  # percent, as the papers report
            max_length=2048,
        )
        metrics, samples = out.metrics, out.samples.get(self.lm_eval_name, [])
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


def _turns(rows) -> int:
    return sum(len(r["questions"]["input_text"]) for r in rows)


def _percent(key: str, title: str, per_sample: str | None = None) -> Metric:
    return Metric(key, title, "higher", "%", per_sample)


COQA = register_task(
    LmEvalTask(
        "coqa",
        (COQA_DATA,),
        (COQA_HUB,),
        (_percent("coqa/em", "CoQA EM", "em"), _percent("coqa/f1", "CoQA F1", "f1")),
    )
)
COQA_TURNS = register_task(
    LmEvalTask(
        "coqa_turns",
        (COQA_DATA,),
        (COQA_HUB,),
        (_percent("coqa_turns/em", "CoQA-turns EM", "em"), _percent("coqa_turns/f1", "CoQA-turns F1", "f1")),
        count=_turns,
    )
)
GSM8K = register_task(
    LmEvalTask(
        "gsm8k",
        GSM8K_DATA,
        (f"{GSM8K_HUB}/{GSM8K_CONFIG}",),
        (
            _percent("gsm8k/exact_match_strict-match", "GSM8K strict"),
            _percent("gsm8k/exact_match_flexible-extract", "GSM8K flexible"),
        ),
    )
)
TRUTHFULQA_GEN = register_task(
    LmEvalTask(
        "truthfulqa_gen",
        (TQA_DATA,),
        (f"{TQA_HUB}/{TQA_CONFIG}",),
        (Metric("truthfulqa_gen/bleu_max", "TruthfulQA BLEU", "higher"),),
    )
)


def _names(v) -> list[str]:
    if isinstance(v, str):
        return [x.strip() for x in v.split(",") if x.strip()]
    if isinstance(v, (list, tuple, tuple)) and all(isinstance(x, str) for x in v):
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

    def check_options(self, cfg: RunConfig) -> None:
        super().check_options(cfg)
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
        if inc is not None and not isinstance(inc, (str, list, tuple)):
            raise ConfigError(f"task.include_path={inc!r} must be a folder or a list of folders")

    def check_data(self, cfg: RunConfig, data_dir: Path | None) -> None:
        """The named tasks exist in lm-eval (or under task.include_path): lm-eval's task index, read here."""
        super().check_data(cfg, data_dir)
        from .evaluate import check_tasks

        t = cfg.task
        try:
            check_tasks(_names(t.get("tasks")), _paths(t.get("include_path")))
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def inputs(self, cfg: RunConfig, data_dir: Path | None) -> dict[str, Any]:
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
        from .evaluate import evaluate

        t = ctx.cfg.task
        out = evaluate(
            _names(t.tasks),
            ctx.model,
            ctx.tokenizer,
            ctx.counted_caches(),
            limit=ctx.limit,
            batch_size=ctx.cfg.batch_size,
            num_fewshot=t.get("num_fewshot"),
            include_path=_paths(t.get("include_path")),
            prefix_reuse=ctx.cfg.prefix_reuse,
        )
        metrics = {
            **out.metrics,
            "lm_eval/generate_calls": out.generate_calls,
            "lm_eval/loglikelihood_requests": out.loglikelihood_requests,
        }
        samples = [
            {"task": task, "doc_id": s.get("doc_id"), "target": s.get("target"), "responses": s.get("filtered_resps")}
            for task, rows in out.samples.items()
            for s in rows
        ]
        ctx.artifacts["samples"] = samples
        return metrics


LM_EVAL = register_task(LmEvalAnyTask())
