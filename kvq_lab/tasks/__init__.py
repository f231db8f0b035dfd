"""Task registry: what `task=<name>` runs.

A task checks its inputs cheaply, before any model load: its options (`check_options`), then, after its longest
sequence is held against the model's positions (`positions`), its data files parsed and counted and `limit` against
what the data holds (`check_data`), says what its numbers are computed from (`inputs`: content hashes of the
files it reads, or the hub datasets it would download), and produces flat metrics (`run`).

Adding a task: one module in this package that defines a `Task` subclass (with its `headline` metrics for the
experiment tables) and calls `NAME = register_task(...)`, its registry line in `kvq_lab/plugins/__init__.py`
(`"<name>": "kvq_lab.tasks.<module>:NAME"`, imported on first lookup),
and `conf/task/<name>.yaml` holding `name: <name>` and its options (each option also listed in the task's `options`,
so a typo such as `+task.windws=2` is rejected). The registry imports none of its plugins (kvq_lab.plugins names
them, and a lookup imports one); it must stay free of torch so that validation is fast.
"""

from __future__ import annotations

import csv
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvq_lab.common.errors import ConfigError
from kvq_lab.common.metric import Metric
from kvq_lab.common.registry import Registry
from kvq_lab.contract import Progress as Progress  # the contract a task reads (built above it)
from kvq_lab.contract import RunConfig
from kvq_lab.contract import TaskContext as TaskContext

# ---------------------------------------------------------------------------------------------------------------
# Data files: parsed and hashed before any model load
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataFile:
    """A file a task reads under the data dir: `kind` jsonl (one JSON object per line) or csv (with a header row),
    every row holding `keys`."""

    rel: str
    kind: str = "jsonl"
    keys: tuple[str, ...] = ()


_ROWS: dict[tuple, tuple[list[dict], str]] = {}  # (path, size, mtime) -> (rows, sha256): a sweep reads each once


def read_data_file(data_dir: Path, f: DataFile) -> tuple[list[dict], str]:
    """-> (rows, sha256 of the file's bytes). Raises ConfigError naming the file and the line for a missing, empty,
    undecodable or malformed file."""
    path = Path(data_dir) / f.rel
    fix = "restore it from the shared data folder (see its README.md), or point data_dir= at a complete copy"
    if not path.is_file():
        raise ConfigError(
            f"data file {f.rel} under data_dir={data_dir} not found; point data_dir= or KVQ_DATA_DIR at the data "
            "folder (e.g. ../shared/data), or unset both to download from the hub"
        )
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key in _ROWS:
        return _ROWS[key]
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"data file {path} is not UTF-8 text (byte {e.start}); {fix}") from None
    rows: list[tuple[int, dict]] = []  # (line number, row)
    if f.kind == "jsonl":
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"data file {path} line {i} is not valid JSON ({e.msg}); {fix}") from None
            if not isinstance(row, dict):
                raise ConfigError(f"data file {path} line {i} is not a JSON object; {fix}")
            rows.append((i, row))
    elif f.kind == "csv":
        reader = csv.DictReader(text.splitlines())
        rows = [(i + 2, r) for i, r in enumerate(reader)]
    else:
        raise ValueError(f"unknown data file kind {f.kind!r}")
    if not rows:
        raise ConfigError(f"data file {path} is empty; {fix}")
    for i, row in rows:
        missing = [k for k in f.keys if k not in row or row[k] is None]
        if missing:
            raise ConfigError(f"data file {path} line {i} lacks {', '.join(map(repr, missing))}; {fix}")
    out = ([r for _, r in rows], digest)
    _ROWS[key] = out
    return out


DEFAULT_CACHED_TOKENS = 1024  # the sequence stored bits are counted at where a task fixes none


