"""The user's contract: the run config schema and its validation.

Hydra composes `conf/` against `RunSchema` (registered as `kvq_schema`), so an unknown top-level key fails at
compose time. `validate(cfg)` then checks every value and turns the config into typed objects *before any
model loads*; each failure is a `ConfigError` whose one-line message names the key, the bad value and what
is allowed.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvq_lab.cache.config import BACKENDS, MODES, ROPE, CacheConfig
from kvq_lab.quant.spec import AXES, BITS, QuantConfigError, QuantSpec


class ConfigError(QuantConfigError):
    """A run setting is invalid. Raised before any model load; run.py prints it as one line and exits 2."""


@dataclass
class RunSchema:
    """Top-level knobs (see conf/config.yaml for defaults and meaning). Types are loose on purpose: `validate`
    gives every bad value the same one-line message, where OmegaConf's own type errors would span several."""

    key_axis: Any = "channel"
    value_axis: Any = "token"
    bits: Any = None  # sets key_bits and value_bits together when given
    key_bits: Any = 2
    value_bits: Any = 2
    group_size: Any = 32
    residual_length: Any = 0
    sink_tokens: Any = 0
    rope: Any = "post"
    mode: Any = "simulated"
    backend: Any = "auto"
    limit: Any = None
    seed: Any = 0
    batch_size: Any = 1
    probe: Any = False
    results_dir: Any = "results"
    data_dir: Any = None
    run_name: Any = None
    resume: Any = True
    device: Any = "cpu"
    experiment_name: Any = None
    model: dict[str, Any] = field(default_factory=dict)
    task: dict[str, Any] = field(default_factory=dict)
    logger: dict[str, Any] = field(default_factory=dict)
    probes: dict[str, Any] = field(default_factory=dict)  # probe settings (prompts, lengths), see conf/config.yaml


def register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="kvq_schema", node=RunSchema)


def _int(cfg, key: str, lo: int = 0, allow_none: bool = False, hint: str = "") -> int | None:
    v = cfg.get(key)
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        what = f"an integer >= {lo}" + (" or null" if allow_none else "")
        raise ConfigError(f"{key}={v!r} must be {what}{hint}")
    return v


def _choice(cfg, key: str, allowed) -> str:
    v = cfg.get(key)
    if v not in allowed:
        raise ConfigError(f"{key}={v!r} is not allowed; choose one of: {', '.join(map(str, allowed))}")
    return v


def _bits(cfg, key: str) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or v not in BITS:
        raise ConfigError(
            f"{key}={v!r} is not supported; choose one of: {', '.join(map(str, BITS))} (16 = no quantization)"
        )
    return v


def cache_config(cfg: DictConfig) -> CacheConfig:
    """The cache the run asks for, from the top-level knobs (validated, one-line errors)."""
    key_axis = _choice(cfg, "key_axis", AXES)
    value_axis = _choice(cfg, "value_axis", AXES)
    if cfg.get("bits") is not None:
        key_bits = value_bits = _bits(cfg, "bits")
    else:
        key_bits, value_bits = _bits(cfg, "key_bits"), _bits(cfg, "value_bits")
    g = _int(cfg, "group_size", lo=1, hint=" (e.g. 32)")
    _int(cfg, "residual_length", lo=0)
    _int(cfg, "sink_tokens", lo=0)
    rope = _choice(cfg, "rope", ROPE)
    mode = _choice(cfg, "mode", MODES)
    backend = _choice(cfg, "backend", BACKENDS)
    try:
        return CacheConfig(
            key=QuantSpec(key_bits, g, key_axis),
            value=QuantSpec(value_bits, g, value_axis),
            mode=mode,
            residual_length=cfg.residual_length,
            sink_tokens=cfg.sink_tokens,
            rope=rope,
            backend=backend,
        )
    except QuantConfigError as e:
        raise ConfigError(str(e)) from None


@dataclass
class RunPlan:
    """A validated run: what to build, where to write."""

    cache: CacheConfig
    task: str
    model: str
    results_dir: Path
    data_dir: Path | None
    limit: int | None
    config_hash: str


