"""The preflight's checks of the run's own settings (the cache, model and fits check theirs): the results folder, the
run name, the data folder, a logger's keys, integers and flags. Each raises a one-line `ConfigError` naming the value
and the fix; `kvq_lab.preflight` runs them on the composed config (plain values) before anything loads."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

from kvq_lab.common.errors import ConfigError


def data_dir(cfg: Mapping) -> Path | None:
    d = cfg.get("data_dir") or os.environ.get("KVQ_DATA_DIR")
    if not d:
        return None
    p = Path(d).expanduser()
    if not p.is_dir():
        raise ConfigError(f"data_dir={str(d)!r} is not a folder; point data_dir= or KVQ_DATA_DIR at the data folder")
    return p.resolve()


LOGGER_KEYS = {"wandb": ("name", "project", "entity", "mode", "group"), "none": ("name",)}
WANDB_MODES = (None, "offline", "online", "disabled")
MIN_FREE = 1 << 20  # bytes a results folder's disk must have free before a run starts (records, index, claims)


def integer(c: Mapping, key: str, lo: int = 0, allow_none: bool = False) -> int | None:
    v = c.get(key)
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConfigError(f"{key}={v!r} must be an integer >= {lo}" + (" or null" if allow_none else ""))
    return v


def flag(c: Mapping, key: str) -> bool:
    v = c.get(key)
    if not isinstance(v, bool):
        raise ConfigError(f"{key}={v!r} must be true or false")
    return v


def check_keys(section: str, d, allowed) -> None:
    unknown = sorted(set(d.keys()) - set(allowed))
    if unknown:
        raise ConfigError(f"{section}.{unknown[0]} is not a setting of {section}; allowed: {', '.join(allowed)}")


def check_paths(cfg: Mapping) -> Path:
    """results_dir and run_name can be made into folders here (nothing is created yet)."""
    rd = cfg.get("results_dir")
    if not isinstance(rd, str) or not rd.strip():
        raise ConfigError(f"results_dir={rd!r} must be a folder path, e.g. results_dir=results")
    p = Path(rd).expanduser()
    if p.exists() and not p.is_dir():
        raise ConfigError(f"results_dir={rd!r} exists and is not a folder; choose another results_dir")
    probe = p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"results_dir={rd!r}: {probe} is not a writable folder; choose another results_dir")
    free = shutil.disk_usage(probe).free
    if free < MIN_FREE:
        raise ConfigError(
            f"results_dir={rd!r}: its disk is full ({free // 1024} KiB free, a run needs at least "
            f"{MIN_FREE // 1024 // 1024} MiB for its record); free some space or choose another results_dir"
        )
    name = cfg.get("run_name")
    if name is not None:
        if (
            not isinstance(name, str)
            or not name.strip()
            or name in (".", "..")
            or any(c in name for c in "/\\\0")
            or len(name.encode()) > 200
        ):
            raise ConfigError(
                f"run_name={name!r} cannot be a folder name; use letters, digits, '-', '_' or '.' (at most 200 bytes)"
            )
    exp = cfg.get("experiment_name")
    if exp is not None and (not isinstance(exp, str) or not re.fullmatch(r"[\w.-]+", exp)):
        raise ConfigError(f"experiment_name={exp!r} must be a plain name (letters, digits, '-', '_', '.')")
    return p
