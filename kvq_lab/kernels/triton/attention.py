"""Fused decode attention over packed K/V (a `kvq_lab.kernels.view.DecodeView`): query [B, Hq, 1, D] -> [B, 1, Hq, D];
GQA, sinks, packed history and window read where they lie, rope=pre keys rotated in the kernel, left-padded rows.

Two routes (`supports` says which one a view takes, `decode_attention(route=...)` can ask for the general one):
- "tensor_cores" (`attention_tc`): fp16 / bf16 models, int codes, rope=post: the query heads of a kv head as the rows
  of one tile, both products on tensor cores, codes made half precision by bit operations; the fast route.
- "general" (this module's kernel, below): every view the kernel reads, fp32 models, every code format through its
  table, rope=pre; products with `tl.sum` in fp32, the reference's roundings.

The general kernel: the C kernel's semantics (`cpu_kernel.c`), on a grid of (batch row x kv head, chunk of positions)
programs (flash-decoding: long caches split over programs, then `common.combine_kernel` merges the chunks' softmax
partials).
A program reads each K/V row once for all R query heads of its kv head (GQA without repeating K/V).
Position p of row b (j = p - pads[b], its index among the row's real tokens; pads 0 without `rows`):

    j < 0                   padding: score -inf, weight 0, never read
    j < s                   sink j, exact (post-RoPE keys), the model's dtype
    t = p - start < count   history, storage position t: table[code] * scale (+ zero), two roundings (no fma)
    else                    window row W - (N - p) of the window buffer, the model's dtype

(start, count) = (starts[b], counts[b]) of the stream with `rows`, (s, n) without: keys and values split apart.
History is read in the layout of `common` (`kvq_lab/quant/pack.py`). rope=pre: history keys are stored pre-RoPE
(sinks and window as the model made them, post-RoPE); each history key is rotated at its position id pos[b, p] from
the fp32 table rows c = cos[id], s = sin[id] ([D/2]) in rotate_half's pairing, the reference's order of operations:

    k[i] = k[i] * c[i] - k[i + D/2] * s[i],   k[i + D/2] = k[i + D/2] * c[i] + k[i] * s[i]

so keys are read as their two halves. An id outside [0, P) poisons the row (NaN score: the output is NaN, never a
silent wrong answer; the launcher refuses such ids on CPU tensors).

Reference: `kvq_lab.kernels.torch_path.decode_attention_torch` (and the C kernel, `cpu_kernel.decode_attention`);
tests require attention within fp32 rounding, dequantized values bit for bit (tests/kernels/test_triton.py, under
`TRITON_INTERPRET=1`; tests/kernels/test_triton_compile.py builds every launch for sm_90 without a GPU).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvq_lab.quant.pack import BLOCK, word_layout

from ..torch_path import decode_attention_torch
from ..view import DecodeView, Unsupported, check_codes_only
from ..workspace import const
from . import attention_tc
from .common import combine_kernel, deq_rows, fp_rows


@triton.jit
def _decode_attn_kernel(
    q_ptr, sqb_, sqh_,  # query fp32 [B, Hq, (1,) D], pre-scaled: rows at q + b * sqb_ + head * sqh_
    o_ptr, sob, soh,  # output fp32 [B, Hq, D] (one chunk), or
    part_ptr,  # fp32 [B * Hkv, C, RP, D + 2] per chunk: score max, sum of exp, weighted values (SPLIT)
    mask_ptr, smb,  # fp32 additive mask [B, N] (HAS_MASK)
    pads_ptr,  # int64 [B] padding positions per row (ROWS)
    rc_ptr, rs_ptr, P, pos_ptr, spb_,  # fp32 cos/sin [P, D/2], int32 position ids [B, >= N] (ROPE)
    # keys: sinks [B, Hkv, >= s, D]; packed history + params (+ the format's table), per-row start and count
    # (int64 [B], ROWS) or n; window buffer [B, Hkv, W, D]
    ksk_ptr, kskb, kskh, kskt,
    kp_ptr, kpb, kph, kpr, ks_ptr, kz_ptr, kqb, kqh, kqt, kt_ptr, kst_ptr, kcnt_ptr, kn,
    kw_ptr, kwb, kwh, kwt, Wk,
    # values, the same
    vsk_ptr, vskb, vskh, vskt,
    vp_ptr, vpb, vph, vpr, vs_ptr, vz_ptr, vqb, vqh, vqt, vt_ptr, vst_ptr, vcnt_ptr, vn,
    vw_ptr, vwb, vwh, vwt, Wv,
    Hkv, R, N, s, CH,  # s: sink positions present; CH: positions per program (a multiple of TT)
    D: tl.constexpr, H2: tl.constexpr, RP: tl.constexpr, TT: tl.constexpr, BLK: tl.constexpr,
    KG: tl.constexpr, KBITS: tl.constexpr, KNB: tl.constexpr, KM: tl.constexpr, K_TOKEN: tl.constexpr,
    K_TABLE: tl.constexpr, K_ZERO: tl.constexpr,
    VG: tl.constexpr, VBITS: tl.constexpr, VNB: tl.constexpr, VM: tl.constexpr, V_TOKEN: tl.constexpr,
    V_TABLE: tl.constexpr, V_ZERO: tl.constexpr,
    ROWS: tl.constexpr, ROPE: tl.constexpr, HAS_MASK: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    chunk = tl.program_id(1)
    b, hk = bh // Hkv, bh % Hkv
    r = tl.arange(0, RP)  # query heads hk * R + r of this kv head (RP: R rounded up to a power of two)
    rok = r < R
    d = tl.arange(0, D)
    dl = tl.arange(0, H2)  # key halves: channels [0, D/2) and [D/2, D) (rotate_half's pairs for rope=pre)
    dh = dl + H2
    q_row = q_ptr + b * sqb_ + (hk * R + r) * sqh_
    q_lo = tl.load(q_row[:, None] + dl[None, :], mask=rok[:, None], other=0.0)  # [RP, D/2]
    q_hi = tl.load(q_row[:, None] + dh[None, :], mask=rok[:, None], other=0.0)
    if ROWS:
        pad = tl.load(pads_ptr + b)
        k0 = tl.load(kst_ptr + b)
        kc = tl.load(kcnt_ptr + b)
        v0 = tl.load(vst_ptr + b)
        vc = tl.load(vcnt_ptr + b)
    else:
        pad = 0
        k0 = s
        kc = kn
        v0 = s
        vc = vn
    # this (b, kv head)'s segments
    ksink = ksk_ptr + b * kskb + hk * kskh
    kpack = kp_ptr + b * kpb + hk * kph
    kscale = ks_ptr + b * kqb + hk * kqh
    kzero = kz_ptr + b * kqb + hk * kqh
    kwin = kw_ptr + b * kwb + hk * kwh
    vsink = vsk_ptr + b * vskb + hk * vskh
    vpack = vp_ptr + b * vpb + hk * vph
    vscale = vs_ptr + b * vqb + hk * vqh
    vzero = vz_ptr + b * vqb + hk * vqh
    vwin = vw_ptr + b * vwb + hk * vwh

    m = tl.full((RP,), float("-inf"), tl.float32)  # online softmax per query head: running max, sum, values
    l_sum = tl.zeros((RP,), tl.float32)
    acc = tl.zeros((RP, D), tl.float32)
    p_lo = chunk * CH
    p_hi = tl.minimum(p_lo + CH, N)
    # the loop's bounds are plain arguments: the interpreter of triton 3.6 takes no tensor (p_hi) as a range bound;
    # positions past p_hi (the last chunk's tail) are masked off below
    for t0 in range(0, CH, TT):
        p = p_lo + t0 + tl.arange(0, TT)
        j = p - pad
        live = (p < p_hi) & (j >= 0)
        sink = live & (j < s)
        rest = live & (j >= s)
        # keys, as two halves [TT, D/2]
        kt = p - k0
        k_hist = rest & (kt < kc)
        k_win = rest & (kt >= kc)
        krow = Wk - (N - p)
        s_lo = fp_rows(ksink, kskt, j, sink, dl)
        s_hi = fp_rows(ksink, kskt, j, sink, dh)
        x_lo = deq_rows(kpack, kpr, kscale, kzero, kqt, kt_ptr, kt, k_hist, dl, KG, KBITS, KNB, KM, BLK, K_TOKEN,
                         K_TABLE, K_ZERO)  # fmt: skip
        x_hi = deq_rows(kpack, kpr, kscale, kzero, kqt, kt_ptr, kt, k_hist, dh, KG, KBITS, KNB, KM, BLK, K_TOKEN,
                         K_TABLE, K_ZERO)  # fmt: skip
        x_lo += fp_rows(kwin, kwt, krow, k_win, dl)
        x_hi += fp_rows(kwin, kwt, krow, k_win, dh)
        if ROPE:  # rotate history keys at their position ids; sinks and window are post-RoPE already
            ids = tl.load(pos_ptr + b * spb_ + p, mask=k_hist, other=0)
            in_table = (ids >= 0) & (ids < P)
            t_ok = k_hist & in_table
            c = tl.load(rc_ptr + ids[:, None] * H2 + dl[None, :], mask=t_ok[:, None], other=0.0)
            sn = tl.load(rs_ptr + ids[:, None] * H2 + dl[None, :], mask=t_ok[:, None], other=0.0)
            c = tl.where((k_hist & ~in_table)[:, None], float("nan"), c)  # outside the table: poison the row
            r_lo = x_lo * c - x_hi * sn
            r_hi = x_hi * c + x_lo * sn
            k_lo = tl.where(k_hist[:, None], r_lo, s_lo + x_lo)
            k_hi = tl.where(k_hist[:, None], r_hi, s_hi + x_hi)
        else:
            k_lo = s_lo + x_lo
            k_hi = s_hi + x_hi
        scores = tl.sum(q_lo[:, None, :] * k_lo[None, :, :], axis=2)  # [RP, TT]
        scores += tl.sum(q_hi[:, None, :] * k_hi[None, :, :], axis=2)
        if HAS_MASK:
            scores += tl.load(mask_ptr + b * smb + p, mask=live, other=0.0)[None, :]
        scores = tl.where(live[None, :], scores, float("-inf"))  # [RP, TT]
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile of padding or masked positions only
        alpha = tl.exp(m - shift)
        w = tl.exp(scores - shift[:, None])
        # values [TT, D]: their own split
        vt = p - v0
        v_hist = rest & (vt < vc)
        v_win = rest & (vt >= vc)
        v = fp_rows(vsink, vskt, j, sink, d)
        v += deq_rows(vpack, vpr, vscale, vzero, vqt, vt_ptr, vt, v_hist, d, VG, VBITS, VNB, VM, BLK, V_TOKEN,
                       V_TABLE, V_ZERO)  # fmt: skip
        v += fp_rows(vwin, vwt, Wv - (N - p), v_win, d)
        l_sum = l_sum * alpha + tl.sum(w, axis=1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    if SPLIT:
        part = part_ptr + ((bh * tl.num_programs(1) + chunk) * RP + r) * (D + 2)
        tl.store(part, m, mask=rok)
        tl.store(part + 1, l_sum, mask=rok)
        tl.store(part[:, None] + 2 + d[None, :], acc, mask=rok[:, None])
    else:
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]  # every position masked: 0 (acc 0), as the C kernel
        tl.store(o_ptr + b * sob + (hk * R + r)[:, None] * soh + d[None, :], out, mask=rok[:, None])


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
    raises `Unsupported` for a view with `rope`, `pads` or `hadamard` (`kvq_lab.cache.attention` rebuilds or
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
                "without `rope`, `pads` and `hadamard` for torch_path.decode_attention_torch (kvq_lab.cache.attention "
                "does)"
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
        Hkv, R, N, min(view.sink_tokens, N), chunk,
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
