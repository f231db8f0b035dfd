"""The CPU kernel library (cpu_kernel.c): built, cached, verified and loaded, and the C declarations Python relies on.

One shared library holds decode attention (`cpu_kernel`) and the native helpers (`cpu_native`); both load it here.

Built on first use with the system C compiler (`$CC`, else cc, gcc or clang) into `$KVQ_KERNEL_CACHE` (default
~/.cache/kvq_lab/kernels), keyed by the source, the flags and the CPU, with its digest beside it; later loads verify
the digest and take milliseconds (a truncated or changed library is named and rebuilt, never loaded). Loaded with
ctypes (no PyTorch headers: the build takes about a second). Flags: -O3, -march=native where the compiler takes
it, -ffp-contract=off (the dequantization `table[code] * scale + zero` keeps the reference's two roundings),
-fno-trapping-math (no value changes; lets the compiler vectorise the softmax's floor and selects),
-Werror=implicit-function-declaration (a call to an undefined function fails the build, not the load), -fopenmp
(linked against the libgomp PyTorch has already loaded, so the kernel shares PyTorch's thread pool), and any in
`$KVQ_KERNEL_CFLAGS`.

The library's interface as Python sees it: each function's ctypes signature (declared on load), the C structs
`Args` and `Stream` as int64 fields in order (`ARG_FIELDS`, `STREAM_FIELDS`: their size is checked against the
library's own on load, so a library from another version is refused, never called with shifted fields), and the
dtype codes (`DTYPES`).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kvq_lab.common import integrity

SOURCE = Path(__file__).with_name("cpu_kernel.c")
FLAGS = [
    "-O3", "-ffp-contract=off", "-fno-trapping-math", "-Werror=implicit-function-declaration", "-fopenmp", "-shared",
    "-fPIC",
]  # fmt: skip
# `Stream.xdt` (the model's dtype), and the dtype argument of the native helpers (`cpu_native`)
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

# the C structs `Args` and `Stream`, every field an int64 (pointers as addresses), in this order
STREAM_FIELDS = (
    "codes scale zero table cb ch cr pb ph pt n bits nb m group token_axis win wb wh wt W w sink sb sh st xdt".split()
    + ["starts", "counts"]
)
ARG_FIELDS = "q qb qh out ob oh mask mb partial B Hq Hkv D N s chunk rcos rsin P pos pb pads qn on".split()
N_FIELDS = len(ARG_FIELDS) + 2 * len(STREAM_FIELDS)


class KernelBuildError(RuntimeError):
    """The CPU kernel could not be compiled or loaded; the message says what to install or choose instead."""


def cache_dir() -> Path:
    return Path(os.environ.get("KVQ_KERNEL_CACHE", Path.home() / ".cache" / "kvq_lab" / "kernels"))


def _cpu_id() -> str:
    """What -march=native depends on: the machine type and, on Linux, the CPU's feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine() + flags


def _flags() -> list[str]:
    """FLAGS plus `$KVQ_KERNEL_CFLAGS` (e.g. `-DKVQ_PORTABLE`: plain C only, the fp16 conversion and the table
    formats' lookups without x86 intrinsics)."""
    return FLAGS + os.environ.get("KVQ_KERNEL_CFLAGS", "").split()


def _compile(out: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise KernelBuildError(
            "backend=cpu needs a C compiler (none of $CC, cc, gcc, clang found): install gcc, or set backend=torch"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for arch in (["-march=native"], []):  # some compilers (or CPUs) refuse -march=native
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_so = Path(tmp) / out.name
            cmd = [cc, *_flags(), *arch, str(SOURCE), "-o", str(tmp_so), "-lm"]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True)
            except OSError as e:  # $CC names something that cannot run
                msg = f"cannot run the C compiler {cc!r} ({e}); install gcc, or set backend=torch"
                raise KernelBuildError(msg) from e
            if proc.returncode == 0:
                os.replace(tmp_so, out)  # atomic: a concurrent builder never loads a half-written file
                return
            errors.append(f"$ {' '.join(cmd)}\n{proc.stderr.strip()}")
    msg = "building the CPU kernel failed (set backend=torch to run without it):\n"
    raise KernelBuildError(msg + "\n".join(errors))


_LIB = None
_ERROR: KernelBuildError | None = None  # a failed build is not retried in the same process


def load() -> ctypes.CDLL:
    """The compiled kernel (built once per source version, flags and CPU, then loaded from the cache dir)."""
    global _LIB, _ERROR
    if _ERROR is not None:
        raise _ERROR
    if _LIB is None:
        try:
            _LIB = _build_and_load()
        except (KernelBuildError, OSError) as e:
            _ERROR = e if isinstance(e, KernelBuildError) else KernelBuildError(f"loading the CPU kernel failed: {e}")
            raise _ERROR from None
    return _LIB


def _built() -> Path:
    """The compiled library for this source, flags and CPU, verified against the digest written beside it when it
    was built (a truncated or changed file would crash the process on load: it is named in one line and rebuilt).
    Builders of one library take turns (a lock file), so none sees another's half-sealed build."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(_flags()).encode() + _cpu_id().encode()).hexdigest()[:16]
    so = cache_dir() / f"cpu_kernel-{key}.so"
    so.parent.mkdir(parents=True, exist_ok=True)
    with open(so.with_name(so.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if so.exists():
            try:
                integrity.verify_file(so)
                return so
            except integrity.Corrupt as e:
                integrity.note_rebuild(e)
                integrity.remove(so)
        _compile(so)
        integrity.seal_file(so)
    return so


def _build_and_load() -> ctypes.CDLL:
    so = _built()
    lib = ctypes.CDLL(str(so))
    lib.kvq_args_size.restype = ctypes.c_int64
    if lib.kvq_args_size() != 8 * N_FIELDS:
        raise KernelBuildError(f"{so} does not match this kvq_lab version (argument block size); delete it")
    lib.kvq_decode_attention.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float]
    lib.kvq_decode_attention.restype = ctypes.c_int64  # rope=pre key rows outside the table (0: valid)
    lib.kvq_any_nonfinite.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    lib.kvq_any_nonfinite.restype = ctypes.c_int64
    lib.kvq_fwht_blocks.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float]
    lib.kvq_fwht_blocks.restype = None
    if hasattr(lib, "kvq_fp8_decoding"):  # what the build's table lookups use (tests); a probe's older source has none
        lib.kvq_simd_width.restype = ctypes.c_int64
        lib.kvq_fp8_decoding.argtypes = [ctypes.c_int64]
        lib.kvq_fp8_decoding.restype = ctypes.c_int64
    return lib


def failed() -> bool:
    """Whether building or loading the kernel already failed in this process (it is not retried): a check that
    builds nothing, for callers that take another path then (`cpu_native.fwht`)."""
    return _ERROR is not None


def build_error() -> str | None:
    """None when the kernel builds and loads here, else why not (`backend=auto` then takes the PyTorch path)."""
    try:
        load()
    except KernelBuildError as e:
        return str(e)
    return None
