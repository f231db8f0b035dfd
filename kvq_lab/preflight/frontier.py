"""The frontier search's own settings (`frontier.*`, conf/experiment/frontier.yaml), checked before anything loads.

`settings(given)` fills the defaults (the yaml's `frontier:` section, their one place) and refuses a bad value in
one line naming the key, the value and what is allowed; `check_budgets(budgets, cheapest)` refuses a budget no
enumerated candidate fits under (the enumeration counts every candidate's stored bits from the model's files first:
`kvq_lab.frontier.candidates`). The driver (`kvq_lab.frontier.driver`) calls both before the model loads.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from kvq_lab.common.errors import ConfigError

FRONTIER_YAML = Path(__file__).resolve().parents[2] / "conf" / "experiment" / "frontier.yaml"


@cache
def defaults() -> dict[str, Any]:
    """`frontier:` of conf/experiment/frontier.yaml: every setting, its default and its meaning (one place)."""
    return yaml.safe_load(FRONTIER_YAML.read_text())["frontier"]


SOURCES = ("preset", "grid", "policy", "search", "engine")
STAGES = ("screen", "rank", "confirm")


def _merge(base: dict, given: Mapping, where: str = "frontier") -> dict:
    out = copy.deepcopy(base)
    for k, v in given.items():
        if k not in base:
            raise ConfigError(f"{where}.{k} is not a frontier setting; choose from: {', '.join(base)}")
        out[k] = _merge(base[k], v, f"{where}.{k}") if isinstance(base[k], dict) and isinstance(v, Mapping) else v
    return out


def _number(v, key: str, lo: float = 0.0, integer: bool = False) -> float:
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > lo
    if not ok or (integer and int(v) != v):
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"{key}={v!r} must be {kind} > {lo:g}")
    return int(v) if integer else float(v)


def settings(given: Mapping | None) -> dict[str, Any]:
    """`frontier.*` with its defaults, checked (one-line ConfigError)."""
    s = _merge(defaults(), dict(given or {}))
    budgets = s["budgets"]
    if isinstance(budgets, int | float) and not isinstance(budgets, bool):
        budgets = [budgets]
    if not isinstance(budgets, list | tuple) or not budgets:
        raise ConfigError(f"frontier.budgets={budgets!r} must be a list of stored bits per element, e.g. [3,4.5,8.5]")
    s["budgets"] = sorted(_number(b, "frontier.budgets") for b in budgets)
    if s["max_candidates"] is not None:
        s["max_candidates"] = _number(s["max_candidates"], "frontier.max_candidates", 0.5, integer=True)
    if s["max_minutes"] is not None:
        s["max_minutes"] = _number(s["max_minutes"], "frontier.max_minutes")
    s["keep"] = _number(s["keep"], "frontier.keep", 0.5, integer=True)
    if s["correlate"] != "all":
        s["correlate"] = 0 if s["correlate"] == 0 else _number(s["correlate"], "frontier.correlate", 0.5, True)
    for key, allowed in (("sources", SOURCES), ("stages", STAGES)):
        bad = [x for x in s[key] if x not in allowed]
        if bad or (not s[key] and key == "sources"):  # stages=[]: a refresh (kvq_lab/frontier/driver.py)
            raise ConfigError(f"frontier.{key}={s[key]!r}; choose among: {', '.join(allowed)}")
    s["screen"]["prompts"] = _number(s["screen"]["prompts"], "frontier.screen.prompts", 0.5, True)
    s["screen"]["tokens"] = _number(s["screen"]["tokens"], "frontier.screen.tokens", 8, True)
    for k in ("windows", "context_tokens", "eval_tokens"):
        s["rank"][k] = _number(s["rank"][k], f"frontier.rank.{k}", 0.5, True)
    if s["rank"]["eval_tokens"] < 16:
        raise ConfigError(f"frontier.rank.eval_tokens={s['rank']['eval_tokens']} must be >= 16 (16 blocks of SE)")
    s["confirm"]["limit"] = _number(s["confirm"]["limit"], "frontier.confirm.limit", 0.5, True)
    s["confirm"]["max"] = _number(s["confirm"]["max"], "frontier.confirm.max", 0.5, True)
    for k in STAGES:
        s["seconds"][k] = _number(s["seconds"][k], f"frontier.seconds.{k}")
        s["shares"][k] = _number(s["shares"][k], f"frontier.shares.{k}")
    return s


def check_budgets(budgets: list[float], cheapest: float | None, model: str) -> None:
    """Every budget must hold at least one candidate: the cheapest one stores `cheapest` bits per element on
    `model` (None: no candidate at all)."""
    if cheapest is None:
        raise ConfigError(f"frontier: no candidate is valid on model={model}; check frontier.sources")
    low = [b for b in budgets if b < cheapest]
    if low:
        raise ConfigError(
            f"frontier.budgets: {low[0]:g} is below the smallest candidate, which stores {cheapest:.4g} bits per "
            f"element on model={model}; use budgets >= {math.ceil(cheapest * 1000) / 1000:g}"
        )
