"""Before any model loads: the device and the packed cache's backend a config asks for exist on this machine, and the
backend reads the config's code formats. One-line `ConfigError`s; torch and the kernels are imported only when the
config needs them (a CUDA device, a kernel backend)."""

from __future__ import annotations

import os
import re
from dataclasses import replace

from kvq_lab.cache.config import CacheConfig
from kvq_lab.common.errors import ConfigError, QuantConfigError
from kvq_lab.quant.spec import DEFAULT_FORMAT


def check_device(device, cache: CacheConfig) -> None:
    """The device and the packed-mode backend exist on this machine (checked before the model loads)."""
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
    if cache.caps.fused_decode and cache.backend == "triton" and not device.startswith("cuda"):
        if os.environ.get("TRITON_INTERPRET") != "1":  # the interpreter runs Triton on CPU tensors (tests only)
            raise ConfigError(
                f"backend=triton runs on a GPU (device=cuda){'' if cuda else '; this machine has none'}: "
                "use backend=cpu or backend=torch, or device=cuda"
            )
    if cache.caps.fused_decode and cache.backend == "cpu":  # build (or find) the kernel now, not after the model load
        from kvq_lab.kernels.cpu_kernel import build_error

        err = build_error()
        if err is not None:
            raise ConfigError(f"backend=cpu: {err.splitlines()[0]}")
    check_backend_formats(cache)


def check_dtype(dtype, device, cache: CacheConfig) -> CacheConfig:
    """`model.dtype=float64` is the reference for checking the cache's semantics (no rounding difference large enough
    to flip a code): on the CPU, on the PyTorch path. Refused on CUDA and with the C or Triton kernels (they read fp32,
    fp16 and bf16); `backend=auto` picks torch for it. -> the cache, with that backend."""
    if dtype != "float64":
        return cache
    if str(device).startswith("cuda"):
        raise ConfigError("model.dtype=float64 is the CPU reference for checking; use device=cpu (or float32 on CUDA)")
    if cache.caps.kernels and cache.backend in ("cpu", "triton"):
        raise ConfigError(
            f"model.dtype=float64: backend={cache.backend} reads fp32, fp16 or bf16 models only; use backend=torch"
        )
    return replace(cache, backend="torch") if cache.backend == "auto" else cache


def check_backend_formats(cache: CacheConfig) -> None:
    """An explicit packed-mode backend reads every code format of the cache (a format may refuse a kernel);
    `auto` needs no check: it falls back to the PyTorch path with a warning."""
    specs = [s for s in (cache.key, cache.value) if not s.is_identity and s.format != DEFAULT_FORMAT]
    if not cache.caps.fused_decode or cache.backend not in ("cpu", "triton") or not specs:
        return
    from kvq_lab.cache.routing.backends import check_formats

    if cache.backend == "cpu":
        from kvq_lab.kernels import cpu_kernel  # noqa: F401  (declares the formats it reads)
    else:
        from kvq_lab.kernels import triton  # noqa: F401
    try:
        check_formats(cache.backend, specs)
    except QuantConfigError as e:
        raise ConfigError(str(e)) from None