class Task:
    """Base class of tasks. Subclasses set `name`, `options`, `data` (files under the data dir), `hub` (what is
    downloaded without a data dir), `headline` (the metrics experiment tables show, the first one the paper's
    column) and implement `run`; `count_docs` says how many documents `limit` can select."""

    name: str = ""
    headline: tuple[Metric, ...] = ()  # the columns of experiment tables (kvq_lab.report.tables), in order
    options: tuple[str, ...] = ("name",)  # the task.* keys this task reads
    chat: bool = False  # prompts go through the model's chat template (a model without one is refused before load)
    plain_prompt: str | None = None  # the task.* setting that prompts without a chat template, where the task has one
    data: tuple[DataFile, ...] = ()
    hub: tuple[str, ...] = ()  # hub dataset ids (with config) read when no data dir is given
    limit_unit: str = "documents"

    def uses_chat(self, task_cfg) -> bool:
        """Whether this run's prompts go through the model's chat template (task options may choose plain text)."""
        return self.chat

    def data_files(self, task_cfg) -> tuple[DataFile, ...]:
        """The data-folder files this run reads, checked and hashed before any model loads (task options may choose
        another source than the default `data`)."""
        return self.data

    def hub_datasets(self, task_cfg) -> tuple[str, ...]:
        """The hub datasets this run reads when no data dir is given (as `data_files`, for the hub)."""
        return self.hub

    def count_docs(self, rows: dict[str, list[dict]]) -> int | None:
        """Documents `limit` selects from, given the parsed rows of each data file (None: no bound to check)."""
        return None

    def positions(self, task_cfg) -> tuple[int, str] | None:
        """The most tokens one sequence of this run holds (prompt and generated or scored tokens) and the settings
        that make it, e.g. (9512, "task.context_tokens + task.eval_tokens = 9000 + 512"); None where the options do
        not bound it (lm-eval's tasks: their prompts are cut to lm-eval's max_length). Read after `check_options` has
        validated the options."""
        return None

    def cached_tokens(self, task_cfg) -> int:
        """The length of the sequence this run's cache holds, at which its stored bits are counted
        (`QuantizedKVCache.stored_bits`, reported as `cache/bits_tokens`): 1024 where the task's options do not fix
        one (prompts and generations of varying lengths)."""
        return DEFAULT_CACHED_TOKENS

    def check_positions(self, task_cfg, most: int | None, model: str = "the model") -> None:
        """A sequence longer than the model's positions (`most`, its max_position_embeddings; None: not known) is
        refused in one line: RoPE past its trained range runs, and records `ok`, but measures nothing the model
        does. Called before the load with the positions the model's files give, and right after the load of a hub
        model."""
        need = self.positions(task_cfg)
        if most is None or need is None or need[0] <= most:
            return
        raise ConfigError(
            f"task={self.name}: {need[1]} = {need[0]} tokens, past {model}'s {most} positions "
            f"(max_position_embeddings); use at most {most}"
        )

    def prompt_prefill(self, task_cfg, cache) -> str | None:
        """What the prompt's forward attends to in this run, in the words of the `prefill` knob: `quantized` (the
        K/V as the cache stores them) or `exact` (as the model computed them); None where no prompt goes through the
        run's cache (task=probe). The record carries it, and `policy=fakequant` (KIVI Table 1: the prompt quantized)
        is refused where it is not `quantized`. Default: every prompt goes through the cache, as its mode and
        `prefill` say."""
        return "exact" if cache.exact_prefill else "quantized"

    def check_options(self, cfg: RunConfig) -> None:
        """The task.* options (and `limit` where the options bound it), without reading any file: run before
        `positions`, which reads them, and before `check_data`. Subclasses extend it."""
        unknown = sorted(set(cfg.task.keys()) - set(self.options))
        if unknown:
            raise ConfigError(
                f"task.{unknown[0]} is not an option of task={self.name}; its options: {', '.join(self.options)}"
            )

    def check_data(self, cfg: RunConfig, data_dir: Path | None) -> None:
        """The task's inputs, after `check_options` and the model's positions: its data files parsed and counted,
        `limit` against what they hold. Subclasses extend it (e.g. a text tokenized against the windows)."""
        if data_dir is None:
            return
        rows = {f.rel: read_data_file(data_dir, f)[0] for f in self.data_files(cfg.task)}
        n = self.count_docs(rows)
        limit = cfg.limit
        if n is not None and isinstance(limit, int) and not isinstance(limit, bool) and limit > n:
            raise ConfigError(
                f"limit={limit} but task={self.name} has {n} {self.limit_unit} under data_dir={data_dir}; "
                f"use limit<={n} or limit=null (all)"
            )

    def inputs(self, cfg: RunConfig, data_dir: Path | None) -> dict[str, Any]:
        """What the task's numbers are computed from: content hashes of the data files, or the hub datasets."""
        if data_dir is None:
            return {"source": "hub", "datasets": list(self.hub_datasets(cfg.task)), "revision": None}
        return {"source": "local", "files": {f.rel: read_data_file(data_dir, f)[1] for f in self.data_files(cfg.task)}}

    def run(self, ctx: TaskContext) -> dict[str, float]:
        raise NotImplementedError


# The built-in tasks' registry lines live in kvq_lab.plugins: some sit above this layer (kvq_lab.lmeval).
TASKS: Registry[Task] = Registry("task")


def register_task(task: Task) -> Task:
    """Make `task=<task.name>` run `task` (a name another task holds is refused)."""
    return TASKS.register(task.name, task)
