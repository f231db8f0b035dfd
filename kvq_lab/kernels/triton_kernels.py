"""Triton kernels for the packed cache: quantize+pack, unpack+dequantize, fused decode attention over packed K/V.

What they compute is pinned by the PyTorch reference (`kvq_lab.quant.reference`, `kvq_lab.quant.pack`,
`kvq_lab.kernels.torch_path.decode_attention_torch`); tests run them on CPU under `TRITON_INTERPRET=1` and require
identical codes and parameters, identical dequantized values, and attention within fp32 rounding. Entry points take
plain tensors (decode attention: a `kvq_lab.kernels.view.DecodeView`); `kvq_lab.cache.backends` wires them in.

Layout (see `kvq_lab/quant/pack.py`): a tensor's codes are stored along tokens in blocks of BLOCK = 32 tokens;
a block is `U` planes of `M = BLOCK / U` tokens, and word (r, d) holds the codes of tokens r, r + M, ... of the
block, `BITS` bits each, least significant first, as `NB` little-endian bytes stored in `NB` byte planes:

    packed[b, h, blk * NB * M + j * M + r, d] = byte j of word (blk, r, d)        j < NB, r < M

Parameters are fp16: [B, H, T, D/G] for per-token groups (along channels), [B, H, T/G, D] for per-channel groups
(along tokens). Bit parity with the reference needs its exact arithmetic: IEEE division (`tl.div_rn`; Triton's
`/` is approximate on GPU), round half to even, fp16 parameters rounded outward (zero down, scale up, by
nudging the fp16 bit pattern one ulp), and a dequantization `code * scale + zero` with two roundings (the launch
disables fp contraction, which would fuse it into an fma).

Code formats (`kvq_lab.quant.formats`): unpack+dequantize and decode attention read every format,
x' = table[code] * scale (+ zero), with one gather from the format's fp32 table (HAS_TABLE; int's codes are their
own values and skip it) and no zero point where the format stores none (HAS_ZERO). Quantize+pack implements int's
arithmetic; the cache quantizes other formats with the reference and stores the same bits (`quantizes`).

Import is lazy (only `backend=triton` or `auto` on a CUDA machine loads this module).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvq_lab.quant.formats import EVERY_FORMAT, add_kernel_support
from kvq_lab.quant.pack import BLOCK, word_layout
from kvq_lab.quant.reference import QTensor, code_format
from kvq_lab.quant.spec import QuantSpec

from .torch_path import decode_attention_torch
from .view import DecodeView, check_codes_only

# dequantization and decode attention load table[code] for any fp32 table of 2^bits entries: every code format
add_kernel_support("triton", EVERY_FORMAT)


def quantizes(spec: QuantSpec) -> bool:
    """Whether the quantize+pack kernel implements the spec's format (int); others quantize with the reference."""
    return spec.format == "int"


def _table_and_zero(spec: QuantSpec, zero, device):
    """(table or a dummy, HAS_TABLE, zero or a dummy, HAS_ZERO) for a launch: int has no table, fp8 no zero."""
    fmt = code_format(spec)
    dummy = torch.zeros(1, dtype=torch.float32, device=device)
    table = dummy if fmt.codes_are_values else fmt.table(device)
    return table, not fmt.codes_are_values, (zero if zero is not None else dummy), zero is not None


# ----------------------------------------------------------------------------------------------------------------
# Scalar helpers: the reference's rounding, element-wise
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _fp16_down(x):
    """Largest fp16 <= x (x fp32): round to nearest, then one ulp down if that went above x."""
    y = x.to(tl.float16)
    b = y.to(tl.int16, bitcast=True)
    # one ulp towards -inf on the bit pattern: +0/-0 -> -smallest subnormal (0x8001), x > 0 -> b - 1, x < 0 -> b + 1
    dn = tl.where(y == 0, -32767, tl.where(y > 0, b - 1, b + 1)).to(tl.int16)
    return tl.where(y.to(tl.float32) > x, dn.to(tl.float16, bitcast=True), y)


