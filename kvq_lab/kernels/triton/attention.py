"""Fused decode attention over packed K/V (a `kvq_lab.kernels.view.DecodeView`): query [B, Hq, 1, D] -> [B, 1, Hq, D];
GQA, sinks, packed history and window read where they lie, rope=pre keys rotated in the kernel, left-padded rows.

Two routes (`supports` says which one a view takes, `decode_attention(route=...)` can ask for the general one):
- "tensor_cores" (`attention_tc`): fp16 / bf16 models, int codes, rope=post: the query heads of a kv head as the rows
  of one tile, both products on tensor cores, codes made half precision by bit operations; the fast route.
- "general" (`attention_kernel`): every view the kernel reads, fp32 models, every code format through its table,
  rope=pre; products with `tl.sum` in fp32, the reference's roundings.

This module is the host side of both: `supports` picks the route, `decode_attention` checks, allocates and launches
(the general kernel's chunks of positions per program and flash-decoding's merge, `common.combine_kernel`); what each
position reads, and how, is written at the kernels.

Reference: `kvq_lab.kernels.torch_path.decode_attention_torch` (and the C kernel, `cpu_kernel.decode_attention`);
tests require attention within fp32 rounding, dequantized values bit for bit (tests/kernels/test_triton.py, under
`TRITON_INTERPRET=1`; tests/kernels/test_triton_compile.py builds every launch for sm_90 without a GPU).
"""

from __future__ import annotations

import os

import torch
import triton

from kvq_lab.quant.pack import BLOCK, word_layout

from ..torch_path import decode_attention_torch
from ..view import DecodeView, Unsupported, check_codes_only
from ..workspace import const
from . import attention_tc
from .attention_kernel import _decode_attn_kernel
from .common import combine_kernel

XDTS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the model's dtype (window, sinks, query)
MAX_TILE = 32  # positions per loop step, at most (`_attn_tile`)
MIN_CHUNK = 256  # positions per program at least (a program's fixed cost: its query, one partial)


