"""`task=retrieval`: synthetic long-context retrieval (passkey, needle, variable tracking), generated from a seed,
answered by greedy generation through the cache (kvq_lab/eval/retrieval.py); options in conf/task/retrieval.yaml."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from kvq_lab.errors import ConfigError
from kvq_lab.eval.retrieval import KINDS

from . import Task, TaskContext, register_task

MIN_PROMPT = 128  # tokens left for the prompt after max_new_tokens: the instruction and question alone take ~100
PREFILL = ("exact", "cache")


def _int(t, key: str, lo: int) -> int:
    v = t.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConfigError(f"task.{key}={v!r} must be an integer >= {lo}")
    return v


def model_max_positions(cfg: DictConfig) -> int | None:
    """max_position_embeddings from a local model folder's config.json (None when not local)."""
    from kvq_lab.models import resolve

    try:
        src = Path(resolve(str(cfg.model.get("path") or cfg.model.get("name"))))
    except FileNotFoundError:
        return None
    f = src / "config.json"
    if not f.is_file():
        return None
    c = json.loads(f.read_text())
    c = c.get("text_config", c)
    return c.get("max_position_embeddings")


class RetrievalTask(Task):
    """Exact-match accuracy of a hidden number found in a long generated haystack (RULER-style)."""

    name = "retrieval"
    options = ("name", "kind", "context_tokens", "depth", "samples", "seed", "max_new_tokens", "prefill")
    limit_unit = "samples"

    def check(self, cfg: DictConfig, data_dir: Path | None) -> None:
        super().check(cfg, data_dir)
        t = cfg.task
        if t.get("kind") not in KINDS:
            raise ConfigError(f"task.kind={t.get('kind')!r}; choose one of: {', '.join(KINDS)}")
        samples = _int(t, "samples", 1)
        _int(t, "seed", 0)
        new = _int(t, "max_new_tokens", 1)
        ctx_tokens = _int(t, "context_tokens", new + MIN_PROMPT)
        depth = t.get("depth")
        if depth is not None and (
            isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 1
        ):
            raise ConfigError(f"task.depth={depth!r} must be a number in [0, 1] or null (spread over the samples)")
        if t.get("prefill") not in PREFILL:
            raise ConfigError(f"task.prefill={t.get('prefill')!r}; choose one of: {', '.join(PREFILL)}")
        limit = cfg.get("limit")
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > samples:
            raise ConfigError(f"limit={limit} but task.samples={samples}; use limit<={samples} or limit=null")
        most = model_max_positions(cfg)
        if most is not None and ctx_tokens > most:
            raise ConfigError(
                f"task.context_tokens={ctx_tokens} exceeds the model's {most} positions (max_position_embeddings); "
                f"use task.context_tokens<={most}"
            )

    def inputs(self, cfg: DictConfig, data_dir: Path | None) -> dict[str, Any]:
        t = cfg.task
        keys = ("kind", "context_tokens", "depth", "samples", "seed", "max_new_tokens")
        return {"source": "generated", "generator": "kvq_lab.eval.retrieval", **{k: t.get(k) for k in keys}}

    def run(self, ctx: TaskContext) -> dict[str, float]:
        from kvq_lab.eval.retrieval import run_retrieval

        return run_retrieval(ctx)


register_task(RetrievalTask())
