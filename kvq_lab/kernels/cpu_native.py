"""The CPU kernel library's helpers besides decode attention, one native call each where PyTorch takes several ops:
the caches' check that every new key and value is finite (`all_finite`), and the Walsh-Hadamard transform of the
`hadamard` transform (`fwht`, `fwht_pair`, registered with it for CPU tensors). Same library as `cpu_kernel`
(`cpu_build.load`: built on first use). `all_finite` is the CPU backend's, which loads the library when a cache is
made; where the library does not build, `fwht` and `fwht_pair` decline (None) and the hadamard transform computes in
PyTorch.
"""

from __future__ import annotations

import array

import torch

from kvq_lab.quant.transforms.hadamard import register_fast

from . import cpu_build, torch_path

__all__ = ["all_finite", "fwht", "fwht_pair"]


def all_finite(*tensors: torch.Tensor) -> bool:
    """`torch_path.all_finite`'s twin: whether no element is NaN or inf, read from the exponent bits in one native call
    per dense fp32 / fp16 / bf16 CPU tensor (exact); other tensors are summed in PyTorch. The caches check every new
    key and value with it, per layer and step: two PyTorch sums and conversions cost more there than the C call."""
    fn = cpu_build.load().kvq_any_nonfinite
    for t in tensors:
        code = cpu_build.DTYPES.get(t.dtype)
        if code is None or not t.is_cpu or not _dense(t):
            if not torch_path.all_finite(t):
                return False
        elif fn(t.data_ptr(), t.numel(), code):
            return False
    return True


def fwht(x: torch.Tensor, n: int, scale: float) -> torch.Tensor | None:
    """`hadamard.fwht(x, n) * scale` in x's dtype as a new contiguous tensor, the same bits, in one native call that
    reads x where it is (fp32, fp16 or bf16 CPU, up to 4 dims, the last one unit-stride: e.g. the projections'
    transposed keys and values). None where it cannot (other tensors, or the kernel does not build here): the caller
    computes it in PyTorch. Registered with the hadamard transform (`hadamard.register_fast`), where a PyTorch copy
    and an in-place call cost about four times as much. The call's integer arguments go as one block
    (`kvq_fwht_blocks`), their layout part kept per dtype, shape, strides and n."""
    layout = _fwht_layout(x, n)
    if layout is None:
        return None
    y = _F32.new_empty(x.shape)
    _fwht_blocks(scale, x.data_ptr(), y.data_ptr(), *layout)
    return y if layout[0] == 0 else y.to(x.dtype)


def fwht_pair(
    a: torch.Tensor, b: torch.Tensor, n: int, scale: float, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(`fwht(a, n, scale)`, `fwht(b, n, scale)`), the same bits, in one native call: a layer's new key and value
    under one hadamard pipeline, every layer and decode step (two calls cost about twice one in the model). a and b
    of the same dtype and shape; None where `fwht` would give None for either. With `out` (two fp32 tensors of a's
    shape, rows unit-stride: the rows of the cache's window buffers the token goes to) and fp32 a and b, written
    there and `out` returned: no new tensor, and nothing for the cache to copy; else one allocation for both."""
    if a.dtype is not b.dtype or a.shape != b.shape:
        return None
    la, lb = _fwht_layout(a, n), _fwht_layout(b, n)
    if la is None or lb is None:
        return None
    if out is not None and la[0] == 0 and _fp32_rows(out[0], a) and _fp32_rows(out[1], a):
        ya, yb = out
        _fwht_blocks(scale, a.data_ptr(), ya.data_ptr(), *la[:9], *_lead_strides(ya),
                     b.data_ptr(), yb.data_ptr(), *lb[:9], *_lead_strides(yb))  # fmt: skip
        return out
    y = _F32.new_empty((2, *a.shape))
    p = y.data_ptr()
    _fwht_blocks(scale, a.data_ptr(), p, *la, b.data_ptr(), p + 4 * a.numel(), *lb)
    return (y if la[0] == 0 else y.to(a.dtype)).unbind(0)


def _fwht_blocks(scale: float, *fields: int) -> None:
    """One `kvq_fwht_blocks` call over the consecutive blocks of 14 integers in `fields` (src, dst, then a layout of
    `_fwht_layout` with its output strides)."""
    block = array.array("q", fields)  # lives until the call returns
    cpu_build.load().kvq_fwht_blocks(block.buffer_info()[0], len(fields) // 14, scale)


def _fp32_rows(y: torch.Tensor, like: torch.Tensor) -> bool:
    """y can take `fwht(like)`'s rows in place: fp32 on the CPU, like's shape, unit-stride rows."""
    return y.dtype is torch.float32 and y.is_cpu and y.shape == like.shape and y.stride(-1) == 1


def _lead_strides(y: torch.Tensor) -> tuple[int, ...]:
    """t0, t1, t2 of `kvq_fwht_blocks`' block: y's strides over up to three leading dims (as `_fwht_layout`)."""
    return (0,) * (4 - y.dim()) + y.stride()[:-1]


_FWHT_LAYOUTS: dict = {}
_F32 = torch.empty(0, dtype=torch.float32)  # `new_empty` from it: fp32 whatever the default dtype, without kwargs


def _fwht_layout(x: torch.Tensor, n: int) -> tuple[int, ...] | None:
    """dtype, n0, n1, n2, s0, s1, s2, D, n, t0, t1, t2 of `kvq_fwht_blocks`' block for x (its rows as up to three
    leading dims with their strides; t: the strides of a new contiguous output), kept per dtype, shape, strides and
    n; None where the native transform cannot take x."""
    if cpu_build.failed() or not x.is_cpu:
        return None
    key = (x.dtype, x.shape, x.stride(), n)
    layout = _FWHT_LAYOUTS.get(key, False)
    if layout is False:
        layout = _FWHT_LAYOUTS[key] = _new_fwht_layout(x, n)
        if len(_FWHT_LAYOUTS) > 256:  # one per prompt length at prefill: keep the dict small
            _FWHT_LAYOUTS.clear()
    return layout


def _new_fwht_layout(x: torch.Tensor, n: int) -> tuple[int, ...] | None:
    code = cpu_build.DTYPES.get(x.dtype)
    if code is None or x.dim() > 4 or (x.numel() and x.stride(-1) != 1):
        return None
    try:
        cpu_build.load()
    except cpu_build.KernelBuildError:
        return None
    pad = 4 - x.dim()
    lead, strides = (1,) * pad + x.shape[:-1], (0,) * pad + x.stride()[:-1]
    D = x.shape[-1]
    return (code, *lead, *strides, D, n, lead[1] * lead[2] * D, lead[2] * D, D)


register_fast("cpu", fwht, fwht_pair)


def _dense(t: torch.Tensor) -> bool:
    """t's elements fill numel() consecutive slots from data_ptr() in some order (contiguous, or a permutation of it:
    the projections' [B, n, H, D] outputs seen as [B, H, n, D])."""
    if t.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda p: p[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True
