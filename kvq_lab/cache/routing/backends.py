"""Backend selection for the packed cache: which kernels quantize, dequantize and attend (`CacheConfig.backend`).

A backend is a namespace with one protocol (`Backend`); the cache calls these and nothing else of the kernels:
    write(store, x, t0, valid, rows)            quantize x [b, H, n, D] into storage positions [t0, t0 + n)
    dequantize(codes, scale, zero, spec, n)     fp32 [B, H, n, D] of storage positions [0, n)
    decode_attention(view, query, mask, scaling)  one decode step over a `DecodeView` -> [B, 1, Hq, D]
    features                                    the `DecodeView` extensions its decode_attention reads (`rope`:
                                                rope=pre keys rotated in the kernel; `rows`: left-padded batches;
                                                `hadamard`: the query and output maps of the hadamard transform);
                                                it raises `kvq_lab.kernels.view.Unsupported` for a view with one
                                                that it cannot take with this query or mask (the caller rebuilds
                                                the view without it)
    all_finite(*tensors)                        whether no element is NaN or inf (the layer's check of each new
                                                key and value, every step)
    keep(view, query)                           optional: decode_attention over `view` kept for the next steps
                                                (a callable taking the step's moving parts, `cpu_kernel.KeptCall`),
                                                or None; the layer keeps it while its stored tensors stay

`torch` is the pure-PyTorch path; `cpu` adds the C decode-attention kernel (quantization and storage are torch's,
so the bits are the same); `triton` quantizes, packs, dequantizes and attends with the Triton kernels, imported only
when chosen. `auto` picks triton with CUDA, else cpu where the kernel builds, else torch.

Code formats: every backend reads every format its kernels declare (`kvq_lab.quant.formats.add_kernel_support`; the
C and Triton kernels read them all) unless the format refuses the backend (`unsupported_backends`: mxfp4 refuses the
C kernel, which reads fp16 parameters, where its E8M0 scale reads as fp32). Then `auto`
takes the PyTorch path with one warning, and an explicit backend fails (in config validation, before the model
loads). Quantization is the reference's for every format; `int` has the fast whole-group path and, with Triton,
the quantize+pack kernel.
"""

from __future__ import annotations

import warnings
from typing import Protocol

import torch

from kvq_lab.kernels import cpu_kernel, cpu_native
from kvq_lab.kernels.torch_path import all_finite, decode_attention_torch, quantize_whole_groups, unpack_dequantize
from kvq_lab.quant.reference import code_format, quantize
from kvq_lab.quant.spec import QuantConfigError, QuantSpec


class Backend(Protocol):
    """What a packed-cache backend provides (see the module docstring)."""

    name: str
    features: frozenset[str]

    def write(self, store, x, t0, valid, rows) -> None: ...
    def dequantize(self, codes, scale, zero, spec, n) -> torch.Tensor: ...
    def decode_attention(self, view, query, mask, scaling) -> torch.Tensor: ...
    def all_finite(self, *tensors) -> bool: ...


class TorchBackend:
    """`backend=torch`, the pure-PyTorch path: the reference quantizer (whole groups: `quantize_whole_groups`, the
    same bits in fewer ops), vectorised dequantization, `decode_attention_torch`."""

    name = "torch"
    features: frozenset[str] = frozenset()

    @staticmethod
    def quantize(x, spec, valid):
        """x [b, H, n, D] -> codes uint8 [b, H, n, D], fp16 scale and zero (None where the format stores none) in
        the reference's layout."""
        whole = valid is None and (spec.axis == "token" or x.shape[2] % spec.group_size == 0)
        if whole and spec.format == "int":  # int's fast path, the same bits (tested)
            return quantize_whole_groups(x, spec)
        q = quantize(x, spec, valid=valid, partial="exclude")
        return q.codes[:, :, : x.shape[2]], q.scale, q.zero

    @staticmethod
    def write(store, x, t0, valid, rows):
        codes, scale, zero = TorchBackend.quantize(x, store.spec, valid)
        store.put(codes, scale, zero, t0, rows)

    dequantize = staticmethod(unpack_dequantize)
    decode_attention = staticmethod(decode_attention_torch)
    all_finite = staticmethod(all_finite)


class CpuBackend(TorchBackend):
    """`backend=cpu`: the PyTorch path's quantization and storage, decode attention in one native call per layer
    (`kvq_lab.kernels.cpu_kernel`, compiled on first use)."""

    name = "cpu"
    features = frozenset({"rope", "rows", "hadamard"})

    @staticmethod
    def decode_attention(view, query, mask, scaling):
        # looked up at call time, so a test can wrap the kernel and count the calls
        return cpu_kernel.decode_attention(view, query, mask, scaling)

    @staticmethod
    def keep(view, query):
        return cpu_kernel.KeptCall.make(view, query)

    all_finite = staticmethod(cpu_native.all_finite)


