"""`backend=cpu`: the packed cache's decode attention as one native call per layer and step (cpu_kernel.c).

Why: the PyTorch path must dequantize the whole history into a buffer every step, in ~20 small ATen ops per
layer; at short contexts those ops' fixed cost (not the arithmetic) is what separates it from an fp cache. The
kernel reads the packed codes directly (each history row dequantized once into D floats on the stack) and does
scores, softmax and the weighted sum in one call. Quantization and storage are the PyTorch path's (same bits).

Built on first use with the system C compiler (`$CC`, else `cc`) into `$KVQ_KERNEL_CACHE` (default
~/.cache/kvq_lab/kernels), keyed by the source's hash and the flags; later loads take milliseconds. Loaded with
ctypes: no PyTorch headers, so the build takes about a second. Flags: -O3, -march=native where the compiler
accepts it, -ffp-contract=off (the dequantization `code * scale + zero` keeps the reference's two roundings),
-fopenmp-simd (vectorised reductions, no OpenMP runtime: the kernel runs on the calling thread).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kvq_lab.quant.pack import BLOCK, word_layout

SOURCE = Path(__file__).with_name("cpu_kernel.c")
FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]

STREAM_FIELDS = (
    "out codes scale zero cb ch cr pb ph pt n bits nb m group token_axis win wb wh wt W w sink sb sh st".split()
)
ARG_FIELDS = "B H D N s".split()
N_FIELDS = len(ARG_FIELDS) + 2 * len(STREAM_FIELDS)
MAX_D = 1024  # KVQ_MAX_D in the C source


class KernelBuildError(RuntimeError):
    """The CPU kernel could not be compiled or loaded; the message says what to install or choose instead."""


def cache_dir() -> Path:
    return Path(os.environ.get("KVQ_KERNEL_CACHE", Path.home() / ".cache" / "kvq_lab" / "kernels"))


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
            cmd = [cc, *FLAGS, *arch, str(SOURCE), "-o", str(tmp_so), "-lm"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode == 0:
                os.replace(tmp_so, out)  # atomic: concurrent builders never load a half-written file
                return
            errors.append(f"$ {' '.join(cmd)}\n{proc.stderr.strip()}")
    raise KernelBuildError("building the CPU kernel failed (set backend=torch to run without it):\n" + "\n".join(errors))


_LIB = None


def load() -> ctypes.CDLL:
    """The compiled kernel (built once per source version and machine, then loaded from the cache dir)."""
    global _LIB
    if _LIB is None:
        key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
        so = cache_dir() / f"cpu_kernel-{key}.so"
        if not so.exists():
            _compile(so)
        lib = ctypes.CDLL(str(so))
        lib.kvq_args_size.restype = ctypes.c_int64
        if lib.kvq_args_size() != 8 * N_FIELDS:
            raise KernelBuildError(f"{so} does not match this kvq_lab version (argument block size); delete it")
        lib.kvq_assemble.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        lib.kvq_assemble.restype = None
        _LIB = lib
    return _LIB


def available() -> bool:
    """True when the kernel builds and loads here (used by `backend=auto`)."""
    try:
        load()
    except (KernelBuildError, OSError):
        return False
    return True


_ARGS = (ctypes.c_int64 * N_FIELDS)()


def _stream_fields(layer, stream, sink: torch.Tensor, out: torch.Tensor) -> list[int]:
    """The C `Stream` of one tensor: output workspace, packed history (if any), fp32 window buffer and sinks."""
    n, win = layer._segments(stream)
    st, spec = stream.store, stream.spec
    if st.codes is not None and n:
        c, s, z = st.codes, st.scale, st.zero
        hist = [c.data_ptr(), s.data_ptr(), z.data_ptr(), c.stride(0), c.stride(1), c.stride(2)]
        hist += [s.stride(0), s.stride(1), s.stride(2), n]
    else:
        hist = [0] * 9 + [0]
    u, nb = word_layout(spec.bits)
    layout = [spec.bits, nb, BLOCK // u, spec.group_size, int(spec.axis == "token")]
    buf = stream.window  # win is its last w rows
    window = [buf.data_ptr(), buf.stride(0), buf.stride(1), buf.stride(2), buf.shape[2], win.shape[2]]
    sinks = [sink.data_ptr(), sink.stride(0), sink.stride(1), sink.stride(2)]
    return [out.data_ptr(), *hist, *layout, *window, *sinks]


def assemble(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's fp32 K and V [B, H, N, D] of a uniform-row packed layer (rope=post), in the shared workspaces:
    the same values as `kvq_lab.cache.packed._assemble`, bit for bit, in one native call."""
    from kvq_lab.cache.packed import _workspace

    sk, sv = layer.sink_k, layer.sink_v
    B, H, _, D = sk.shape
    N, S = layer.N, min(layer.cfg.sink_tokens, layer.N)
    k = _workspace("k", B * H * N * D, sk.device).view(B, H, N, D)
    v = _workspace("v", B * H * N * D, sk.device).view(B, H, N, D)
    _ARGS[:] = [B, H, D, N, S, *_stream_fields(layer, layer.k_stream, sk, k),
                *_stream_fields(layer, layer.v_stream, sv, v)]  # fmt: skip
    load().kvq_assemble(ctypes.addressof(_ARGS), torch.get_num_threads())
    return k, v


def supports(layer, query: torch.Tensor) -> bool:
    """The kernel reads fp32 sinks and windows (an fp32 model on the CPU) and post-RoPE keys; rope=pre re-rotates
    dequantized keys, and other dtypes, devices or head sizes take the PyTorch path (same results)."""
    return (
        layer.rope is None
        and query.device.type == "cpu"
        and layer.sink_k.dtype == torch.float32
        and query.shape[-1] <= MAX_D
    )


def decode_attention(layer, query: torch.Tensor, mask, scaling: float) -> torch.Tensor:
    """`decode_attention_torch` with K/V assembled by the kernel: the same output, bit for bit."""
    from kvq_lab.cache.packed import attend, decode_attention_torch

    if not supports(layer, query):
        return decode_attention_torch(layer, query, mask, scaling)
    k, v = assemble(layer)
    return attend(query, k, v, mask, scaling)
