"""Checks of the run settings that need no model: the model path, the device and backend, the folders, the
data folder. Each raises a one-line `ConfigError` naming the value and the fix; `kvq_lab.config.validate` calls them
before anything loads."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from kvq_lab.cache.config import CacheConfig
from kvq_lab.errors import ConfigError
from kvq_lab.quant.spec import DEFAULT_FORMAT, QuantConfigError


def data_dir(cfg: DictConfig) -> Path | None:
    d = cfg.get("data_dir") or os.environ.get("KVQ_DATA_DIR")
    if not d:
        return None
    p = Path(d).expanduser()
    if not p.is_dir():
        raise ConfigError(f"data_dir={str(d)!r} is not a folder; point data_dir= or KVQ_DATA_DIR at the data folder")
    return p.resolve()


def _bool(cfg, key: str) -> bool:
    v = cfg.get(key)
    if not isinstance(v, bool):
        raise ConfigError(f"{key}={v!r} must be true or false")
    return v


MODEL_KEYS = ("name", "path", "dtype", "head_dim", "revision")
LOGGER_KEYS = {"wandb": ("name", "project", "entity", "mode", "group"), "none": ("name",)}
WANDB_MODES = (None, "offline", "online", "disabled")
MIN_FREE = 1 << 20  # bytes a results folder's disk must have free before a run starts (records, index, claims)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _check_keys(section: str, d, allowed) -> None:
    unknown = sorted(set(d.keys()) - set(allowed))
    if unknown:
        raise ConfigError(f"{section}.{unknown[0]} is not a setting of {section}; allowed: {', '.join(allowed)}")


def check_model(cfg: DictConfig) -> str:
    """The model to load (registry name, hub id, folder or GGUF file), checked without loading anything."""
    from kvq_lab.models import DTYPES, resolve

    _check_keys("model", cfg.model, MODEL_KEYS)
    if OmegaConf.is_missing(cfg.model, "path"):
        raise ConfigError(
            f"model={cfg.model.get('name')} needs model.path=<hub id, local folder or .gguf file>, "
            "e.g. model=hub model.path=HuggingFaceTB/SmolLM2-135M-Instruct"
        )
    model = cfg.model.get("path") or cfg.model.get("name")
    if not model or not isinstance(model, str):
        raise ConfigError("model.path is empty; use model=<name> (see conf/model/) or model.path=<hub id or folder>")
    if cfg.model.get("dtype", "float32") not in DTYPES:
        raise ConfigError(f"model.dtype={cfg.model.get('dtype')!r}; choose one of: {', '.join(DTYPES)}")
    try:
        src = resolve(model)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    p = Path(src).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ConfigError(f"model.path={model!r} is a folder without config.json; give a saved model folder")
    elif p.is_file():
        with p.open("rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ConfigError(
                f"model.path={model!r} is a file but not a GGUF model; give a model folder, a .gguf file or a hub id"
            )
    elif str(model).startswith((".", "/", "~")):
        raise ConfigError(f"model.path={model!r} does not exist; give an existing folder, a .gguf file or a hub id")
    elif not HUB_ID.match(str(model)):
        raise ConfigError(
            f"model.path={model!r} is neither an existing local path nor a hub id (org/name); check the spelling"
        )
    return model


def check_device(cfg: DictConfig, cache: CacheConfig) -> None:
    """The device and the packed-mode backend exist on this machine (checked before the model loads)."""
    device = cfg.get("device")
    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ConfigError(f"device={device!r} is not supported; choose cpu, cuda or cuda:<index>")
    cuda = False
    if device.startswith("cuda") or cache.backend == "triton":
        import torch

        cuda = torch.cuda.is_available()
        if device.startswith("cuda"):
            n = torch.cuda.device_count() if cuda else 0
            index = int(device.split(":")[1]) if ":" in device else 0
            if index >= n:
                raise ConfigError(f"device={device}: this machine has {n} CUDA device(s); use device=cpu")
    if cache.mode == "packed" and cache.backend == "triton" and not device.startswith("cuda"):
        if os.environ.get("TRITON_INTERPRET") != "1":  # the interpreter runs Triton on CPU tensors (tests only)
            raise ConfigError(
                f"backend=triton runs on a GPU (device=cuda){'' if cuda else '; this machine has none'}: "
                "use backend=cpu or backend=torch, or device=cuda"
            )
    if cache.mode == "packed" and cache.backend == "cpu":  # build (or find) the kernel now, not after the model load
        from kvq_lab.kernels.cpu_kernel import build_error

        err = build_error()
        if err is not None:
            raise ConfigError(f"backend=cpu: {err.splitlines()[0]}")
    check_backend_formats(cache)


def check_backend_formats(cache: CacheConfig) -> None:
    """An explicit packed-mode backend reads every code format of the cache (a format may refuse a kernel);
    `auto` needs no check: it falls back to the PyTorch path with a warning."""
    specs = [s for s in (cache.key, cache.value) if not s.is_identity and s.format != DEFAULT_FORMAT]
    if cache.mode != "packed" or cache.backend not in ("cpu", "triton") or not specs:
        return
    from kvq_lab.cache.backends import check_formats

    if cache.backend == "cpu":
        from kvq_lab.kernels import cpu_kernel  # noqa: F401  (declares the formats it reads)
    else:
        from kvq_lab.kernels import triton  # noqa: F401
    try:
        check_formats(cache.backend, specs)
    except QuantConfigError as e:
        raise ConfigError(str(e)) from None


def check_paths(cfg: DictConfig) -> Path:
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
