"""Triton kernels for the packed cache: quantize+pack, unpack+dequantize, fused decode attention over packed K/V.

What they compute is pinned by the PyTorch reference (`kvq_lab.quant.reference`, `kvq_lab.quant.pack`,
`kvq_lab.kernels.torch_path.decode_attention_torch`); tests run them on CPU under `TRITON_INTERPRET=1` and require
identical codes and parameters, identical dequantized values, and attention within fp32 rounding
(tests/test_triton_compile.py also builds every launch for sm_90 without a GPU). Entry points take plain tensors
(decode attention: a `kvq_lab.kernels.view.DecodeView`, with its `rope` and `pads` extensions, the C kernel's
semantics: section 3); `kvq_lab.cache.backends` wires them in.

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

import os

import torch
import triton
import triton.language as tl

from kvq_lab.quant.formats import EVERY_FORMAT, add_kernel_support
from kvq_lab.quant.pack import BLOCK, word_layout
from kvq_lab.quant.reference import QTensor, code_format
from kvq_lab.quant.spec import QuantSpec

from .torch_path import decode_attention_torch
from .view import DecodeView, Unsupported, check_codes_only
from .workspace import const

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
def _load_codes(p_ptr, i, valid, spr, d, BITS: tl.constexpr, NB: tl.constexpr, M: tl.constexpr, BLK: tl.constexpr):
    """Codes int32 [len(i), len(d)] of storage positions i and channels d (any order) from packed storage at p_ptr
    (row stride spr)."""
    blk = i // BLK
    w_in = i % BLK
    plane = w_in // M
    row = blk * (NB * M) + w_in % M
    word = tl.load(p_ptr + row[:, None] * spr + d[None, :], mask=valid[:, None], other=0).to(tl.int32)
    for j in tl.static_range(1, NB):
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
    c = _load_codes(p_ptr + b * spb + h * sph, pos, ok, spr, d, BITS, NB, M, BLK)
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
# 3. fused decode attention over packed K/V (GQA; sinks, history, window; rope=pre keys; left-padded rows)
# ----------------------------------------------------------------------------------------------------------------
#
# The C kernel's semantics (`cpu_kernel.c`), on a grid of (batch row x kv head, chunk of positions) programs
# (flash-decoding: long caches split over programs, then `_combine_kernel` merges the chunks' softmax partials).
# A program reads each K/V row once for all R query heads of its kv head (GQA without repeating K/V).
# Position p of row b (j = p - pads[b], its index among the row's real tokens; pads 0 without `rows`):
#     j < 0                   padding: score -inf, weight 0, never read
#     j < s                   sink j, exact (post-RoPE keys), the model's dtype
#     t = p - start < count   history, storage position t: table[code] * scale (+ zero), two roundings (no fma)
#     else                    window row W - (N - p) of the window buffer, the model's dtype
# (start, count) = (starts[b], counts[b]) of the stream with `rows`, (s, n) without: keys and values split apart.
# rope=pre: history keys are stored pre-RoPE (sinks and window as the model made them, post-RoPE); each history key
# is rotated at its position id pos[b, p] from the fp32 table rows c = cos[id], s = sin[id] ([D/2]) in rotate_half's
# pairing, the reference's order of operations:
#     k[i] = k[i] * c[i] - k[i + D/2] * s[i],   k[i + D/2] = k[i + D/2] * c[i] + k[i] * s[i]
# so keys are read as their two halves. An id outside [0, P) poisons the row (NaN score: the output is NaN, never a
# silent wrong answer; the launcher refuses such ids on CPU tensors).


@triton.jit
def _deq_rows(
    p_ptr, spr, s_ptr, z_ptr, sqt, t_ptr, i, ok, d,
    G: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr, M: tl.constexpr, BLK: tl.constexpr,
    AXIS_TOKEN: tl.constexpr, HAS_TABLE: tl.constexpr, HAS_ZERO: tl.constexpr,
):  # fmt: skip
    """Dequantized rows [len(i), len(d)] (fp32) of storage positions i, channels d: table[code] * scale (+ zero);
    zero where not ok."""
    c = _code_values(_load_codes(p_ptr, i, ok, spr, d, BITS, NB, M, BLK), t_ptr, ok, HAS_TABLE)
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
def _fp_rows(ptr, st, idx, ok, d):
    """Rows [len(idx), len(d)] (fp32) idx of an exact buffer (row stride st) in the model's dtype; zero where not ok."""
    return tl.load(ptr + idx[:, None] * st + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)


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
    for t0 in range(p_lo, p_hi, TT):
        p = t0 + tl.arange(0, TT)
        j = p - pad
        live = (p < p_hi) & (j >= 0)
        sink = live & (j < s)
        rest = live & (j >= s)
        # keys, as two halves [TT, D/2]
        kt = p - k0
        k_hist = rest & (kt < kc)
        k_win = rest & (kt >= kc)
        krow = Wk - (N - p)
        s_lo = _fp_rows(ksink, kskt, j, sink, dl)
        s_hi = _fp_rows(ksink, kskt, j, sink, dh)
        x_lo = _deq_rows(kpack, kpr, kscale, kzero, kqt, kt_ptr, kt, k_hist, dl, KG, KBITS, KNB, KM, BLK, K_TOKEN,
                         K_TABLE, K_ZERO)  # fmt: skip
        x_hi = _deq_rows(kpack, kpr, kscale, kzero, kqt, kt_ptr, kt, k_hist, dh, KG, KBITS, KNB, KM, BLK, K_TOKEN,
                         K_TABLE, K_ZERO)  # fmt: skip
        x_lo += _fp_rows(kwin, kwt, krow, k_win, dl)
        x_hi += _fp_rows(kwin, kwt, krow, k_win, dh)
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
        v = _fp_rows(vsink, vskt, j, sink, d)
        v += _deq_rows(vpack, vpr, vscale, vzero, vqt, vt_ptr, vt, v_hist, d, VG, VBITS, VNB, VM, BLK, V_TOKEN,
                       V_TABLE, V_ZERO)  # fmt: skip
        v += _fp_rows(vwin, vwt, Wv - (N - p), v_win, d)
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


