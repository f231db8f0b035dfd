"""What the Triton kernels share: the packed layout's reader, the code formats' values, the shape check.

Layout (see `kvq_lab/quant/pack.py`): a tensor's codes are stored along tokens in blocks of BLOCK = 32 tokens;
a block is `U` planes of `M = BLOCK / U` tokens, and word (r, d) holds the codes of tokens r, r + M, ... of the
block, `BITS` bits each, least significant first, as `NB` little-endian bytes stored in `NB` byte planes (NB = 1, or
3 for 3-bit codes, 5 for 5-bit codes: a 40-bit word, read into an int64):

    packed[b, h, blk * NB * M + j * M + r, d] = byte j of word (blk, r, d)        j < NB, r < M

Parameters are fp16: [B, H, T, D/G] for per-token groups (along channels), [B, H, T/G, D] for per-channel groups
(along tokens).

Code formats (`kvq_lab.quant.formats`): a code's value before scale and zero is one gather from the format's fp32
table of 2^bits entries (HAS_TABLE; int's codes are their own values and skip it), so every kernel that reads codes
reads every format: declared here, where the gather is.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvq_lab.quant.formats import EVERY_FORMAT, add_kernel_support
from kvq_lab.quant.spec import QuantSpec

# dequantization and decode attention load table[code] for any fp32 table of 2^bits entries: every code format
add_kernel_support("triton", EVERY_FORMAT)


def check_power_of_two(spec: QuantSpec, D: int) -> None:
    """The kernels tile groups and channels with `tl.arange`, whose lengths are powers of two."""
    G = spec.group_size
    if G & (G - 1) or D & (D - 1):
        raise ValueError(f"the Triton kernels need power-of-two group size and head dim (G={G}, D={D})")


@triton.jit
def load_codes(p_ptr, i, valid, spr, d, BITS: tl.constexpr, NB: tl.constexpr, M: tl.constexpr, BLK: tl.constexpr):
    """Codes int32 [len(i), len(d)] of storage positions i and channels d (any order) from packed storage at p_ptr
    (row stride spr)."""
    blk = i // BLK
    w_in = i % BLK
    plane = w_in // M
    row = blk * (NB * M) + w_in % M
    word = tl.load(p_ptr + row[:, None] * spr + d[None, :], mask=valid[:, None], other=0)
    # the word in an integer wide enough for it: int32 up to 3-byte words (3 bits), int64 for 5-byte words (5-bit
    # codes: the top one starts at bit 35); NB is a constant, so only one branch is compiled
    if NB > 3:
        word = word.to(tl.int64)
    else:
        word = word.to(tl.int32)
    for j in tl.static_range(1, NB):
        byte = tl.load(p_ptr + (row + j * M)[:, None] * spr + d[None, :], mask=valid[:, None], other=0)
        word = word | (byte.to(word.dtype) << (8 * j))
    return ((word >> (plane * BITS)[:, None]) & ((1 << BITS) - 1)).to(tl.int32)


@triton.jit
def code_values(c, t_ptr, ok, HAS_TABLE: tl.constexpr):
    """The value of each code (int32 [rows, D]) before scale and zero: table[c] (fp32), or c itself (int)."""
    if HAS_TABLE:
        return tl.load(t_ptr + c, mask=ok[:, None], other=0.0)
    return c.to(tl.float32)


@triton.jit
def deq_rows(
    p_ptr, spr, s_ptr, z_ptr, sqt, t_ptr, i, ok, d,
    G: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr, M: tl.constexpr, BLK: tl.constexpr,
    AXIS_TOKEN: tl.constexpr, HAS_TABLE: tl.constexpr, HAS_ZERO: tl.constexpr,
):  # fmt: skip
    """Dequantized rows [len(i), len(d)] (fp32) of storage positions i, channels d: table[code] * scale (+ zero);
    zero where not ok."""
    c = code_values(load_codes(p_ptr, i, ok, spr, d, BITS, NB, M, BLK), t_ptr, ok, HAS_TABLE)
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
def fp_rows(ptr, st, idx, ok, d):
    """Rows [len(idx), len(d)] (fp32) idx of an exact buffer (row stride st) in the model's dtype; zero where not ok."""
    return tl.load(ptr + idx[:, None] * st + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)


@triton.jit
def row_layout(pads_ptr, kst_ptr, kcnt_ptr, vst_ptr, vcnt_ptr, b):
    """Left-padded row b of the decode kernels (int64 [B] each): (its padding positions, the keys' first history
    position and count of history positions, the values' same). Without padded rows the kernels use (0, s, n_k, s,
    n_v) instead: no padding, history right after the s sinks."""
    return (
        tl.load(pads_ptr + b),
        tl.load(kst_ptr + b),
        tl.load(kcnt_ptr + b),
        tl.load(vst_ptr + b),
        tl.load(vcnt_ptr + b),
    )


@triton.jit
def combine_kernel(part_ptr, o_ptr, sob, soh, Hkv, R, C, D: tl.constexpr, RP: tl.constexpr):
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
