"""One run key, one number: the CPU's matrix products computed the same way whatever the thread count and wherever
the weights sit in memory.

PyTorch's CPU matmuls go to Intel MKL (x86 builds), whose default code path splits a product's reduction by the
number of threads and picks kernels by the operands' alignment. Measured on SmolLM2-135M (2-bit K-C/V-T, task=ppl,
64+16 tokens, one window): ppl 20.83 with 2 threads and 19.64 with 1 on the memory-mapped safetensors copy (every
parameter at address % 64 == 40), 20.33 and 19.91 on the same weights copied to fresh 64-byte aligned memory: a
product's ~1e-6 differences flip 2-bit codes. MKL's strict Conditional Numerical Reproducibility mode (CNR,
`MKL_CBWR=AUTO,STRICT`) makes its GEMM bitwise reproducible across thread counts and alignment: all four runs above
then give 19.9498 (and the same held for packed mode, the C kernel, 16 bits, float16 and bfloat16 at 1, 2 and 3
threads). What remains is the processor: MKL still picks its code branch by instruction set (a specific branch such
as AVX2 is refused on AMD processors), so two processors may differ in the last bits, as two GPU models do.

MKL takes the mode only before its first call in the process: `pin_blas` is called where validation starts and
where a model loads, before any product. Where that is too late (MKL was used earlier in the process, e.g. a test
session), or no MKL is linked (other builds: macOS, ARM), the numbers may depend on the thread count: the run key
then carries it (`unpinned_inputs`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

# mkl_service.h
MKL_CBWR_ALL = -1
MKL_CBWR_AUTO = 2
MKL_CBWR_STRICT = 0x10000
MKL_CBWR_SUCCESS = 0

PINNED = "mkl AUTO,STRICT"  # the mode every run is meant to compute in
_state: str | None = None


def _mkl():
    """MKL's service functions as PyTorch links them (statically, into libtorch_cpu), or None where it has none."""
    import torch

    lib_dir = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        try:
            lib = ctypes.CDLL(str(lib_dir / name))
            get, put = lib.mkl_serv_cbwr_get, lib.mkl_serv_cbwr_set
        except (OSError, AttributeError):
            continue
        get.argtypes, get.restype = [ctypes.c_int], ctypes.c_int
        put.argtypes, put.restype = [ctypes.c_int], ctypes.c_int
        return get, put
    return None


def pin_blas() -> str:
    """Put MKL in strict CNR mode (once per process) -> the mode in effect: `PINNED`; `mkl branch <n>,STRICT` where
    MKL_CBWR in the environment chose another branch; `mkl unpinned (...)` where MKL had been used before (the mode
    cannot change then); `no mkl` where PyTorch links none."""
    global _state
    if _state is not None:
        return _state
    import torch

    fns = _mkl() if torch.backends.mkl.is_available() else None
    if fns is None:
        _state = "no mkl"
        return _state
    get, put = fns
    if put(MKL_CBWR_AUTO | MKL_CBWR_STRICT) == MKL_CBWR_SUCCESS or get(MKL_CBWR_ALL) == MKL_CBWR_AUTO | MKL_CBWR_STRICT:
        _state = PINNED
    elif get(MKL_CBWR_ALL) & MKL_CBWR_STRICT:
        _state = f"mkl branch {get(MKL_CBWR_ALL) & 0xFFFF},STRICT"
    else:
        _state = "mkl unpinned (MKL was called before kvq_lab could set its reproducible mode)"
    return _state


def unpinned_inputs() -> dict:
    """What the run key must add when the products are not pinned (`pin_blas` is not `PINNED`): the mode, and where
    it is not strict the thread count, which then changes the numbers; {} when pinned (the run keys of records made
    before stay)."""
    state = pin_blas()
    if state == PINNED:
        return {}
    if state.endswith("STRICT"):
        return {"blas": state}
    import torch

    return {"blas": state, "threads": torch.get_num_threads()}