@triton.jit
def _fp16_up(x):
    """Smallest fp16 >= x (x fp32)."""
    y = x.to(tl.float16)
    b = y.to(tl.int16, bitcast=True)
    up = tl.where(y == 0, 1, tl.where(y > 0, b + 1, b - 1)).to(tl.int16)
    return tl.where(y.to(tl.float32) < x, up.to(tl.float16, bitcast=True), y)


@triton.jit
def _round_half_even(y):
    """torch.round for y >= 0: floor, then up if the fraction is above 1/2, or exactly 1/2 and floor is odd.
    (floor(y + 0.5) is wrong just below 1/2, where y + 0.5 rounds up to 1.)"""
    f = tl.floor(y)
    frac = y - f  # exact for |y| < 2^23
    odd = (f.to(tl.int32) & 1) == 1
    return tl.where((frac > 0.5) | ((frac == 0.5) & odd), f + 1.0, f)


@triton.jit
def _codes_to_words(codes, TT: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, U: tl.constexpr, M: tl.constexpr):
    """codes int32 [TT, D] (TT a multiple of BLOCK = U * M) -> words int32 [TT / BLOCK, M, D]."""
    c4 = tl.reshape(codes, (TT // (U * M), U, M, D))
    shifts = (tl.arange(0, U) * BITS)[None, :, None, None]
    return tl.sum(c4 << shifts, axis=1)  # planes own disjoint bits: the sum is their or


@triton.jit
def _load_codes(
    p_ptr, i, valid, spr, D: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr, M: tl.constexpr, BLK: tl.constexpr
):
    """Codes int32 [len(i), D] of storage positions i (any order) from packed storage at p_ptr (row stride spr)."""
    d = tl.arange(0, D)
    blk = i // BLK
    w_in = i % BLK
    plane = w_in // M
    row = blk * (NB * M) + w_in % M
    word = tl.zeros((i.shape[0], D), dtype=tl.int32)
    for j in tl.static_range(NB):
        byte = tl.load(p_ptr + (row + j * M)[:, None] * spr + d[None, :], mask=valid[:, None], other=0)
        word = word | (byte.to(tl.int32) << (8 * j))
    return (word >> (plane * BITS)[:, None]) & ((1 << BITS) - 1)


# ----------------------------------------------------------------------------------------------------------------
# 1. quantize + pack, straight into the cache's storage
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _quantize_pack_kernel(
    # input: x [B, H, n, D] (channel dim contiguous), tokens [0, n) go to storage positions [t0, t0 + n)
    x_ptr, sxb, sxh, sxt,
    valid_ptr, svb,  # [B, n] int8: 1 = may enter min/max (HAS_VALID)
    # output: packed uint8 [B, H, rows, D], scale/zero fp16 (per-token [B, H, T, D/G], per-channel [B, H, T/G, D])
    p_ptr, spb, sph, spr, n_rows,
    s_ptr, z_ptr, sqb, sqh, sqt,
    H, n, n_code, t0, ts0,  # n_code: positions coded (n, or n rounded up to G with PARTIAL_ZERO); ts0: first tile
    D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, U: tl.constexpr, NB: tl.constexpr, M: tl.constexpr,
    TT: tl.constexpr, AXIS_TOKEN: tl.constexpr, HAS_VALID: tl.constexpr, PARTIAL_ZERO: tl.constexpr,
):  # fmt: skip
    L: tl.constexpr = (1 << BITS) - 1
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    pos = ts0 + tl.program_id(1) * TT + tl.arange(0, TT)  # storage positions of this tile (whole blocks)
    i = pos - t0  # input token index
    d = tl.arange(0, D)
    inr = (i >= 0) & (i < n)
    coded = (i >= 0) & (i < n_code)
    x = tl.load(x_ptr + b * sxb + h * sxh + i[:, None] * sxt + d[None, :], mask=inr[:, None], other=0.0)
    x = x.to(tl.float32)
    v = inr
    if HAS_VALID:
        v = v & (tl.load(valid_ptr + b * svb + i, mask=inr, other=0) != 0)
    if PARTIAL_ZERO:  # the zero padding of a partial group takes part in its min/max (KIVI's fake quant)
        v = v | (coded & ~inr)

    if AXIS_TOKEN:
        # groups of G channels inside one token: [TT, D/G, G]
        xg = tl.reshape(x, (TT, D // G, G))
        vg = v[:, None, None]
        mn = tl.min(tl.where(vg, xg, float("inf")), axis=2)
        mx = tl.max(tl.where(vg, xg, float("-inf")), axis=2)
        mn = tl.where(v[:, None], mn, 0.0)  # a padding token: any params will do, the reference uses 0
        mx = tl.where(v[:, None], mx, 0.0)
        zero = _fp16_down(mn)
        z32 = zero.to(tl.float32)
        scale = _fp16_up(tl.div_rn(mx - z32, L * 1.0))
        s32 = scale.to(tl.float32)
        safe = tl.where(s32 > 0, s32, 1.0)
        c = _round_half_even(tl.div_rn(xg - z32[:, :, None], safe[:, :, None]))
        c = tl.minimum(tl.maximum(c, 0.0), L * 1.0)
        c = tl.where((s32 > 0)[:, :, None] & vg, c, 0.0)
        codes = tl.reshape(c.to(tl.int32), (TT, D))
        g = tl.arange(0, D // G)
        q_off = b * sqb + h * sqh + pos[:, None] * sqt + g[None, :]
        tl.store(s_ptr + q_off, scale, mask=coded[:, None])
        tl.store(z_ptr + q_off, zero, mask=coded[:, None])
    else:
        # groups of G tokens inside one channel: [TT/G, G, D] (the tile starts on a group boundary)
        xg = tl.reshape(x, (TT // G, G, D))
        vg = tl.reshape(tl.broadcast_to(v[:, None], (TT, D)), (TT // G, G, D))
        mn = tl.min(tl.where(vg, xg, float("inf")), axis=1)
        mx = tl.max(tl.where(vg, xg, float("-inf")), axis=1)
        anyv = tl.max(vg.to(tl.int32), axis=1) > 0
        mn = tl.where(anyv, mn, 0.0)
        mx = tl.where(anyv, mx, 0.0)
        zero = _fp16_down(mn)
        z32 = zero.to(tl.float32)
        scale = _fp16_up(tl.div_rn(mx - z32, L * 1.0))
        s32 = scale.to(tl.float32)
        safe = tl.where(s32 > 0, s32, 1.0)
        c = _round_half_even(tl.div_rn(xg - z32[:, None, :], safe[:, None, :]))
        c = tl.minimum(tl.maximum(c, 0.0), L * 1.0)
        c = tl.where((s32 > 0)[:, None, :] & vg, c, 0.0)
        codes = tl.reshape(c.to(tl.int32), (TT, D))
        gpos = ts0 + tl.program_id(1) * TT + tl.arange(0, TT // G) * G  # first storage position of each group
        gin = (gpos >= t0) & (gpos < t0 + n_code)
        q_off = b * sqb + h * sqh + (gpos // G)[:, None] * sqt + d[None, :]
        tl.store(s_ptr + q_off, scale, mask=gin[:, None])
        tl.store(z_ptr + q_off, zero, mask=gin[:, None])

    # pack: or the new codes into their words (positions outside [t0, t0 + n_code) contribute 0 and keep their
    # old bits; positions inside must be unwritten, as in the cache)
    codes = tl.where(coded[:, None], codes, 0)
    words = _codes_to_words(codes, TT, D, BITS, U, M)  # [TT/BLOCK, M, D]
    blk = (ts0 + tl.program_id(1) * TT) // (U * M) + tl.arange(0, TT // (U * M))
    r = tl.arange(0, M)
    base = p_ptr + b * spb + h * sph
    for j in tl.static_range(NB):
        rows = blk[:, None] * (NB * M) + j * M + r[None, :]  # [TT/BLOCK, M]
        ptr = base + rows[:, :, None] * spr + d[None, None, :]
        ok = (rows < n_rows)[:, :, None]
        old = tl.load(ptr, mask=ok, other=0).to(tl.int32)
        tl.store(ptr, (old | ((words >> (8 * j)) & 0xFF)).to(tl.uint8), mask=ok)


def _tile(spec: QuantSpec) -> int:
    return max(BLOCK, spec.group_size) if spec.axis == "channel" else BLOCK


def _check(spec: QuantSpec, D: int) -> None:
    G = spec.group_size
    if G & (G - 1) or D & (D - 1):
        raise ValueError(f"the Triton kernels need power-of-two group size and head dim (G={G}, D={D})")


def quantize_into(packed, scale, zero, x, spec: QuantSpec, t0: int, valid=None, partial: str = "exclude") -> None:
    """Quantize x [B, H, n, D] into storage positions [t0, t0 + n) of packed/scale/zero, in place.

    packed: uint8 [B, H, rows, D] (this layout, zero where not yet written); scale, zero: fp16 params tensors.
    Per-channel groups: t0 a multiple of G. valid [B, n] bool: positions allowed in min/max (codes 0 elsewhere).
    int format only (`quantizes`).
    """
    if not quantizes(spec):
        raise ValueError(f"the Triton quantize+pack kernel is int's; format={spec.format}: use reference.quantize")
    B, H, n, D = x.shape
    _check(spec, D)
    G = spec.group_size
    u, nb = word_layout(spec.bits)
    TT = _tile(spec)
    n_code = -(-n // G) * G if (spec.axis == "channel" and partial == "zero") else n
    if spec.axis == "channel" and t0 % G:
        raise ValueError(f"per-channel groups start on a multiple of G={G}; t0={t0}")
    ts0 = t0 // TT * TT
    tiles = -(-(t0 + n_code - ts0) // TT)
    x = x if x.stride(-1) == 1 else x.contiguous()
    vmask = valid.to(torch.int8).expand(B, n).contiguous() if valid is not None else torch.empty(1, 1, device=x.device)
    _quantize_pack_kernel[(B * H, tiles)](
        x, x.stride(0), x.stride(1), x.stride(2),
        vmask, vmask.stride(0),
        packed, packed.stride(0), packed.stride(1), packed.stride(2), packed.shape[2],
        scale, zero, scale.stride(0), scale.stride(1), scale.stride(2),
        H, n, n_code, t0, ts0,
        D=D, G=G, BITS=spec.bits, U=u, NB=nb, M=BLOCK // u, TT=TT,
        AXIS_TOKEN=spec.axis == "token", HAS_VALID=valid is not None, PARTIAL_ZERO=partial == "zero",
    )  # fmt: skip


def quantize_pack(x: torch.Tensor, spec: QuantSpec, valid=None, partial: str = "zero"):
    """Standalone: x [B, H, T, D] -> (packed uint8 [B, H, ceil(T_pad/BLOCK)*BLOCK*bits/8, D], scale, zero),
    the same bytes as `pack.PackedQTensor.from_qtensor(reference.quantize(x, spec, valid, partial))`. int only."""
    if not quantizes(spec):
        raise ValueError(f"the Triton quantize+pack kernel is int's; format={spec.format}: use reference.quantize")
    B, H, T, D = x.shape
    G = spec.group_size
    t_pad = -(-T // G) * G if spec.axis == "channel" else T
    blocks = -(-max(t_pad, 1) // max(BLOCK, _tile(spec))) * max(BLOCK, _tile(spec)) // BLOCK
    packed = torch.zeros(B, H, blocks * BLOCK * spec.bits // 8, D, dtype=torch.uint8, device=x.device)
    pshape = (B, H, T, D // G) if spec.axis == "token" else (B, H, t_pad // G, D)
    scale = torch.zeros(pshape, dtype=torch.float16, device=x.device)
    zero = torch.zeros_like(scale)
    v = None if valid is None else valid.to(torch.bool).expand(B, H, T)[:, 0]
    if valid is not None and valid.expand(B, H, T).ne(v[:, None]).any():
        raise ValueError("the kernel takes one validity mask per row ([B, T]), shared by heads")
    quantize_into(packed, scale, zero, x, spec, 0, v, partial)
    rows = -(-t_pad // BLOCK) * BLOCK * spec.bits // 8
    return packed[:, :, :rows], scale, zero


# ----------------------------------------------------------------------------------------------------------------
# 2. unpack + dequantize
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _code_values(c, t_ptr, ok, HAS_TABLE: tl.constexpr):
    """The value of each code (int32 [rows, D]) before scale and zero: table[c] (fp32), or c itself (int)."""
    if HAS_TABLE:
        return tl.load(t_ptr + c, mask=ok[:, None], other=0.0)
    return c.to(tl.float32)


@triton.jit
def _dequant_kernel(
    p_ptr, spb, sph, spr,
    s_ptr, z_ptr, sqb, sqh, sqt,
    t_ptr,  # fp32 [2^BITS] code values (HAS_TABLE)
    o_ptr, sob, soh, sot,
    H, n,
    D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr, M: tl.constexpr, BLK: tl.constexpr,
    TT: tl.constexpr, AXIS_TOKEN: tl.constexpr, HAS_TABLE: tl.constexpr, HAS_ZERO: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    pos = tl.program_id(1) * TT + tl.arange(0, TT)
    d = tl.arange(0, D)
    ok = pos < n
    c = _load_codes(p_ptr + b * spb + h * sph, pos, ok, spr, D, BITS, NB, M, BLK)
    c = _code_values(c, t_ptr, ok, HAS_TABLE)
    if AXIS_TOKEN:
        q_off = b * sqb + h * sqh + pos[:, None] * sqt + (d // G)[None, :]
    else:
        q_off = b * sqb + h * sqh + (pos // G)[:, None] * sqt + d[None, :]
    s = tl.load(s_ptr + q_off, mask=ok[:, None], other=0.0).to(tl.float32)
    out = c * s
    if HAS_ZERO:  # two roundings, as the reference (the launch disables fma contraction)
        out = out + tl.load(z_ptr + q_off, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(o_ptr + b * sob + h * soh + pos[:, None] * sot + d[None, :], out, mask=ok[:, None])


def unpack_dequantize(packed, scale, zero, spec: QuantSpec, n: int) -> torch.Tensor:
    """fp32 [B, H, n, D] = table[code] * scale + zero of storage positions [0, n), the spec's format (the
    reference's `dequantize`); zero None for formats without a zero point."""
    B, H, _, D = packed.shape
    _check(spec, D)
    bits = code_format(spec).code_bits
    u, nb = word_layout(bits)
    out = torch.empty(B, H, n, D, dtype=torch.float32, device=packed.device)
    if n == 0:
        return out
    table, has_table, zero, has_zero = _table_and_zero(spec, zero, packed.device)
    TT = 64
    _dequant_kernel[(B * H, -(-n // TT))](
        packed, packed.stride(0), packed.stride(1), packed.stride(2),
        scale, zero, scale.stride(0), scale.stride(1), scale.stride(2),
        table,
        out, out.stride(0), out.stride(1), out.stride(2),
        H, n,
        D=D, G=spec.group_size, BITS=bits, NB=nb, M=BLOCK // u, BLK=BLOCK, TT=TT,
        AXIS_TOKEN=spec.axis == "token", HAS_TABLE=has_table, HAS_ZERO=has_zero, enable_fp_fusion=False,
    )  # fmt: skip
    return out


def dequantize_packed(packed, scale, zero, spec: QuantSpec, length: int, dtype=torch.float32) -> torch.Tensor:
    """Standalone twin of `reference.dequantize(QTensor)` for `quantize_pack`'s output."""
    return unpack_dequantize(packed, scale, zero, spec, length).to(dtype)


# ----------------------------------------------------------------------------------------------------------------
# 3. fused decode attention over packed K/V (GQA; fp sinks and fp windows included)
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _deq_rows(
    p_ptr, spr, s_ptr, z_ptr, sqt, t_ptr, i, ok,
    D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr, M: tl.constexpr, BLK: tl.constexpr,
    AXIS_TOKEN: tl.constexpr, HAS_TABLE: tl.constexpr, HAS_ZERO: tl.constexpr,
):  # fmt: skip
    """Dequantized rows [len(i), D] (fp32) of storage positions i: table[code] * scale (+ zero); zero where not ok."""
    d = tl.arange(0, D)
    c = _code_values(_load_codes(p_ptr, i, ok, spr, D, BITS, NB, M, BLK), t_ptr, ok, HAS_TABLE)
    if AXIS_TOKEN:
        q_off = i[:, None] * sqt + (d // G)[None, :]
    else:
        q_off = (i // G)[:, None] * sqt + d[None, :]
    s = tl.load(s_ptr + q_off, mask=ok[:, None], other=0.0).to(tl.float32)
    out = c * s
    if HAS_ZERO:
        out = out + tl.load(z_ptr + q_off, mask=ok[:, None], other=0.0).to(tl.float32)
    return out


@triton.jit
def _fp_rows(ptr, st, idx, ok, D: tl.constexpr):
    d = tl.arange(0, D)
    return tl.load(ptr + idx[:, None] * st + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)


@triton.jit
def _decode_attn_kernel(
    q_ptr, sqb_, sqh_,  # query [B, Hq, 1, D], pre-scaled
    o_ptr, sob, soh,  # output [B, 1, Hq, D] (fp32)
    # sinks [B, Hkv, S_cap, D] (keys, values), the first s positions
    sk_ptr, sv_ptr, ssb, ssh, sst, s,
    # key history: packed + params (+ the format's table), positions [S, S + qk); key window [B, Hkv, Wk, D] =
    # positions [N - Wk, N)
    kp_ptr, kpb, kph, kpr, ks_ptr, kz_ptr, kqb, kqh, kqt, kt_ptr, qk,
    kw_ptr, kwb, kwh, kwt, Wk, wk,
    # value history and window, the same
    vp_ptr, vpb, vph, vpr, vs_ptr, vz_ptr, vqb, vqh, vqt, vt_ptr, qv,
    vw_ptr, vwb, vwh, vwt, Wv, wv,
    Hq, R, N, S,
    D: tl.constexpr, BLK: tl.constexpr, TT: tl.constexpr,
    KG: tl.constexpr, KBITS: tl.constexpr, KNB: tl.constexpr, KM: tl.constexpr, K_TOKEN: tl.constexpr,
    K_TABLE: tl.constexpr, K_ZERO: tl.constexpr,
    VG: tl.constexpr, VBITS: tl.constexpr, VNB: tl.constexpr, VM: tl.constexpr, V_TOKEN: tl.constexpr,
    V_TABLE: tl.constexpr, V_ZERO: tl.constexpr,
):  # fmt: skip
    # one program per (batch row, query head); its kv head is hq // R (GQA without repeating K/V)
    pid = tl.program_id(0)
    b, hq = pid // Hq, pid % Hq
    hk = hq // R
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sqb_ + hq * sqh_ + d).to(tl.float32)
    m = tl.full((), float("-inf"), tl.float32)  # running max, normaliser, weighted sum (online softmax)
    l_sum = tl.zeros((), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for t0 in range(0, N, TT):
        pos = t0 + tl.arange(0, TT)
        live = pos < N
        is_sink = pos < s
        # keys: sink | history | window, each position from exactly one source
        k_hist = (pos >= S) & (pos < S + qk)
        k_win = live & (pos >= N - wk)
        k = _fp_rows(sk_ptr + b * ssb + hk * ssh, sst, pos, is_sink, D)
        k += _deq_rows(
            kp_ptr + b * kpb + hk * kph, kpr, ks_ptr + b * kqb + hk * kqh, kz_ptr + b * kqb + hk * kqh, kqt, kt_ptr,
            pos - S, k_hist, D, KG, KBITS, KNB, KM, BLK, K_TOKEN, K_TABLE, K_ZERO,
        )  # fmt: skip
        k += _fp_rows(kw_ptr + b * kwb + hk * kwh, kwt, pos - (N - Wk), k_win, D)
        scores = tl.sum(k * q[None, :], axis=1)
        scores = tl.where(live, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new)
        # values: sink | history | window (their own split)
        v_hist = (pos >= S) & (pos < S + qv)
        v_win = live & (pos >= N - wv)
        v = _fp_rows(sv_ptr + b * ssb + hk * ssh, sst, pos, is_sink, D)
        v += _deq_rows(
            vp_ptr + b * vpb + hk * vph, vpr, vs_ptr + b * vqb + hk * vqh, vz_ptr + b * vqb + hk * vqh, vqt, vt_ptr,
            pos - S, v_hist, D, VG, VBITS, VNB, VM, BLK, V_TOKEN, V_TABLE, V_ZERO,
        )  # fmt: skip
        v += _fp_rows(vw_ptr + b * vwb + hk * vwh, vwt, pos - (N - Wv), v_win, D)
        l_sum = l_sum * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    tl.store(o_ptr + b * sob + hq * soh + d, acc / l_sum)


def decode_attention(view: DecodeView, query: torch.Tensor, mask, scaling: float) -> torch.Tensor:
    """Triton twin of `torch_path.decode_attention_torch`: query [B, Hq, 1, D] -> [B, 1, Hq, D]."""
    check_codes_only(view, "the Triton decode kernel")
    if mask is not None:  # padded batches take the gather path; a mask here is not expected
        return decode_attention_torch(view, query, mask, scaling)
    B, Hq, _, D = query.shape
    N, S = view.N, view.sink_tokens
    ks, vs = view.keys, view.values
    Hkv = ks.window.shape[1]
    q = (query.float() * scaling).contiguous()
    out = torch.empty(B, 1, Hq, D, dtype=torch.float32, device=query.device)
    dummy_p = torch.zeros(1, 1, 1, 1, dtype=torch.uint8, device=query.device)
    dummy_q = torch.zeros(1, 1, 1, 1, dtype=torch.float16, device=query.device)
    dummy_t = torch.zeros(1, dtype=torch.float32, device=query.device)
    kp, ksc, kz = (ks.codes, ks.scale, ks.zero) if ks.codes is not None else (dummy_p, dummy_q, dummy_q)
    vp, vsc, vz = (vs.codes, vs.scale, vs.zero) if vs.codes is not None else (dummy_p, dummy_q, dummy_q)
    k_zero, v_zero = kz is not None, vz is not None  # formats without a zero point (fp8) add none
    kz, vz = (kz if k_zero else dummy_q), (vz if v_zero else dummy_q)
    kt, vt = (ks.table if ks.table is not None else dummy_t), (vs.table if vs.table is not None else dummy_t)
    ku, knb = word_layout(ks.bits)
    vu, vnb = word_layout(vs.bits)
    sk, sv = ks.sink, vs.sink
    kw, vw = ks.window, vs.window
    _decode_attn_kernel[(B * Hq,)](
        q, q.stride(0), q.stride(1),
        out, out.stride(0), out.stride(2),
        sk, sv, sk.stride(0), sk.stride(1), sk.stride(2), min(S, N),
        kp, kp.stride(0), kp.stride(1), kp.stride(2), ksc, kz, ksc.stride(0), ksc.stride(1), ksc.stride(2), kt, ks.n,
        kw, kw.stride(0), kw.stride(1), kw.stride(2), kw.shape[2], ks.w,
        vp, vp.stride(0), vp.stride(1), vp.stride(2), vsc, vz, vsc.stride(0), vsc.stride(1), vsc.stride(2), vt, vs.n,
        vw, vw.stride(0), vw.stride(1), vw.stride(2), vw.shape[2], vs.w,
        Hq, Hq // Hkv, N, S,
        D=D, BLK=BLOCK, TT=64,
        KG=ks.group_size, KBITS=ks.bits, KNB=knb, KM=BLOCK // ku, K_TOKEN=ks.axis == "token",
        K_TABLE=ks.table is not None, K_ZERO=k_zero,
        VG=vs.group_size, VBITS=vs.bits, VNB=vnb, VM=BLOCK // vu, V_TOKEN=vs.axis == "token",
        V_TABLE=vs.table is not None, V_ZERO=v_zero,
    )  # fmt: skip
    return out.to(query.dtype)


def reference_qtensor(packed, scale, zero, spec: QuantSpec, length: int, dtype=torch.float32) -> QTensor:
    """The kernel's output as a reference `QTensor` (for tests)."""
    from kvq_lab.quant.pack import PackedQTensor

    return PackedQTensor(packed, scale, zero, spec, length, dtype).to_qtensor()
