"""Quantize + pack: x [B, H, n, D] -> int codes, fp16 scale and zero point, written straight into the cache's storage.

Asymmetric min/max quantization in groups of G (along channels for per-token groups, along tokens for per-channel
groups), codes packed into the layout of `common` (`kvq_lab/quant/pack.py`). A grid of (batch row x head, tile of
TT storage positions) programs; a tile holds whole blocks of BLOCK tokens and, per channel, whole groups of G.

Reference: `kvq_lab.quant.reference.quantize` then `kvq_lab.quant.pack.PackedQTensor.from_qtensor`; tests require
identical codes and parameters (tests/kernels/test_triton.py, under `TRITON_INTERPRET=1`). Bit parity needs the
reference's exact arithmetic: IEEE division (`tl.div_rn`; Triton's `/` is approximate on GPU), round half to even, and
fp16 parameters rounded outward (zero down, scale up, by nudging the fp16 bit pattern one ulp).

Only int's arithmetic is here: the cache quantizes other formats with the reference and stores the same bits
(`quantizes`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvq_lab.quant.pack import BLOCK, word_layout
from kvq_lab.quant.reference import QTensor
from kvq_lab.quant.spec import QuantSpec

from .common import check_power_of_two


def quantizes(spec: QuantSpec) -> bool:
    """Whether the quantize+pack kernel implements the spec's format (int); others quantize with the reference."""
    return spec.format == "int"


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


# ----------------------------------------------------------------------------------------------------------------
# The kernel
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


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------


def _tile(spec: QuantSpec) -> int:
    """Positions per program: whole blocks, and whole groups of G tokens (a group's min/max is one program's)."""
    return max(BLOCK, spec.group_size) if spec.axis == "channel" else BLOCK


def quantize_into(packed, scale, zero, x, spec: QuantSpec, t0: int, valid=None, partial: str = "exclude") -> None:
    """Quantize x [B, H, n, D] into storage positions [t0, t0 + n) of packed/scale/zero, in place.

    packed: uint8 [B, H, rows, D] (this layout, zero where not yet written); scale, zero: fp16 params tensors.
    Per-channel groups: t0 a multiple of G. valid [B, n] bool: positions allowed in min/max (codes 0 elsewhere).
    int format only (`quantizes`).
    """
    if not quantizes(spec):
        raise ValueError(f"the Triton quantize+pack kernel is int's; format={spec.format}: use reference.quantize")
    B, H, n, D = x.shape
    check_power_of_two(spec, D)
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


def reference_qtensor(packed, scale, zero, spec: QuantSpec, length: int, dtype=torch.float32) -> QTensor:
    """The kernel's output as a reference `QTensor` (for tests)."""
    from kvq_lab.quant.pack import PackedQTensor

    return PackedQTensor(packed, scale, zero, spec, length, dtype).to_qtensor()
