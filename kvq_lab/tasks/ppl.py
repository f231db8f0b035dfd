"""`task=ppl`: decode-mode perplexity through the cache (kvq_lab/eval/ppl.py); options in conf/task/ppl.yaml."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from kvq_lab.errors import ConfigError

from . import Task, TaskContext, register_task
from .harness import COQA_DATA, COQA_HUB


class PplTask(Task):
    name = "ppl"
    options = ("name", "source", "context_tokens", "eval_tokens", "windows", "prefill")
    data = (COQA_DATA,)
    hub = (COQA_HUB,)
    limit_unit = "windows"

    def check(self, cfg: DictConfig, data_dir: Path | None) -> None:
        from kvq_lab.eval.ppl import check_options

        super().check(cfg, data_dir)
        try:
            check_options(cfg.task)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        n = _source_tokens(cfg, data_dir)
        t = cfg.task
        windows = min(t.windows, cfg.limit) if cfg.get("limit") else t.windows
        need = windows * (t.context_tokens + t.eval_tokens)
        if n is not None and n < need:
            raise ConfigError(
                f"task=ppl: the source text has {n} tokens; {windows} windows of {t.context_tokens}+{t.eval_tokens} "
                f"need {need}: lower task.windows, task.context_tokens or task.eval_tokens"
            )

    def run(self, ctx: TaskContext) -> dict[str, float]:
        from kvq_lab.eval.ppl import run_ppl

        return run_ppl(ctx)


def _source_tokens(cfg: DictConfig, data_dir: Path | None) -> int | None:
    """Tokens in the source text with the run's tokenizer, when both are local (a saved model folder): checks a
    too-short text before the model loads. None when that would need a download or a GGUF conversion."""
    from kvq_lab.models import resolve

    try:
        src = Path(resolve(str(cfg.model.get("path") or cfg.model.get("name"))))
    except FileNotFoundError:
        return None
    if data_dir is None or not (src / "config.json").is_file():
        return None
    key = (str(src), str(data_dir), str(cfg.task.source))
    if key not in _TOKENS:
        from transformers import AutoTokenizer

        from kvq_lab.eval.ppl import source_text

        tok = AutoTokenizer.from_pretrained(src)
        _TOKENS[key] = len(tok(source_text(str(cfg.task.source), data_dir), add_special_tokens=False)["input_ids"])
    return _TOKENS[key]


_TOKENS: dict[tuple, int] = {}
register_task(PplTask())
