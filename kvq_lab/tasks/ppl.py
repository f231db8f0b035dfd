"""`task=ppl`: decode-mode perplexity through the cache (kvq_lab/tasks/decode.py); options in conf/task/ppl.yaml.

The text comes from `task.source` (kvq_lab/tasks/text.py): the CoQA stories, GSM8K's questions and answers
(`task.split`; the long text), any UTF-8 file (`task.path`), or a hub dataset (`task.dataset`,
`task.dataset_config`, `task.split`, `task.text_field`). A missing or non-UTF-8 file and a
text too short for the windows are caught here, before the model loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvq_lab.common.errors import ConfigError
from kvq_lab.common.metric import Metric
from kvq_lab.tasks.chunks import MIN_N_CTX, PROTOCOLS
from kvq_lab.tasks.text import OPTIONS as SOURCE_OPTIONS
from kvq_lab.tasks.text import source_files, source_inputs

from . import Task, TaskContext, read_data_file, register_task
from .datasets import COQA_DATA, COQA_HUB

if TYPE_CHECKING:  # built above the tasks (kvq_lab.preflight); tasks only read it
    from kvq_lab.contract import RunConfig


class PplTask(Task):
    """Teacher-forced decode through the cache over windows of a text; `ppl/ppl` of the scored tokens."""

    name = "ppl"
    options = ("name", *SOURCE_OPTIONS, "context_tokens", "eval_tokens", "windows", "prompt_forward", "protocol",
               "n_ctx", "chunks")  # fmt: skip
    data = (COQA_DATA,)  # the default source's file; check() reads the files of the run's task.source
    hub = (COQA_HUB,)
    limit_unit = "windows"
    headline = (Metric("ppl/ppl", "decode ppl", "lower"),)

    def check_options(self, cfg: RunConfig) -> None:
        from kvq_lab.tasks.decode import check_options

        super().check_options(cfg)
        t = cfg.task
        protocol = t.get("protocol")
        if protocol not in PROTOCOLS:
            raise ConfigError(f"task.protocol={protocol!r}; choose one of: {', '.join(PROTOCOLS)}")
        try:
            check_options(t)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        _check_chunk_options(t)  # under protocol=decode too: a bad value is refused even where it is not read

    def check_data(self, cfg: RunConfig, data_dir: Path | None) -> None:
        """The source's files (not the default source's `data`), and the text long enough for the windows."""
        if data_dir is not None:
            for f in source_files(cfg.task):
                read_data_file(data_dir, f)
        n = _source_tokens(cfg, data_dir)
        t = cfg.task
        if t.get("protocol") == "chunks":
            return _check_chunks(t, n, cfg.limit)
        windows = min(t.windows, cfg.limit) if cfg.limit else t.windows
        need = windows * (t.context_tokens + t.eval_tokens)
        if n is not None and n < need:
            raise ConfigError(
                f"task={self.name}: the source text ({_describe(t)}) has {n} tokens; {windows} windows of "
                f"{t.context_tokens}+{t.eval_tokens} need {need}: lower task.windows, task.context_tokens or "
                "task.eval_tokens, or give a longer text"
            )

    def inputs(self, cfg: RunConfig, data_dir: Path | None) -> dict[str, Any]:
        return source_inputs(cfg.task, data_dir)

    def positions(self, task_cfg) -> tuple[int, str]:
        t = task_cfg
        if t.get("protocol") == "chunks":
            return t.get("n_ctx"), "task.n_ctx"
        c, e = t.get("context_tokens"), t.get("eval_tokens")
        return c + e, f"a window, task.context_tokens + task.eval_tokens = {c} + {e}"

    def cached_tokens(self, task_cfg) -> int:
        """A window (context + scored tokens), or a chunk of n_ctx under protocol=chunks."""
        t = task_cfg
        return int(t["n_ctx"]) if t.get("protocol") == "chunks" else int(t["context_tokens"]) + int(t["eval_tokens"])

    def prompt_prefill(self, task_cfg, cache) -> str:
        """task.prompt_forward=exact hands the cache the exact K/V of the context, unless the cache quantizes the
        prompt (`prefill=quantized`, `policy=fakequant`): then, as with task.prompt_forward=cache and protocol=chunks,
        the context's forward goes through the cache (`kvq_lab.tasks.decode.prefill`)."""
        if (
            task_cfg.get("protocol") != "chunks"
            and task_cfg.get("prompt_forward") == "exact"
            and not cache.quantizes_prefill
        ):
            return "exact"
        return super().prompt_prefill(task_cfg, cache)

    def run(self, ctx: TaskContext) -> dict[str, float]:
        if str(ctx.cfg.task.get("protocol")) == "chunks":
            from kvq_lab.tasks.chunks import run_chunks_ppl

            return run_chunks_ppl(ctx)
        from kvq_lab.tasks.decode import run_ppl

        return run_ppl(ctx)


