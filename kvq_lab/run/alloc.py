"""Keep freed memory in the process instead of handing it back to the OS (glibc malloc), for runs that allocate and
free many multi-MB tensors: a decode step's activations, the simulated cache's growing buffers, batch caches built
and rebuilt as rows join and leave (`kvq_lab.lmeval.wrapper`).

With glibc's defaults, blocks over a dynamic threshold (up to 32 MiB) are mapped from the OS and unmapped when
freed, and the top of the heap is trimmed when more than ~2x that is free: the next tensor of the same size maps
fresh pages, and the kernel faults and zeroes each 4 KiB page again. On the KIVI axis table at batch 8 that was
28.8 M minor page faults and ~7% of the CPU time in the kernel (experiments/kivi_axis_table/README.md). Raising the
thresholds keeps the pages mapped for reuse; the price is a resident size that stays at its peak.

Linux with glibc only; elsewhere (macOS, musl) nothing changes. Numerics do not depend on it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit): larger blocks are always mapped
TRIM_THRESHOLD = 1 << 30  # free memory kept at the top of the heap before trimming
TOP_PAD = 64 << 20  # extra room asked of the OS at each heap growth

_done: bool | None = None


def retain_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory (once per process) -> whether it took effect."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = [
        mallopt(p, v)
        for p, v in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
    ]
    _done = all(r == 1 for r in ok)
    return _done