@triton.jit
def _combine_kernel(part_ptr, o_ptr, sob, soh, Hkv, R, C, D: tl.constexpr, RP: tl.constexpr):
    """The C chunks' partials of one (batch row, kv head) -> its R query heads' outputs (flash-decoding's merge)."""
    bh = tl.program_id(0)
    b, hk = bh // Hkv, bh % Hkv
    r = tl.arange(0, RP)
    rok = r < R
    d = tl.arange(0, D)
    base = part_ptr + bh * C * RP * (D + 2) + r * (D + 2)
    mx = tl.full((RP,), float("-inf"), tl.float32)
    for c in range(C):
        mx = tl.maximum(mx, tl.load(base + c * RP * (D + 2), mask=rok, other=float("-inf")))
    shift = tl.where(mx == float("-inf"), 0.0, mx)
    total = tl.zeros((RP,), tl.float32)
    out = tl.zeros((RP, D), tl.float32)
    for c in range(C):
        pc = base + c * RP * (D + 2)
        f = tl.exp(tl.load(pc, mask=rok, other=float("-inf")) - shift)  # a chunk with nothing attended: 0
        total += f * tl.load(pc + 1, mask=rok, other=0.0)
        out += f[:, None] * tl.load(pc[:, None] + 2 + d[None, :], mask=rok[:, None], other=0.0)
    out = out / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(o_ptr + b * sob + (hk * R + r)[:, None] * soh + d[None, :], out, mask=rok[:, None])


XDTS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the model's dtype (window, sinks, query)
MAX_TILE = 32  # positions per loop step, at most (`_attn_tile`)
MIN_CHUNK = 256  # positions per program at least (a program's fixed cost: its query, one partial)


def _runs_here(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def supports(view: DecodeView, query: torch.Tensor, mask=None) -> bool:
    """Whether the kernel takes this view, query and mask: a CUDA device (CPU tensors under TRITON_INTERPRET=1), an
    fp32, fp16 or bf16 model (query, sinks and windows in one dtype), a power-of-two head dim, masks shared by the
    query heads ([B or 1, 1, 1, >= N]), rope=pre keys from a `RopeView` (int32 position ids), padded rows with their
    int64 starts and counts; never `hadamard` (the caller maps query and output around this kernel). Otherwise
    `decode_attention` takes the PyTorch path for a plain view and raises `Unsupported` for a view with `rope`, `pads`
    or `hadamard` (`kvq_lab.cache.attention` rebuilds or materializes those)."""
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


def _chunk(N: int, programs: int, device: torch.device, tile: int) -> int:
    """Positions per program: enough programs to fill the GPU (about two per SM), at least MIN_CHUNK positions each."""
    if device.type != "cuda":
        sms = 1
    else:
        if device not in _SMS:
            _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
        sms = _SMS[device]
    per = -(-N // max(1, -(-2 * sms // programs)))
    return max(MIN_CHUNK, -(-per // tile) * tile)


def decode_attention(view: DecodeView, query: torch.Tensor, mask, scaling: float, chunk: int | None = None):
    """Triton twin of `torch_path.decode_attention_torch` and `cpu_kernel.decode_attention`: query [B, Hq, 1, D] ->
    [B, 1, Hq, D] in the query's dtype (fp32 accumulation). Reads `view.rope` (pre-RoPE keys rotated in the kernel)
    and `view.pads` (left-padded rows). chunk: positions per program (a multiple of `_attn_tile`, 8 always is; default:
    `_chunk`)."""
    check_codes_only(view, "the Triton decode kernel")
    if not supports(view, query, mask):
        if view.rope is not None or view.pads is not None or view.hadamard is not None:  # the PyTorch path reads none
            raise Unsupported(
                "the Triton kernel cannot take this query, mask or view (`supports` says why not); rebuild the view "
                "without `rope`, `pads` and `hadamard` for torch_path.decode_attention_torch (kvq_lab.cache.attention "
                "does)"
            )
        return decode_attention_torch(view, query, mask, scaling)
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
        _combine_kernel[(B * Hkv,)](part, out, out.stride(0), out.stride(1), Hkv, R, C, D=D, RP=RP)
    out = out.view(B, 1, Hq, D)
    return out if query.dtype == torch.float32 else out.to(query.dtype)


def reference_qtensor(packed, scale, zero, spec: QuantSpec, length: int, dtype=torch.float32) -> QTensor:
    """The kernel's output as a reference `QTensor` (for tests)."""
    from kvq_lab.quant.pack import PackedQTensor

    return PackedQTensor(packed, scale, zero, spec, length, dtype).to_qtensor()