class TritonBackend:
    """`backend=triton`: the packed cache quantizes, dequantizes and attends with `kvq_lab.kernels.triton`
    (decode attention: rope=pre keys rotated in the kernel, left-padded rows, fp32 / fp16 / bf16 models)."""

    name = "triton"
    features = frozenset({"rope", "rows"})

    @staticmethod
    def write(store, x, t0, valid, rows):
        from kvq_lab.kernels import triton as tk

        if not tk.quantizes(store.spec):  # other formats: the reference's quantization, the same bits
            return TorchBackend.write(store, x, t0, valid, rows)
        v = None if valid is None else valid[:, 0]  # [b, n]
        codes, scale, zero = store.codes[rows], store.scale[rows], store.zero[rows]
        tk.quantize_into(codes, scale, zero, x, store.spec, t0, v, partial="exclude")

    @staticmethod
    def dequantize(codes, scale, zero, spec, n):
        from kvq_lab.kernels import triton as tk

        return tk.unpack_dequantize(codes, scale, zero, spec, n)

    @staticmethod
    def decode_attention(view, query, mask, scaling):
        from kvq_lab.kernels import triton as tk

        return tk.decode_attention(view, query, mask, scaling)

    all_finite = staticmethod(all_finite)


_WARNED: set = set()


def _cpu_kernel_builds() -> bool:
    err = cpu_kernel.build_error()
    if err is not None and "auto" not in _WARNED:
        _WARNED.add("auto")
        first = err.splitlines()[0]
        warnings.warn(f"backend=auto: {first}; the packed cache uses the PyTorch path (backend=torch)", stacklevel=3)
    return err is None


def unsupported_formats(backend: str, specs) -> list[str]:
    """The code formats among `specs` (QuantSpecs; 16-bit ones quantize nothing) that `backend` cannot read. The
    kernel modules declare what they read when imported: call after importing them (`get_backend` does)."""
    return sorted({code_format(s).name for s in specs if not s.is_identity and not code_format(s).supports(backend)})


def check_formats(backend: str, specs) -> None:
    """One-line QuantConfigError if `backend` cannot read a format of `specs` (an explicit backend choice)."""
    bad = unsupported_formats(backend, specs)
    if bad:
        raise QuantConfigError(
            f"backend={backend} cannot read format={bad[0]} (the format says so): use backend=torch or backend=auto"
        )


def resolve(cache, width: int | None = None) -> str | None:
    """The backend a cache of this config runs (`torch`, `cpu` or `triton`), decided before any model loads, so that
    records name it and `auto` is the same run as what it picks: simulated mode runs the PyTorch reference; `auto`
    picks as `get_backend` does (Triton with CUDA, else the CPU kernel where it builds, else torch; a format the
    kernel cannot read: torch); packed sparse outliers and residual corrections read the dequantized history in
    PyTorch; mode=recompute's
    Triton path needs a power-of-two `width` of X (None where the width is not known before the load: the layer
    decides, and this returns None)."""
    if not cache.caps.kernels:
        return "torch"
    name = cache.backend
    specs = (cache.key, cache.value) if cache.caps.stores_kv else (cache.key,)  # else one tensor, X
    if name == "auto":
        name = "triton" if torch.cuda.is_available() else "cpu" if _cpu_kernel_builds() else "torch"
        if name != "torch":
            if name == "cpu":
                from kvq_lab.kernels import cpu_kernel as _  # noqa: F401  (declares the formats it reads)
            else:
                from kvq_lab.kernels import triton as _  # noqa: F401
            bad = unsupported_formats(name, specs)
            if bad:
                _warn_format(name, bad)
                return "torch"
    if cache.caps.fused_decode and cache.reads_dequantized():
        return "torch"
    if not cache.caps.stores_kv and name == "triton" and cache.backend == "auto" and not cache.key.is_identity:
        if width is None:
            return None
        G = cache.key.group_size
        if width & (width - 1) or G & (G - 1):
            return "torch"
    return name


def get_backend(name: str, specs: tuple[QuantSpec, ...] = ()) -> Backend:
    """`torch`, `cpu`, `triton`, or `auto` (Triton when CUDA is present, else the CPU kernel where it builds, else
    torch). Triton is imported only when chosen. `specs`: the quantizers (keys, values) the backend will serve; a
    format that the chosen backend cannot read sends `auto` to torch (one warning) and fails an explicit choice."""
    chosen = name
    if name == "auto":
        chosen = "triton" if torch.cuda.is_available() else "cpu" if _cpu_kernel_builds() else "torch"
    if chosen == "torch":
        backend = TorchBackend
    elif chosen == "cpu":
        cpu_kernel.load()  # fail at cache creation, with the compiler's message, not in the middle of generate
        backend = CpuBackend
    elif chosen == "triton":
        from kvq_lab.kernels import triton  # noqa: F401  (fail at cache creation if Triton is missing)

        backend = TritonBackend
    else:
        raise ValueError(f"backend={name!r}; allowed: auto, torch, cpu, triton")
    if chosen == "torch" or not specs:
        return backend
    if name != "auto":
        check_formats(chosen, specs)
        return backend
    bad = unsupported_formats(chosen, specs)
    if bad:
        _warn_format(chosen, bad)
        return TorchBackend
    return backend


def _warn_format(chosen: str, bad: list[str]) -> None:
    """`auto` takes the PyTorch path for a format the kernel it would pick cannot read: said once per process, where
    the choice is made (`resolve`, before the model loads, for runs; `get_backend` for caches built directly)."""
    key = ("format", chosen, *bad)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(
            f"backend=auto: the {chosen} kernels cannot read format={bad[0]}; the packed cache uses the PyTorch "
            "path (backend=torch)",
            stacklevel=3,
        )
