"""`backend=cpu`: the packed cache's decode attention as one native call per layer and step (cpu_kernel.c).

Takes a `DecodeView` (plain tensors, `kvq_lab.kernels.view`) and the query, like every decode attention here.

Why: the PyTorch path (`backend=torch`) must dequantize the whole history into a buffer every step, in ~20 small
ATen ops per layer. At short contexts those ops' fixed cost, and at long ones the traffic of writing and reading
a dequantized fp32 copy of K and V (6 MB per layer at 4096 tokens for SmolLM2), are what separate it from an fp
cache. The kernel reads the packed codes where they are, dequantizes each history row into D floats on the stack
and does scores, softmax and the weighted sum of values in one call (flash-decoding chunks over PyTorch's OpenMP
threads). Quantization and storage are the PyTorch path's: same bits, same `nbytes()`. Outputs match the PyTorch
path within fp32 rounding (tested); dequantized values are bit for bit the reference's.

This file is the call: a view's argument block (the C `Args`, fields from `cpu_build`), the call itself, and the
block kept between decode steps (`KeptCall`). Building and loading the library is `cpu_build`'s (its `load`,
`build_error`, `failed`, `cache_dir` and `KernelBuildError` are importable from here too); the same library holds
the native helpers of `cpu_native` (the caches' finiteness check, the hadamard transform).
"""

from __future__ import annotations

import array

import torch

from kvq_lab.quant.formats import EVERY_FORMAT, add_kernel_support
from kvq_lab.quant.pack import BLOCK, word_layout

from .cpu_build import (
    ARG_FIELDS,
    DTYPES,
    N_FIELDS,
    STREAM_FIELDS,
    KernelBuildError,
    build_error,
    cache_dir,
    failed,
    load,
)
from .torch_path import decode_attention_torch
from .view import DecodeView, StreamView, Unsupported, check_codes_only
from .workspace import version_of, workspace

# with the library's build (`cpu_build`): callers ask this module whether the kernel builds (backends, checks, tests)
__all__ = ["KeptCall", "KernelBuildError", "build_error", "cache_dir", "decode_attention", "failed", "load", "supports"]

MAX_D, MAX_R, CHUNK = 1024, 32, 256  # KVQ_MAX_D, KVQ_MAX_R, KVQ_MAX_CHUNK in the C source

# the kernel dequantizes `table[code] * scale (+ zero)` with any fp32 table of 2^bits entries and fp16 parameters:
# every code format whose parameters read as fp16 (one that reads them as fp32, mxfp4, says `unsupported_backends`)
add_kernel_support("cpu", EVERY_FORMAT)


def _stream_fields(sv: StreamView) -> list[int]:
    """The C `Stream` of one tensor: packed history (if any) with its format's table (0: int), window buffer and
    sinks (the model's dtype), and a padded batch's per-row starts and counts. (Runs for every layer and step: one
    `stride()` call per tensor, layouts from a table.)"""
    n = sv.n
    if sv.codes is not None and n:
        c, s, z, t = sv.codes, sv.scale, sv.zero, sv.table
        ss = s.stride()
        if t is None and z is None:  # the kernel's int path adds a zero point: a table-less format must store one
            raise ValueError("a code format without a zero point must give its table (StreamView.table)")
        if s.dtype is not torch.float16:  # parameters read as fp32 (mxfp4's e8m0) refuse this backend
            raise ValueError(f"the CPU kernel reads fp16 parameters; got {s.dtype} (use backend=torch or triton)")
        if t is not None and (t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != 1 << sv.bits):
            raise ValueError(f"StreamView.table must be contiguous fp32 [2^bits = {1 << sv.bits}]")
        if z is not None and z.stride() != ss:
            raise ValueError("the kernel reads scale and zero point with the same strides")
        ptrs = [c.data_ptr(), s.data_ptr(), 0 if z is None else z.data_ptr(), 0 if t is None else t.data_ptr()]
        hist = [*ptrs, *c.stride()[:3], *ss[:3], n]
    else:
        hist = _NO_HISTORY
    buf, sink = sv.window, sv.sink  # the window's tokens are its last w rows
    rows = _NO_ROWS if sv.starts is None else [sv.starts.data_ptr(), sv.counts.data_ptr()]
    return [
        *hist, *_layout(sv.bits, sv.group_size, sv.axis),
        buf.data_ptr(), *buf.stride()[:3], buf.shape[2], sv.w,
        sink.data_ptr(), *sink.stride()[:3], DTYPES[sink.dtype], *rows,
    ]  # fmt: skip


