"""`task=probe` (probes on real text), and `probe=true` (probes beside any task, on a sample of its prompts).

Both capture q/k/v in one exact forward pass per prompt and measure the run's key/value quantizers at every layer
(see `kvq_lab.probes.errors`). Flat `probe/...` aggregates go into the metrics; the per-layer/head tables, W&B
tables and heat-map PNGs (written into the run folder) go into the record's artifacts.
"""

from __future__ import annotations

import logging
from pathlib import Path

from kvq_lab.common.errors import ConfigError
from kvq_lab.probes.settings import ProbeSettings

from . import Task, TaskContext, read_data_file, register_task
from .datasets import COQA_DATA, COQA_HUB, GSM8K_CONFIG, GSM8K_HUB, coqa_prompt, load_coqa
from .text import gsm8k_file, gsm8k_text

log = logging.getLogger("kvq_lab")


def _coqa_docs(data_dir: Path | None, n: int) -> list[dict]:
    if data_dir is not None:
        docs = read_data_file(data_dir, COQA_DATA)[0]
    else:  # the hub copy, as the coqa task does without a data dir
        docs = list(load_coqa()["validation"])
    return docs[:n]


def coqa_stories(data_dir: Path | None, n: int) -> list[str]:
    """The first n CoQA validation stories (the passage only)."""
    return [d["story"] for d in _coqa_docs(data_dir, n)]


def coqa_task_prompts(data_dir: Path | None, n: int) -> list[str]:
    """The prompts the coqa tasks generate from: story + Q/A turns up to the last question (lm-eval's coqa)."""
    return [coqa_prompt(d) for d in _coqa_docs(data_dir, n)]


def gsm8k_pieces(data_dir: Path | None, n: int) -> list[str]:
    """GSM8K's test split as one long text (kvq_lab.tasks.text.gsm8k_text, ~150K tokens), cut into n consecutive
    pieces of equal characters: long prompts (task.max_tokens up to the model's context) for the probes past a
    sliding window."""
    text = gsm8k_text(data_dir, "test")
    size = len(text) // n
    return [text[i * size : (i + 1) * size] for i in range(n)]


SOURCES = {"coqa": coqa_stories, "gsm8k": gsm8k_pieces}
# The running task's own prompts, for probe=true (keep="tail": a long prompt keeps its end, where generation starts).
TASK_PROMPTS = {"coqa": coqa_task_prompts, "coqa_turns": coqa_task_prompts}


def _settings(d) -> ProbeSettings:
    return ProbeSettings.from_dict(d.to_dict() if hasattr(d, "to_dict") else dict(d))


def _measure(ctx: TaskContext, cache, prompts: list[str], settings: ProbeSettings, keep: str) -> dict[str, float]:
    from kvq_lab.probes.probe import probe_model, tokenize  # torch and transformers: only once a run starts
    from kvq_lab.probes.results import artifacts, flat_metrics

    ids = tokenize(ctx.tokenizer, prompts, settings.max_tokens, keep=keep)
    res = probe_model(ctx.model, ids, cache, settings)
    ctx.artifacts.update(artifacts(res, settings, ctx.run_dir if settings.figures else None, title=cache.label()))
    return flat_metrics(res)


class ProbeTask(Task):
    """Reconstruction, attention-score and attention-output error per layer and head on real text (no accuracy)."""

    name = "probe"
    options = ("name", *ProbeSettings.__dataclass_fields__)
    data = (COQA_DATA,)  # source=coqa; source=gsm8k reads GSM8K's test split (data_files)
    hub = (COQA_HUB,)
    limit_unit = "CoQA stories"

    def data_files(self, task_cfg):
        return (gsm8k_file("test"),) if _settings(task_cfg).source == "gsm8k" else self.data

    def hub_datasets(self, task_cfg):
        return (f"{GSM8K_HUB}/{GSM8K_CONFIG}:test",) if _settings(task_cfg).source == "gsm8k" else self.hub

    def count_docs(self, rows):
        return len(rows[COQA_DATA.rel]) if COQA_DATA.rel in rows else None  # source=gsm8k: no bound

    def check_options(self, cfg):
        try:
            s = _settings(cfg.task)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"task=probe: {e}") from None
        if s.source not in SOURCES:
            raise ConfigError(
                f"task.source={s.source!r} is not a probe prompt source; choose one of: {', '.join(SOURCES)}"
            )
        super().check_options(cfg)

    def check_data(self, cfg, data_dir):
        super().check_data(cfg, data_dir)  # the source's files present and parseable
        s = _settings(cfg.task)
        n = len(_coqa_docs(data_dir, 10**9)) if data_dir is not None and s.source == "coqa" else None
        if n is not None and s.n_prompts > n:
            raise ConfigError(f"task.n_prompts={s.n_prompts} but data_dir={data_dir} has {n} CoQA stories; use <= {n}")

    def positions(self, task_cfg) -> tuple[int, str]:
        return _settings(task_cfg).max_tokens, "task.max_tokens"

    def prompt_prefill(self, task_cfg, cache) -> None:
        """The probes measure the quantizers on K/V captured in one exact forward: no prompt goes through a cache."""
        return None

    def run(self, ctx: TaskContext) -> dict[str, float]:
        s = _settings(ctx.cfg.task)
        n = min(s.n_prompts, ctx.limit) if ctx.limit else s.n_prompts
        prompts = SOURCES[s.source](ctx.data_dir, n)
        return _measure(ctx, ctx.cache_config, prompts, s, keep="head")


PROBE = register_task(ProbeTask())


def run_probes_for_task(ctx: TaskContext) -> dict[str, float]:
    """probe=true: the probes on the first `probes.n_prompts` of the task's prompts (coqa stories when the task has
    no prompt source here). Returns flat `probe/...` metrics; tables and figures go into ctx.artifacts."""
    task = ctx.cfg.task.name
    if task == ProbeTask.name:
        return {}
    s = ctx.cfg.probes or _settings({})
    source = TASK_PROMPTS.get(task)
    if source is None:
        log.warning("probe=true: task %s has no probe prompt source; probing CoQA stories instead", task)
        prompts, keep = coqa_stories(ctx.data_dir, s.n_prompts), "head"
    else:
        prompts, keep = source(ctx.data_dir, s.n_prompts), "tail"
    ctx.artifacts["probe_prompt_source"] = task if source else "coqa"
    return _measure(ctx, ctx.cache_config, prompts, s, keep=keep)