def _check_chunk_options(t) -> None:
    """n_ctx and chunks (what task.protocol=chunks reads)."""
    n_ctx, chunks = t.get("n_ctx"), t.get("chunks")
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < MIN_N_CTX:
        raise ConfigError(f"task.n_ctx={n_ctx!r} must be an integer >= {MIN_N_CTX} (tokens per chunk)")
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise ConfigError(f"task.chunks={chunks!r} must be an integer >= 1, or null (all the text holds)")


def _check_chunks(t, n: int | None, limit) -> None:
    """task.protocol=chunks (options checked): a text of at least 2 * n_ctx tokens (llama.cpp's own bound), and the
    chunks asked for."""
    n_ctx, chunks = t.get("n_ctx"), t.get("chunks")
    if n is not None and n < 2 * n_ctx:
        raise ConfigError(
            f"task.protocol=chunks: the source text ({_describe(t)}) has {n} tokens; llama.cpp's protocol needs at "
            f"least 2 * task.n_ctx = {2 * n_ctx}: lower task.n_ctx or give a longer text"
        )
    want = min(x for x in (chunks, limit) if isinstance(x, int) and not isinstance(x, bool)) if (chunks or limit) else 0
    if n is not None and want and want > n // n_ctx:
        raise ConfigError(
            f"task.protocol=chunks: {want} chunks of {n_ctx} tokens need {want * n_ctx}; the source text has {n} "
            f"({n // n_ctx} chunks): lower task.chunks (or limit) or task.n_ctx"
        )


def _describe(t) -> str:
    if t.source == "file":
        return f"task.path={t.path}"
    if t.source == "hf":
        return f"{t.dataset}/{t.get('dataset_config')}:{t.split}"
    if t.source == "gsm8k":
        return f"GSM8K {t.split}"
    return "CoQA stories"


def _source_tokens(cfg: RunConfig, data_dir: Path | None) -> int | None:
    """Tokens in the source text with the run's tokenizer, when the model is a local folder: checks a too-short text
    before the model loads. None when the tokenizer would need a download or a GGUF conversion, or the CoQA stories
    would come from the hub. A hub source (`hf`) is loaded here: the run would load it next anyway."""
    from kvq_lab.models.loading import resolve

    try:
        src = Path(resolve(cfg.model_source))
    except FileNotFoundError:
        return None
    t = cfg.task
    if not (src / "config.json").is_file() or (source_files(t) and data_dir is None):
        return None
    key = (str(src), str(data_dir), repr(sorted((k, str(t.get(k))) for k in SOURCE_OPTIONS)))
    if key not in _TOKENS:
        from transformers import AutoTokenizer

        from kvq_lab.tasks.text import source_text

        try:
            text = source_text(t, data_dir)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        except Exception as e:  # a hub source that cannot be loaded (no network, unknown dataset or config)
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ConfigError(
                f"task.source=hf: cannot load {_describe(t)} ({type(e).__name__}: {first}); check task.dataset, "
                "task.dataset_config and task.split, or use task.source=file with a local copy"
            ) from None
        tok = AutoTokenizer.from_pretrained(src)
        _TOKENS[key] = len(tok(text, add_special_tokens=False)["input_ids"])
    return _TOKENS[key]


_TOKENS: dict[tuple, int] = {}
PPL = register_task(PplTask())