_NO_HISTORY, _NO_ROWS, _NO_HADAMARD = [0] * 11, [0, 0], (0, 0)
_LAYOUTS: dict = {}


def _layout(bits: int, group_size: int, axis: str) -> list[int]:
    """bits, nb, m, group, token_axis of the C `Stream` (`kvq_lab.quant.pack` word layout), once per layout."""
    key = (bits, group_size, axis)
    if key not in _LAYOUTS:
        u, nb = word_layout(bits)
        _LAYOUTS[key] = [bits, nb, BLOCK // u, group_size, int(axis == "token")]
    return _LAYOUTS[key]


def _rope_fields(view: DecodeView, N: int) -> list[int]:
    """rcos, rsin, P, pos, pb of the C `Args`: the rope=pre table and position ids, or zeros."""
    rope = view.rope
    if rope is None:
        return [0, 0, 0, 0, 0]
    D = view.keys.sink.shape[-1]
    cos, sin, pos = rope.cos, rope.sin, rope.pos
    ok = cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    if not ok or cos.shape != sin.shape or cos.shape[-1] != D // 2 or pos.shape[-1] < N:
        raise ValueError(f"RopeView: cos/sin must be contiguous fp32 [P, D/2 = {D // 2}] and pos [B, >= N = {N}]")
    return [cos.data_ptr(), sin.data_ptr(), cos.shape[0], pos.data_ptr(), pos.stride(0)]


def _pads_field(view: DecodeView, B: int) -> int:
    """pads of the C `Args`: int64 [B] padding positions per row (with every stream's starts and counts), or 0."""
    if view.pads is None:
        return 0
    rows = (view.pads, view.keys.starts, view.keys.counts, view.values.starts, view.values.counts)
    if any(t is None or t.dtype != torch.int64 or t.shape != (B,) or not t.is_contiguous() for t in rows):
        raise ValueError(f"a padded DecodeView needs contiguous int64 [B = {B}] pads, starts and counts")
    return view.pads.data_ptr()


def supports(view: DecodeView, query: torch.Tensor, mask=None) -> bool:
    """The kernel reads sinks and windows in an fp32, fp16 or bf16 model's dtype on the CPU, masks shared by the
    query heads, and rope=pre keys from a `RopeView`; other dtypes, devices, head sizes or masks take the PyTorch
    path (same results: `decode_attention` falls back itself for a plain view and raises `Unsupported` for a view
    with `rope` or `pads`, which `kvq_lab.cache.routing.attention` rebuilds or materializes)."""
    return _supports(view, query) and _mask_ok(mask, query.shape[0])


def _supports(view: DecodeView, query: torch.Tensor) -> bool:
    """`supports` less the mask (every layer and step: dtypes are singletons, compared by identity)."""
    _, Hq, _, D = query.shape
    k, v = view.keys, view.values
    sink, dt, rope = k.sink, query.dtype, view.rope
    return (
        query.is_cpu
        and dt in DTYPES
        and sink.dtype is dt
        and k.window.dtype is dt
        and v.window.dtype is dt
        and sink.stride()[-1] == 1
        and v.sink.stride()[-1] == 1
        and D <= MAX_D
        and Hq // sink.shape[1] <= MAX_R
        and (view.hadamard is None or all(n == 0 or (D % n == 0 and n & (n - 1) == 0) for n in view.hadamard))
        and (rope is None or (D % 2 == 0 and rope.pos.dtype is torch.int32 and rope.pos.stride()[-1] == 1))
    )


def _mask_ok(mask, B: int) -> bool:
    """No mask, or SDPA's [B or 1, 1, 1, N'] mask shared by the query heads (a shape check: nothing is built)."""
    return mask is None or (mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1 and mask.shape[0] in (1, B))


def _additive_mask(mask, B: int, N: int) -> torch.Tensor | None:
    """[B, N] fp32 additive mask from SDPA's [B or 1, 1, 1, >= N] bool or float mask (None: no mask; False: a mask
    the kernel cannot take, one that differs between query heads). Every layer of a forward passes the same mask
    tensor (a padded batch's, every decode step): the latest conversion is given again for that very tensor,
    unmodified since (its version counter), at the same B and N; the kernel only reads it."""
    if mask is None:
        return None
    key, last = (B, N, version_of(mask)), _LAST_MASK[0]
    if last is not None and last[0] is mask and key[2] is not None and last[1] == key:
        return last[2]
    if not _mask_ok(mask, B):
        return False
    m = mask[..., -N:].expand(B, 1, 1, N)
    if m.dtype == torch.bool:
        add = torch.zeros(B, N).masked_fill_(~m.reshape(B, N), float("-inf"))
    else:
        add = m.reshape(B, N).float().contiguous()
    _LAST_MASK[0] = (mask, key, add)
    return add


_LAST_MASK: list = [None]  # (mask, (B, N, its version), the additive mask): `_additive_mask`'s latest answer


def decode_attention(view: DecodeView, query: torch.Tensor, mask, scaling: float) -> torch.Tensor:
    """`decode_attention_torch`'s twin over packed K/V: query [B, Hq, 1, D] -> [B, 1, Hq, D] in the query's dtype.
    A view with rope=pre keys (`view.rope`) is rotated in the kernel; with `view.hadamard` the query is mapped into
    the keys' Hadamard basis and the output back from the values' in the kernel too (fp32). fp16 / bf16 models:
    sinks and windows are converted row by row in the kernel; the query (one row per head) here, and the fp32 output
    back."""
    check_codes_only(view, "the CPU kernel")
    B = query.shape[0]
    add = _additive_mask(mask, B, view.N)  # built once: `supports` would build it again
    if add is False or not _supports(view, query):
        if view.rope is not None or view.pads is not None or view.hadamard is not None:  # the PyTorch path reads none
            raise Unsupported(
                "the CPU kernel cannot take this query or mask; rebuild the view without `rope`, `pads` and "
                "`hadamard` for torch_path.decode_attention_torch (kvq_lab.cache.routing.attention does)"
            )
        return decode_attention_torch(view, query, mask, scaling)
    return _call(view, _arg_block(view, query), query, add, scaling)


def _arg_block(view: DecodeView, query: torch.Tensor) -> array.array:
    """The C `Args` of a call over `view` as an int64 array.array (built from Python ints in C: ~2.5 us, where a
    ctypes array of the same ~80 fields took ~15 us), less what `_call` writes in: the query, output, mask and
    scratch addresses."""
    B, Hq, _, D = query.shape
    N = view.N
    Hkv = view.keys.sink.shape[1]
    args = array.array("q", (
        0, 0, 0, 0, Hq * D, D, 0, 0, 0,
        B, Hq, Hkv, D, N, min(view.sink_tokens, N), CHUNK, *_rope_fields(view, N), _pads_field(view, B),
        *(view.hadamard or _NO_HADAMARD), *_stream_fields(view.keys), *_stream_fields(view.values),
    ))  # fmt: skip
    if len(args) != N_FIELDS:  # the C struct's layout: a missing field would shift every later one
        raise RuntimeError(f"CPU kernel argument block has {len(args)} fields, the C Args struct {N_FIELDS}")
    return args


def _call(view: DecodeView, args: array.array, query: torch.Tensor, add, scaling: float) -> torch.Tensor:
    """Run the kernel on `args` (view's block) for this query and additive mask (None: none): the query, output,
    mask and scratch addresses written in, the output returned in the query's dtype."""
    B, Hq, _, D = query.shape
    N, Hkv = args[_A_N], args[_A_HKV]
    dtype = query.dtype
    qs = query.stride()
    if dtype is not torch.float32 or qs[-1] != 1:
        query = query.float().contiguous()
        qs = query.stride()
    out = torch.empty(B, 1, Hq, D)  # the layout the attention function returns; rows at b * Hq * D + head * D
    chunks = -(-N // CHUNK)
    partial = workspace("partial", B * Hkv * chunks * (Hq // Hkv) * (D + 2), query.device, sliced=False)
    args[0], args[1], args[2], args[3] = query.data_ptr(), qs[0], qs[1], out.data_ptr()
    args[6], args[7], args[8] = (0, 0, partial.data_ptr()) if add is None else (add.data_ptr(), N, partial.data_ptr())
    bad = load().kvq_decode_attention(args.buffer_info()[0], torch.get_num_threads(), scaling)
    if bad < 0:
        raise MemoryError(f"the CPU kernel could not allocate the query's copy ({B * Hq * D} floats)")
    if bad:
        raise ValueError(
            f"{bad} rope=pre key rows have position ids outside the RopeView table "
            f"[0, {view.rope.cos.shape[0]}): build the table over every id in RopeView.pos"
        )
    return out if dtype == torch.float32 else out.to(dtype)


_A_N, _A_S, _A_HKV = (ARG_FIELDS.index(f) for f in ("N", "s", "Hkv"))
# per stream: where its fields start in the block, and the offsets of those a decode step moves
_K0, _V0 = len(ARG_FIELDS), len(ARG_FIELDS) + len(STREAM_FIELDS)
_S_N, _S_WIN, _S_W, _S_SINK = (STREAM_FIELDS.index(f) for f in ("n", "win", "w", "sink"))


class KeptCall:
    """`decode_attention` over one layer's views, kept from one decode step to the next: the argument block of the
    view it was made from, with only what a step moves written in (N, the attended sinks, and per stream the history
    length, the window's rows and length, the sinks' tensor) instead of ~80 fields rebuilt from a new view (in the
    model, ~150 us of Python per layer and step). The caller (the cache layer, `kvq_lab.cache.layers.packed_decode`)
    keeps it only while the view's other tensors are the same (codes, parameters, window buffer, rope table and
    positions) and calls it with the view's moving parts; where a step moves anything else (a history appears where
    there was none, another query layout, a mask the kernel cannot take) it returns None and the caller builds a new
    view."""

    __slots__ = ("view", "args", "qkey", "has", "rows")

    def __init__(self, view: DecodeView, args: array.array, query: torch.Tensor):
        self.view, self.args = view, args
        self.qkey = (query.dtype, query.shape)
        self.has = (args[_K0] != 0, args[_V0] != 0)  # a history in the block (its codes' address), per stream
        # a left-padded batch: the view's per-row starts and counts (int64 [B] CPU tensors the block points at), as
        # numpy arrays over the same memory, rewritten in place at each step (the pads themselves never move)
        k, v = view.keys, view.values
        self.rows = None if view.pads is None else tuple(t.numpy() for t in (k.starts, k.counts, v.starts, v.counts))

    @classmethod
    def make(cls, view: DecodeView, query: torch.Tensor) -> KeptCall | None:
        """A kept call for the views of which `view` is the first (None where `decode_attention` would not run the
        kernel on it: a dequantized history, a query it cannot take)."""
        if view.keys.history is not None or view.values.history is not None:
            return None
        if not _supports(view, query):
            return None
        return cls(view, _arg_block(view, query), query)  # _arg_block checks a padded view's rows (int64 [B])

    def __call__(self, query, mask, scaling: float, N: int, s: int, keys: tuple, values: tuple):
        """This step's `decode_attention` over the kept view with N positions, s attended sinks, and per stream
        keys / values = (history length n, window w, window tensor [B, H, W, D], sinks tensor, rows: a left-padded
        batch's per-row (starts, counts) lists, else None); None where the step moved something else (the caller
        then builds the view)."""
        if (query.dtype, query.shape) != self.qkey or (keys[0] > 0) != self.has[0] or (values[0] > 0) != self.has[1]:
            return None
        if (keys[4] is None) != (self.rows is None) or (values[4] is None) != (self.rows is None):
            return None
        add = _additive_mask(mask, query.shape[0], N)
        if add is False:
            return None
        a = self.args
        a[_A_N], a[_A_S] = N, s
        for base, (n, w, window, sink, _) in ((_K0, keys), (_V0, values)):
            ss = sink.stride()
            a[base + _S_N], a[base + _S_WIN], a[base + _S_W] = n, window.data_ptr(), w
            a[base + _S_SINK], a[base + _S_SINK + 1], a[base + _S_SINK + 2], a[base + _S_SINK + 3] = (
                sink.data_ptr(), ss[0], ss[1], ss[2])  # fmt: skip
        if self.rows is not None:
            ks, kc, vs, vc = self.rows
            ks[:], kc[:], vs[:], vc[:] = keys[4][0], keys[4][1], values[4][0], values[4][1]
        return _call(self.view, a, query, add, scaling)