def _runs_here(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


ROUTES = ("tensor_cores", "general")


def supports(view: DecodeView, query: torch.Tensor, mask=None) -> str | None:
    """The route this kernel takes for this view, query and mask: "tensor_cores" (`attention_tc`: fp16 / bf16 models,
    int codes, rope=post; `attention_tc.fast_route_reason` says why not), "general" (any other configuration the
    kernel reads), or None where it reads none: then `decode_attention` takes the PyTorch path for a plain view and
    raises `Unsupported` for a view with `rope`, `pads` or `hadamard` (`kvq_lab.cache.routing.attention` rebuilds or
    materializes those).

    Both routes need a CUDA device (CPU tensors under TRITON_INTERPRET=1), an fp32, fp16 or bf16 model (query, sinks
    and windows in one dtype), a power-of-two head dim, masks shared by the query heads ([B or 1, 1, 1, >= N]),
    rope=pre keys from a `RopeView` (int32 position ids), padded rows with their int64 starts and counts; never
    `hadamard` (the caller maps query and output around this kernel)."""
    if not _reads(view, query, mask):
        return None
    return "tensor_cores" if attention_tc.fast_route_reason(view, query) is None else "general"


def _reads(view: DecodeView, query: torch.Tensor, mask) -> bool:
    """Whether either route reads this view, query and mask (`supports`)."""
    if view.hadamard is not None:
        return False
    B, Hq, _, D = query.shape
    ks, vs = view.keys, view.values
    Hkv = ks.sink.shape[1]
    dev = query.device
    tensors = (ks.sink, vs.sink, ks.window, vs.window)
    if not (_runs_here(dev) and all(t.device == dev for t in tensors)):
        return False
    if not (query.dtype in XDTS and all(t.dtype == query.dtype for t in tensors)):
        return False
    if D < 2 or D & (D - 1) or Hq % Hkv or any(t.stride(-1) != 1 for t in tensors):
        return False
    if mask is not None and not (mask.dim() == 4 and mask.shape[0] in (1, B) and mask.shape[1] == mask.shape[2] == 1
                                 and mask.shape[3] >= view.N):  # fmt: skip
        return False
    rope = view.rope
    if rope is not None:
        ok = rope.cos.dtype == rope.sin.dtype == torch.float32 and rope.cos.is_contiguous() and rope.sin.is_contiguous()
        if not (ok and rope.cos.shape == rope.sin.shape and rope.cos.shape[-1] == D // 2):
            return False
        if rope.pos.dtype != torch.int32 or rope.pos.stride(-1) != 1 or rope.pos.shape[-1] < view.N:
            return False
    if view.pads is not None:
        rows = (view.pads, ks.starts, ks.counts, vs.starts, vs.counts)
        if any(t is None or t.dtype != torch.int64 or t.shape != (B,) or not t.is_contiguous() for t in rows):
            return False
    return True


def _additive_mask(mask, B: int, N: int) -> torch.Tensor:
    """fp32 [B, N] from SDPA's [B or 1, 1, 1, >= N] bool or float mask (the last N positions)."""
    mask = mask[..., -N:].expand(B, 1, 1, N).reshape(B, N)
    if mask.dtype == torch.bool:
        return torch.zeros(B, N, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.float().contiguous()


def _check_rope_ids(view: DecodeView) -> None:
    """CPU tensors (the interpreter): refuse rope=pre key rows whose position id is outside the table, as the C
    kernel does (on CUDA the kernel poisons such rows with NaN instead: reading the ids back would sync every step)."""
    rope, N, ks = view.rope, view.N, view.keys
    B = rope.pos.shape[0]
    a = torch.arange(N)[None]
    s = min(view.sink_tokens, N)
    j = a - (0 if view.pads is None else view.pads[:, None])
    t = a - (s if ks.starts is None else ks.starts[:, None])  # storage position: history below n (counts[b])
    hist = (j >= s) & (t >= 0) & (t < (ks.n if ks.counts is None else ks.counts[:, None]))  # the rows rotated
    ids = rope.pos[:, :N]
    bad = int((((ids < 0) | (ids >= rope.cos.shape[0])) & hist).expand(B, N).sum())
    if bad:
        raise ValueError(
            f"{bad} rope=pre key rows have position ids outside the RopeView table [0, {rope.cos.shape[0]}): "
            "build the table over every id in RopeView.pos"
        )


_SMS: dict = {}


def _attn_tile(RP: int, D: int) -> int:
    """Positions per loop step: the [RP, tile, D] products stay at 32 fp32 registers per thread of 4 warps (measured
    in the sm_90 build: a fixed tile of 32 took 255 registers and spilled at RP=4, D=128)."""
    return max(8, min(MAX_TILE, 4096 // (RP * D)))


def _sm_count(device: torch.device) -> int:
    """The GPU's streaming multiprocessors (1 for the interpreter)."""
    if device.type != "cuda":
        return 1
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def _chunk(N: int, programs: int, device: torch.device, tile: int) -> int:
    """Positions per program: enough programs to fill the GPU (about two per SM), at least MIN_CHUNK positions each."""
    sms = _sm_count(device)
    per = -(-N // max(1, -(-2 * sms // programs)))
    return max(MIN_CHUNK, -(-per // tile) * tile)


def decode_attention(
    view: DecodeView, query: torch.Tensor, mask, scaling: float, chunk: int | None = None, *,
    route: str | None = None, splits: int | None = None,
):  # fmt: skip
    """Triton twin of `torch_path.decode_attention_torch` and `cpu_kernel.decode_attention`: query [B, Hq, 1, D] ->
    [B, 1, Hq, D] in the query's dtype (fp32 accumulation). Reads `view.rope` (pre-RoPE keys rotated in the kernel)
    and `view.pads` (left-padded rows). The route is `supports`'s unless `route` names one ("general" always runs
    where "tensor_cores" does; asking for "tensor_cores" where it cannot run is an error). chunk: the general route's
    positions per program (a multiple of `_attn_tile`, 8 always is; default: `_chunk`); splits: the tensor-core
    route's history splits per (row, kv head) (default: from the GPU's SM count, `attention_tc._splits`)."""
    check_codes_only(view, "the Triton decode kernel")
    took = supports(view, query, mask)
    if took is None:
        if view.rope is not None or view.pads is not None or view.hadamard is not None:  # the PyTorch path reads none
            raise Unsupported(
                "the Triton kernel cannot take this query, mask or view (`supports` says why not); rebuild the view "
                "without `rope`, `pads` and `hadamard` for torch_path.decode_attention_torch "
                "(kvq_lab.cache.routing.attention does)"
            )
        return decode_attention_torch(view, query, mask, scaling)
    if route is not None:
        if route not in ROUTES:
            raise ValueError(f"route={route!r}: choose one of {', '.join(ROUTES)}")
        if route == "tensor_cores" and took != route:
            why = attention_tc.fast_route_reason(view, query)
            raise ValueError(f"the tensor-core route cannot take this view: {why}")
        took = route
    if took == "tensor_cores":
        return _tensor_cores(view, query, mask, scaling, splits)
    B, Hq, _, D = query.shape
    N, dev = view.N, query.device
    ks, vs = view.keys, view.values
    Hkv = ks.sink.shape[1]
    R = Hq // Hkv
    RP = max(2, triton.next_power_of_2(R))
    if view.rope is not None and dev.type == "cpu":
        _check_rope_ids(view)
    tile = _attn_tile(RP, D)
    chunk = chunk or _chunk(N, B * Hkv, dev, tile)
    if chunk % tile:
        raise ValueError(f"chunk={chunk}: positions per program must be a multiple of {tile} (the loop's tile)")
    C = max(1, -(-N // chunk))
    q = (query.float() * scaling).contiguous()
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=dev)
    part = torch.empty(B * Hkv * C * RP * (D + 2) if C > 1 else 1, dtype=torch.float32, device=dev)
    # placeholders for arguments a launch never reads (built once per device: no allocation per layer and step)
    f32 = const("triton-f32", dev, lambda: torch.zeros(1, dtype=torch.float32))
    i64 = const("triton-i64", dev, lambda: torch.zeros(1, dtype=torch.int64))
    add = _additive_mask(mask, B, N) if mask is not None else f32
    rope = view.rope
    rc, rs, P, pos = (rope.cos, rope.sin, rope.cos.shape[0], rope.pos) if rope is not None else (f32, f32, 0, i64)
    pads = view.pads if view.pads is not None else i64

    def stream(sv):
        """A stream's launch arguments (dummies where it holds no history) and constexprs."""
        if sv.codes is not None and sv.n:
            c, sc, z = sv.codes, sv.scale, sv.zero
        else:
            c, sc, z = i64.view(torch.uint8).view(1, 1, 8, 1), f32.view(torch.float16).view(1, 1, 2, 1), None
        zt = z if z is not None else sc  # never read (HAS_ZERO false)
        table = sv.table if sv.table is not None else f32
        st, cnt = (sv.starts, sv.counts) if view.pads is not None else (i64, i64)
        sink, win = sv.sink, sv.window
        u, nb = word_layout(sv.bits)
        args = [
            sink, sink.stride(0), sink.stride(1), sink.stride(2),
            c, c.stride(0), c.stride(1), c.stride(2), sc, zt, sc.stride(0), sc.stride(1), sc.stride(2), table, st,
            cnt, sv.n if sv.codes is not None else 0,
            win, win.stride(0), win.stride(1), win.stride(2), win.shape[2],
        ]  # fmt: skip
        const = dict(G=sv.group_size, BITS=sv.bits, NB=nb, M=BLOCK // u, TOKEN=sv.axis == "token",
                     TABLE=sv.table is not None, ZERO=z is not None)  # fmt: skip
        return args, const

    kargs, kc = stream(ks)
    vargs, vc = stream(vs)
    _decode_attn_kernel[(B * Hkv, C)](
        q, q.stride(0), q.stride(1),
        out, out.stride(0), out.stride(1),
        part,
        add, add.stride(0) if mask is not None else 0,
        pads,
        rc, rs, P, pos, pos.stride(0) if rope is not None else 0,
        *kargs, *vargs,
        Hkv, R, N, min(view.sink_tokens, N), chunk, min(chunk, -(-N // tile) * tile),
        D=D, H2=D // 2, RP=RP, TT=tile, BLK=BLOCK,
        KG=kc["G"], KBITS=kc["BITS"], KNB=kc["NB"], KM=kc["M"], K_TOKEN=kc["TOKEN"], K_TABLE=kc["TABLE"],
        K_ZERO=kc["ZERO"],
        VG=vc["G"], VBITS=vc["BITS"], VNB=vc["NB"], VM=vc["M"], V_TOKEN=vc["TOKEN"], V_TABLE=vc["TABLE"],
        V_ZERO=vc["ZERO"],
        ROWS=view.pads is not None, ROPE=rope is not None, HAS_MASK=mask is not None, SPLIT=C > 1,
        enable_fp_fusion=False,  # the reference's roundings: dequantization and rotation without fma
    )  # fmt: skip
    if C > 1:
        combine_kernel[(B * Hkv,)](part, out, out.stride(0), out.stride(1), Hkv, R, C, D=D, RP=RP)
    out = out.view(B, 1, Hq, D)
    return out if query.dtype == torch.float32 else out.to(query.dtype)


def _tensor_cores(view: DecodeView, query: torch.Tensor, mask, scaling: float, splits: int | None):
    """The tensor-core route (`attention_tc`): its kernel's partials merged by `combine_kernel`."""
    B, Hq, _, D = query.shape
    dev = query.device
    Hkv = view.keys.sink.shape[1]
    f32 = const("triton-f32", dev, lambda: torch.zeros(1, dtype=torch.float32))
    i64 = const("triton-i64", dev, lambda: torch.zeros(1, dtype=torch.int64))
    add = _additive_mask(mask, B, view.N) if mask is not None else f32
    pads = view.pads if view.pads is not None else i64
    part, C, BH = attention_tc.launch(view, query, add, pads, scaling, _sm_count(dev), f32, i64, splits)
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=dev)
    combine_kernel[(B * Hkv,)](part, out, out.stride(0), out.stride(1), Hkv, Hq // Hkv, C, D=D, RP=BH)
    return out.view(B, 1, Hq, D).to(query.dtype)
