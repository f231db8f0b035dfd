"""Knob spellings that changed, old -> new: one table read by the preflight (an old spelling is refused with a line
naming the new one), by the config hash (which hashes the old spelling, so the run keys of unchanged configs stay)
and by readers of records written before the change.

    residual_length   -> exact_window        the full-precision window of recent tokens; `residual` names the error
                                             corrections (GEAR, QJL), which the old name was mistaken for
    task.prefill      -> task.prompt_forward who runs the prompt's forward (`exact`: the model alone, then its K/V
                                             handed to the cache; `cache`: through the cache): `prefill` is the
                                             cache's knob alone (`exact` | `quantized`), and `exact` means the same
                                             in both: attention reads the K/V the model computed
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

RENAMED = {"residual_length": "exact_window"}  # top-level knobs (the cache's, so also `CacheConfig` fields)
TASK_RENAMED = {"prefill": "prompt_forward"}  # options of the task section


def refused(c: Mapping[str, Any], where: str = "") -> str | None:
    """The one-line reason to refuse a config (or lm-eval's model args: `where="model arg "`) that spells a renamed
    knob the old way, or None."""
    for old, new in RENAMED.items():
        if old in c:
            return f"{where}{old} is now spelled {new} (same meaning, same values): {new}={_show(c[old])}"
    task = c.get("task")
    if isinstance(task, Mapping):
        for old, new in TASK_RENAMED.items():
            if old in task:
                return f"task.{old} is now spelled task.{new} (same values): task.{new}={_show(task[old])}"
    return None


def _show(v: Any) -> str:
    return "null" if v is None else str(v)


def current(config: Mapping[str, Any]) -> dict[str, Any]:
    """A record's config (or cache_config) in today's spellings: what a record written before a rename says, read
    as a record written now would say it."""
    out = {RENAMED.get(k, k): v for k, v in config.items()}
    if isinstance(out.get("task"), Mapping):
        out["task"] = {TASK_RENAMED.get(k, k): v for k, v in out["task"].items()}
    return out


_HASHED_AS = {new: old for old, new in RENAMED.items()}
_TASK_HASHED_AS = {new: old for old, new in TASK_RENAMED.items()}


def as_hashed(d: Any) -> Any:
    """A cache's fields (`asdict(CacheConfig)`, nested per-layer configs included) with the renamed ones under their
    old names: what hashes and digests made before the rename hashed, so they stay the same."""
    if isinstance(d, Mapping):
        return {_HASHED_AS.get(k, k): as_hashed(v) for k, v in d.items()}
    if isinstance(d, (list, tuple)):
        return type(d)(as_hashed(x) for x in d)
    return d


def task_as_hashed(task: Mapping[str, Any]) -> dict[str, Any]:
    """The task section with its renamed options under their old names (the config hash)."""
    return {_TASK_HASHED_AS.get(k, k): v for k, v in task.items()}