def data_dir(cfg: DictConfig) -> Path | None:
    d = cfg.get("data_dir") or os.environ.get("KVQ_DATA_DIR")
    if not d:
        return None
    p = Path(d).expanduser()
    if not p.is_dir():
        raise ConfigError(f"data_dir={str(d)!r} is not a folder; point data_dir= or KVQ_DATA_DIR at the data folder")
    return p.resolve()


# knobs that only build the cache: hashed through the CacheConfig they make, so `bits=2` and
# `key_bits=2 value_bits=2` (the same cache) are the same run
CACHE_KNOBS = (
    "key_axis",
    "value_axis",
    "bits",
    "key_bits",
    "value_bits",
    "group_size",
    "residual_length",
    "sink_tokens",
    "rope",
    "mode",
    "backend",
)


def config_hash(cfg: DictConfig, cache: CacheConfig | None = None) -> str:
    """Hash of what determines a run's result: everything except where it is written and how it is logged,
    with the cache knobs replaced by the cache they describe."""
    c = OmegaConf.to_container(cfg, resolve=True)
    for k in ("results_dir", "run_name", "logger", "resume", "experiment_name", "data_dir", *CACHE_KNOBS):
        c.pop(k, None)
    c["cache"] = asdict(cache if cache is not None else cache_config(cfg))
    if not cfg.get("probe"):
        c.pop("probes", None)  # probe settings only matter when probes run
    return hashlib.sha256(json.dumps(c, sort_keys=True, default=str).encode()).hexdigest()[:12]


def validate(cfg: DictConfig) -> RunPlan:
    """Check every knob and the task's inputs; no model is loaded. Raises ConfigError."""
    from kvq_lab.models import resolve
    from kvq_lab.tasks import TASKS

    cache = cache_config(cfg)
    if cache.mode == "packed" and cache.backend == "cpu":  # build (or find) the kernel now, not after the model load
        from kvq_lab.kernels.cpu_kernel import build_error

        err = build_error()
        if err is not None:
            raise ConfigError(f"backend=cpu: {err.splitlines()[0]}")
    for key in ("limit",):
        _int(cfg, key, lo=1, allow_none=True)
    _int(cfg, "seed", lo=0)
    _int(cfg, "batch_size", lo=1)
    if not isinstance(cfg.get("probe"), bool):
        raise ConfigError(f"probe={cfg.get('probe')!r} must be true or false")
    if cfg.probe:  # the probes' own settings, checked now rather than after a task has run
        from kvq_lab.probes.settings import ProbeSettings

        try:
            ProbeSettings.from_dict(OmegaConf.to_container(cfg.probes, resolve=True))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"probes: {e}") from None
    task_name = cfg.task.get("name")
    if task_name not in TASKS:
        raise ConfigError(f"task.name={task_name!r} is not a known task; choose one of: {', '.join(sorted(TASKS))}")
    model = cfg.model.get("path") or cfg.model.get("name")
    if not model:
        raise ConfigError("model.path is empty; use model=<name> (see conf/model/) or model.path=<hub id or folder>")
    if str(model).startswith((".", "/", "~")) and not Path(model).expanduser().exists():
        raise ConfigError(f"model.path={model!r} does not exist; give an existing folder, a .gguf file or a hub id")
    from kvq_lab.models import DTYPES

    if cfg.model.get("dtype", "float32") not in DTYPES:
        raise ConfigError(f"model.dtype={cfg.model.get('dtype')!r}; choose one of: {', '.join(DTYPES)}")
    try:
        resolve(str(model))
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    head_dim = cfg.model.get("head_dim")
    if head_dim:  # known without loading the model: check group tiling now
        try:
            cache.check_head_dim(int(head_dim))
        except QuantConfigError as e:
            raise ConfigError(str(e)) from None
    ddir = data_dir(cfg)
    TASKS[task_name].check(cfg, ddir)
    return RunPlan(
        cache=cache,
        task=task_name,
        model=str(model),
        results_dir=Path(cfg.results_dir),
        data_dir=ddir,
        limit=cfg.get("limit"),
        config_hash=config_hash(cfg, cache),
    )
