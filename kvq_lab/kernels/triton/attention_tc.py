"""Decode attention on tensor cores over packed int K/V: the fast route of `attention.decode_attention`.

query [B, Hq, 1, D] (fp16 / bf16 model) -> fp32 partials merged by `common.combine_kernel`. The same semantics as the
general route (`attention._decode_attn_kernel`, the C kernel, `torch_path.decode_attention_torch`): sinks, packed
history, full-precision window, left-padded rows, an additive mask shared by the query heads; in the model's half
precision, as fp16 attention computes (tests bound its error by twice that of SDPA in the same dtype).

Grid: (batch row x kv head, split). Splits 0..S-1 each take a contiguous run of history tiles where both keys and
values are quantized (the bulk of a long cache); split S takes the rest: sinks, and the positions past that run (one
stream's window while the other's history, then both windows): at most sinks + window + a group of tokens.

One program holds the R query heads of its kv head as the rows of a [BH, D] tile (BH >= 16: the M dimension of the
MMA), so each K/V byte is read once for all of them, and both products are `tl.dot` on fp16 or bf16 operands with
fp32 accumulation. Where R < 16 and keys or values are grouped per channel, the rows are NSLOT slots of the R heads,
slot j reading the j-th group of the tile (`_rows`): the M dimension filled with groups rather than zero rows. The
slots of a head share one running max; their sums and values add up at the end.

- Codes become half-precision values without an int-to-float conversion: a code c < 2^10 ORed into the mantissa of
  1024.0 (fp16 0x6400) is the fp16 1024 + c, and 1024 + c - 1024 is c exactly (bf16 models convert that to bf16).
  A tile of BN tokens (whole packing blocks of 32) is NB * M bytes per channel read as [NB * M, D] rows
  (contiguous in the cache's layout, `kvq_lab/quant/pack.py`), each byte shifted to its U codes: [NB, U, M, D]
  -> [BN, D] in token order.
- Channel-axis streams (a group is G tokens of one channel; BN = NSLOT x G): keys fold their group's scale into the
  query rows of its slot and add the zero as a score bias, q.k = (q * s) . c + q . z (q * s as hi + lo halves: two
  MMAs keep fp32 precision); values apply them to the slot's product, sum_t p v = s * (p . c) + z * sum_t p. One
  [BH, D] product per NSLOT groups instead of one per code.
- Token-axis streams (a group is G channels of one token): k = c * s + z per element in half precision (one fma), as
  the per-token parameters vary along both tile axes.
- Softmax in base 2 (the query pre-multiplied by log2 e); partial maxima stored in natural units for the merge.

Left-padded rows: the tile walks the storage positions of the channel-axis stream (its groups align on each row's
own tokens); the other stream (per-token, indexed by absolute position) is then read `RAGGED` (per-token codes
gathered at an offset), where padding made the two storages disagree.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvq_lab.quant.pack import BLOCK, word_layout

from ..view import DecodeView
from .common import fp_rows, load_codes

LOG2E = 1.4426950408889634
TAIL = 32  # positions per step of the last split (sinks, windows, the end of a history)
TAIL_T = tl.constexpr(TAIL)
MAX_HEADS = 64  # query heads per kv head the [BH, D] tile takes (BH <= 64)
HEAD_DIMS = (64, 128, 256)
FAST_BITS = (1, 2, 4, 8)  # codes of one byte's planes, exact in fp16 and bf16 (< 2^8)
MIN_SPLIT_TILES = 4  # history tiles per split at least (a split's fixed cost: its query, a partial)
NUM_WARPS, NUM_STAGES = 4, 2  # launch options (no GPU measurement has tuned them yet)


@triton.jit
def _half_codes(bits16, BF16: tl.constexpr):
    """int16 codes (< 2^10) -> their values in the model's half precision by bit operations: c ORed into the mantissa
    of 1024.0 (fp16 0x6400) is the fp16 1024 + c, and 1024 + c - 1024 is c exactly. bf16 models take that fp16
    value to bf16 (a float conversion, exact for c < 2^8: bf16 arithmetic on a bitcast value is not what the
    interpreter computes, so the tests could not check a bf16 magic number)."""
    h = (bits16 | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    if BF16:
        h = h.to(tl.bfloat16)
    return h


@triton.jit
def _codes_tile(p_ptr, spr, nrows, t0, d, BN: tl.constexpr, BITS: tl.constexpr, D: tl.constexpr, BF16: tl.constexpr):
    """Codes of storage positions [t0, t0 + BN) (t0 and BN multiples of the 32-token packing block) as half
    [BN, D], from NB * M contiguous rows of bytes: each byte holds U codes of tokens r, r + M, ... of its block."""
    U: tl.constexpr = 8 // BITS
    M: tl.constexpr = 32 // U
    NBK: tl.constexpr = BN // 32
    rows = (t0 // 32) * M + tl.arange(0, NBK * M)
    raw = tl.load(p_ptr + rows[:, None] * spr + d[None, :], mask=(rows < nrows)[:, None], other=0)
    b16 = raw.to(tl.int16)
    if U > 1:
        shifts = (tl.arange(0, U) * BITS).to(tl.int16)
        c = (tl.reshape(b16, (NBK, 1, M, D)) >> shifts[None, :, None, None]) & ((1 << BITS) - 1)
        b16 = tl.reshape(c, (BN, D))
    return _half_codes(b16, BF16)


@triton.jit
def _ragged_codes(p_ptr, spr, i, ok, d, BITS: tl.constexpr, BF16: tl.constexpr):
    """Codes of any storage positions i (one word load per position and channel) as half [len(i), D]."""
    U: tl.constexpr = 8 // BITS
    c = load_codes(p_ptr, i, ok, spr, d, BITS, 1, 32 // U, 32)
    return _half_codes(c.to(tl.int16), BF16)


@triton.jit
def _tail_rows(p_ptr, spr, s_ptr, z_ptr, sqt, i, ok, d, G: tl.constexpr, BITS: tl.constexpr, TOKEN: tl.constexpr):
    """fp32 rows [len(i), D] of storage positions i (any), c * s + z: the codes by the magic number, so the kernel
    converts no integer to a float anywhere (the compile test checks its machine code for it)."""
    c = _ragged_codes(p_ptr, spr, i, ok, d, BITS, False).to(tl.float32)
    if TOKEN:
        off = i[:, None] * sqt + (d // G)[None, :]
    else:
        off = (i // G)[:, None] * sqt + d[None, :]
    s = tl.load(s_ptr + off, mask=ok[:, None], other=0.0).to(tl.float32)
    return c * s + tl.load(z_ptr + off, mask=ok[:, None], other=0.0).to(tl.float32)


@triton.jit
def _token_params(s_ptr, z_ptr, sqt, i, ok, BN: tl.constexpr, D: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr):
    """Per-token parameters of positions i, [BN, D/G] fp16 rows, broadcast over each group's channels -> [BN, D]."""
    g = tl.arange(0, D // G)
    off = i[:, None] * sqt + g[None, :]
    s = tl.load(s_ptr + off, mask=ok[:, None], other=0.0).to(HALF)
    z = tl.load(z_ptr + off, mask=ok[:, None], other=0.0).to(HALF)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BN, D // G, G)), (BN, D))
    z = tl.reshape(tl.broadcast_to(z[:, :, None], (BN, D // G, G)), (BN, D))
    return s, z


@triton.jit
def _dequant(c, s, z, HALF: tl.constexpr, FUSED: tl.constexpr):
    """c * s + z rounded once to half precision: one fused multiply-add on a GPU (`fma.rn.f16x2`); the interpreter
    fuses nothing (two roundings in half), so there the same value is computed in fp32 and rounded once."""
    if FUSED:
        v = c * s + z
    else:
        v = (c.to(tl.float32) * s.to(tl.float32) + z.to(tl.float32)).to(HALF)
    return v


@triton.jit
def _split(x, HALF: tl.constexpr):
    """fp32 x as hi + lo in half precision (about 22 bits for fp16, 16 for bf16): a product over exact half operands
    (codes, the model's K) on tensor cores then keeps the fp32 operand's precision for the cost of a second MMA."""
    hi = x.to(HALF)
    return hi, (x - hi.to(tl.float32)).to(HALF)


@triton.jit
def _softmax_step(sc, m, l_sum, acc, NSLOT: tl.constexpr, RP: tl.constexpr):
    """Online softmax over one tile's base-2 scores sc [BH, T] (BH = NSLOT x RP rows: slot-major, a query head per
    row of each slot): (weights, new max, rescaled sum and acc). A head's rows share one running max, the max over
    its slots, so their sums and values add up at the end."""
    row = tl.max(sc, axis=1)
    if NSLOT > 1:
        row = tl.reshape(tl.broadcast_to(tl.max(tl.reshape(row, (NSLOT, RP)), axis=0)[None, :], (NSLOT, RP)),
                         (NSLOT * RP,))  # fmt: skip
    m_new = tl.maximum(m, row)
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile of masked positions only
    alpha = tl.exp2(m - shift)
    w = tl.exp2(sc - shift[:, None])
    return w, m_new, l_sum * alpha + tl.sum(w, axis=1), acc * alpha[:, None]


@triton.jit
def _tc_decode_kernel(
    q_ptr, sqb_, sqh_,  # query [B, Hq, (1,) D], the model's dtype
    part_ptr,  # fp32 [B * Hkv, S + 1, BH, D + 2]: per split, score max (natural units), sum of weights, values
    mask_ptr, smb,  # fp32 additive mask [B, N] (HAS_MASK)
    pads_ptr,  # int64 [B] padding positions per row (ROWS)
    # keys: sinks [B, Hkv, >= s, D]; packed codes [B, Hkv, rows, D] + fp16 scale/zero; row start, count (ROWS) or n;
    # window [B, Hkv, W, D]
    ksk_ptr, kskb, kskh, kskt,
    kp_ptr, kpb, kph, kpr, knr, ks_ptr, kz_ptr, kqb, kqh, kqt, kst_ptr, kcnt_ptr, kn,
    kw_ptr, kwb, kwh, kwt, Wk,
    # values, the same
    vsk_ptr, vskb, vskh, vskt,
    vp_ptr, vpb, vph, vpr, vnr, vs_ptr, vz_ptr, vqb, vqh, vqt, vst_ptr, vcnt_ptr, vn,
    vw_ptr, vwb, vwh, vwt, Wv,
    Hkv, R, N, s, CH, qscale,  # CH: history positions per split (a multiple of BN); qscale: softmax scale * log2 e
    D: tl.constexpr, BH: tl.constexpr, NSLOT: tl.constexpr, RP: tl.constexpr, BN: tl.constexpr, BF16: tl.constexpr,
    KBITS: tl.constexpr, K_CH: tl.constexpr, K_TOK: tl.constexpr, KG: tl.constexpr,
    VBITS: tl.constexpr, V_CH: tl.constexpr, V_TOK: tl.constexpr, VG: tl.constexpr,
    LEAD_K: tl.constexpr, RAGGED: tl.constexpr, ROWS: tl.constexpr, HAS_MASK: tl.constexpr, FUSED: tl.constexpr,
):  # fmt: skip
    HALF: tl.constexpr = tl.bfloat16 if BF16 else tl.float16
    bh = tl.program_id(0)
    split = tl.program_id(1)
    S = tl.num_programs(1) - 1  # history splits; program S takes the tail
    b, hk = bh // Hkv, bh % Hkv
    row = tl.arange(0, BH)  # tile rows: slot row // RP (the key group of the tile it reads), head hk * R + row % RP
    slot = row // RP
    r = row % RP
    rok = r < R
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sqb_ + (hk * R + r)[:, None] * sqh_ + d[None, :], mask=rok[:, None], other=0.0)
    q = q.to(tl.float32) * qscale  # [BH, D] fp32, base-2 logits
    q_hi, q_lo = _split(q, HALF)
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
    kpack = kp_ptr + b * kpb + hk * kph
    kscale = ks_ptr + b * kqb + hk * kqh
    kzero = kz_ptr + b * kqb + hk * kqh
    vpack = vp_ptr + b * vpb + hk * vph
    vscale = vs_ptr + b * vqb + hk * vqh
    vzero = vz_ptr + b * vqb + hk * vqh
    # the run of positions where both streams are history, in the lead stream's storage positions [0, t_end)
    if LEAD_K:
        l0 = k0
        o0 = v0
        t_end = tl.minimum(kc, vc + v0 - k0)
    else:
        l0 = v0
        o0 = k0
        t_end = tl.minimum(vc, kc + k0 - v0)
    # positions before the run are the row's padding and sinks (a per-token stream stores them as unread zeros)
    t_beg = tl.maximum(tl.maximum(pad + s - l0, o0 - l0), 0)
    t_end = tl.maximum(t_end, t_beg)

    m = tl.full((BH,), float("-inf"), tl.float32)
    l_sum = tl.zeros((BH,), tl.float32)
    acc = tl.zeros((BH, D), tl.float32)
    if split < S:
        lo = (t_beg // BN) * BN + split * CH  # tiles start on packing blocks; positions before t_beg masked
        hi = tl.minimum(lo + CH, t_end)
        for t0 in range(lo, hi, BN):
            t = t0 + tl.arange(0, BN)  # lead storage positions
            ok = (t >= t_beg) & (t < hi)
            if LEAD_K:
                tk = t
                tv = t + (l0 - o0)
            else:
                tv = t
                tk = t + (l0 - o0)
            # scores [BH, BN]
            if RAGGED and not LEAD_K:
                ck = _ragged_codes(kpack, kpr, tk, ok, d, KBITS, BF16)
            else:
                ck = _codes_tile(kpack, kpr, knr, t0, d, BN, KBITS, D, BF16)
            if K_CH:  # NSLOT groups: each slot's rows fold its group's scale into the query, its zero a bias
                g_off = (t0 // KG + slot)[:, None] * kqt + d[None, :]
                g_in = (t0 + slot * KG < hi)[:, None]  # a slot past the history reads no parameters
                ksc = tl.load(kscale + g_off, mask=g_in, other=0.0).to(tl.float32)  # [BH, D]
                kze = tl.load(kzero + g_off, mask=g_in, other=0.0).to(tl.float32)
                a_hi, a_lo = _split(q * ksc, HALF)
                ckt = tl.trans(ck)
                sc = tl.dot(a_hi, ckt) + tl.dot(a_lo, ckt) + tl.sum(q * kze, axis=1)[:, None]
            else:
                ksc, kze = _token_params(kscale, kzero, kqt, tk, ok, BN, D, KG, HALF)
                kt = tl.trans(_dequant(ck, ksc, kze, HALF, FUSED))
                sc = tl.dot(q_hi, kt) + tl.dot(q_lo, kt)
            if HAS_MASK:
                sc += tl.load(mask_ptr + b * smb + l0 + t, mask=ok, other=0.0)[None, :] * 1.4426950408889634
            own = ok[None, :] & ((tl.arange(0, BN) // (BN // NSLOT))[None, :] == slot[:, None])  # a row's own slot
            sc = tl.where(own, sc, float("-inf"))
            w, m, l_sum, acc = _softmax_step(sc, m, l_sum, acc, NSLOT, RP)
            wh = w.to(HALF)
            # values [BN, D]
            if RAGGED and LEAD_K:
                cv = _ragged_codes(vpack, vpr, tv, ok, d, VBITS, BF16)
            else:
                cv = _codes_tile(vpack, vpr, vnr, t0, d, BN, VBITS, D, BF16)
            if V_CH:  # a group per slot: its scale and zero applied to the product of the slot's rows
                g_off = (t0 // VG + slot)[:, None] * vqt + d[None, :]
                g_in = (t0 + slot * VG < hi)[:, None]
                vsc = tl.load(vscale + g_off, mask=g_in, other=0.0).to(tl.float32)
                vze = tl.load(vzero + g_off, mask=g_in, other=0.0).to(tl.float32)
                acc += tl.dot(wh, cv) * vsc + tl.sum(wh.to(tl.float32), axis=1)[:, None] * vze
            else:
                vsc, vze = _token_params(vscale, vzero, vqt, tv, ok, BN, D, VG, HALF)
                acc += tl.dot(wh, _dequant(cv, vsc, vze, HALF, FUSED))
    else:
        # the tail: sinks, then absolute positions from the end of the run to N; each position's K and V from
        # wherever they lie (history, window), dequantized per element in fp32, products on tensor cores
        ksink = ksk_ptr + b * kskb + hk * kskh
        vsink = vsk_ptr + b * vskb + hk * vskh
        kwin = kw_ptr + b * kwb + hk * kwh
        vwin = vw_ptr + b * vwb + hk * vwh
        p_run = l0 + t_end  # first absolute position after the run (the row's first past its sinks if none)
        n_sink = tl.minimum(s, N - pad)
        for i0 in range(0, n_sink + tl.maximum(N - p_run, 0), TAIL_T):
            i = i0 + tl.arange(0, TAIL_T)
            is_sink = i < n_sink
            p = tl.where(is_sink, pad + i, p_run + i - n_sink)  # absolute position
            live = (i < n_sink) | (p < N)
            rest = live & ~is_sink
            j = p - pad
            tk = p - k0
            tv = p - v0
            kh = rest & (tk >= 0) & (tk < kc)
            vh = rest & (tv >= 0) & (tv < vc)
            k = fp_rows(ksink, kskt, j, live & is_sink, d)
            k += _tail_rows(kpack, kpr, kscale, kzero, kqt, tk, kh, d, KG, KBITS, K_TOK)
            k += fp_rows(kwin, kwt, Wk - (N - p), rest & ~kh, d)
            kt = tl.trans(k.to(HALF))
            sc = tl.dot(q_hi, kt) + tl.dot(q_lo, kt)
            if HAS_MASK:
                sc += tl.load(mask_ptr + b * smb + p, mask=live, other=0.0)[None, :] * 1.4426950408889634
            sc = tl.where(live[None, :] & (slot == 0)[:, None], sc, float("-inf"))  # the tail: slot 0's rows
            w, m, l_sum, acc = _softmax_step(sc, m, l_sum, acc, NSLOT, RP)
            v = fp_rows(vsink, vskt, j, live & is_sink, d)
            v += _tail_rows(vpack, vpr, vscale, vzero, vqt, tv, vh, d, VG, VBITS, V_TOK)
            v += fp_rows(vwin, vwt, Wv - (N - p), rest & ~vh, d)
            acc += tl.dot(w.to(HALF), v.to(HALF))
    if NSLOT > 1:  # a head's slots: one max, their sums and values added
        m = tl.max(tl.reshape(m, (NSLOT, RP)), axis=0)
        l_sum = tl.sum(tl.reshape(l_sum, (NSLOT, RP)), axis=0)
        acc = tl.sum(tl.reshape(acc, (NSLOT, RP, D)), axis=0)
    h = tl.arange(0, RP)
    part = part_ptr + ((bh * (S + 1) + split) * RP + h) * (D + 2)
    tl.store(part, m * 0.6931471805599453, mask=h < R)  # natural units: the merge takes exp of differences
    tl.store(part + 1, l_sum, mask=h < R)
    tl.store(part[:, None] + 2 + d[None, :], acc, mask=(h < R)[:, None])


def fast_route_reason(view: DecodeView, query: torch.Tensor) -> str | None:
    """Why this view and query cannot take the tensor-core route (None: they can). The general route's checks
    (`attention.supports`) come first; these are the fast route's own."""
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"a {query.dtype} model (the tensor-core route computes in the model's fp16 or bf16)"
    if query.dtype == torch.bfloat16 and query.device.type != "cuda":
        return "bf16 under the Triton interpreter, whose bf16 arithmetic is wrong (triton 3.9): compiled only"
    B, Hq, _, D = query.shape
    if D not in HEAD_DIMS:
        return f"head dim {D} (the route takes {HEAD_DIMS})"
    Hkv = view.keys.sink.shape[1]
    if Hq // Hkv > MAX_HEADS:
        return f"{Hq // Hkv} query heads per kv head (at most {MAX_HEADS})"
    if view.rope is not None:
        return "rope=pre keys (rotated per element: the general route)"
    groups = set()
    for name, sv in (("keys", view.keys), ("values", view.values)):
        if sv.codes is None or not sv.n:
            continue
        if sv.table is not None or sv.zero is None:
            return f"{name}: a code format other than int (the general route reads any table)"
        if sv.bits not in FAST_BITS:
            return f"{name}: {sv.bits}-bit codes (words of several bytes; the route takes {FAST_BITS} bits)"
        if sv.scale.dtype != torch.float16 or sv.codes.stride(-1) != 1:
            return f"{name}: parameters or codes not as stored (fp16, contiguous channels)"
        if sv.axis == "channel":
            if sv.group_size not in (32, 64, 128):
                return f"{name}: per-channel groups of {sv.group_size} tokens (the route takes 32, 64, 128)"
            groups.add(sv.group_size)
        elif sv.group_size > D or D % sv.group_size:
            return f"{name}: per-token groups of {sv.group_size} channels"
    if len(groups) > 1:
        return "keys and values in per-channel groups of different sizes"
    return None


def _rows(view: DecodeView, R: int, D: int) -> tuple[int, int, int]:
    """(NSLOT, RP, BN): the tile's rows are NSLOT slots of RP query-head rows (R padded), BH = NSLOT x RP >= 16 (the
    MMA's M); BN history positions per tile. Per-channel groups of G tokens: each slot reads one group of the tile
    (BN = NSLOT x G, at most 128, and BN x D <= 2^14: a larger tile spills at D = 256), so GQA's few heads fill the
    M dimension with groups instead of zero rows and one [BH, D] fold serves NSLOT groups (35% fewer instructions
    per code than a slot of 16 rows at GQA 4, sm_90a); other streams: one slot, BN = 64."""
    RP = triton.next_power_of_2(R)
    chans = [sv.group_size for sv in (view.keys, view.values) if sv.codes is not None and sv.n and sv.axis == "channel"]
    G = chans[0] if chans else None
    if G is None or RP >= 16:
        return 1, max(16, RP), G or 64
    nslot = max(1, min(16 // RP, min(128, (1 << 14) // D) // G))
    return nslot, max(RP, 16 // nslot), nslot * G


def _splits(tiles: int, programs: int, sms: int) -> int:
    """History splits per (row, kv head): FlashAttention-2's rule, the fewest splits whose waves over the SMs are at
    least 85% as full as the best count's (up to 64 splits), with at least MIN_SPLIT_TILES tiles each."""
    most = max(1, min(64, tiles // MIN_SPLIT_TILES))
    if programs >= 0.8 * sms or most == 1:
        return 1

    def efficiency(n):
        waves = programs * n / sms
        return waves / math.ceil(waves)

    best = max(efficiency(n) for n in range(1, most + 1))
    return next(n for n in range(1, most + 1) if efficiency(n) >= 0.85 * best)


def launch(view: DecodeView, query: torch.Tensor, add, pads, scaling: float, sms: int, f32, i64, splits=None):
    """Run the kernel: fp32 partials [B * Hkv, S + 1, BH, D + 2] and the shape of its merge (S + 1, BH)."""
    B, Hq, _, D = query.shape
    ks, vs = view.keys, view.values
    Hkv = ks.sink.shape[1]
    R = Hq // Hkv
    NSLOT, RP, BN = _rows(view, R, D)
    BH = NSLOT * RP
    lead_k = not (ks.axis == "token" and vs.axis == "channel" and vs.codes is not None and vs.n)
    n_run = min(ks.n if ks.codes is not None else 0, vs.n if vs.codes is not None else 0)
    tiles = -(-n_run // BN)
    S = splits or _splits(tiles, B * Hkv, sms)
    CH = max(1, -(-tiles // S)) * BN
    part = torch.empty(B * Hkv * (S + 1) * RP * (D + 2), dtype=torch.float32, device=query.device)

    def stream(sv):
        if sv.codes is not None and sv.n:
            c, sc, z = sv.codes, sv.scale, sv.zero
        else:
            c, sc, z = i64.view(torch.uint8).view(1, 1, 8, 1), f32.view(torch.float16).view(1, 1, 2, 1), None
        z = sc if z is None else z
        st, cnt = (sv.starts, sv.counts) if view.pads is not None else (i64, i64)
        n = sv.n if sv.codes is not None else 0
        sink, win = sv.sink, sv.window
        bits = sv.bits if (sv.codes is not None and sv.n) else 2
        args = [
            sink, sink.stride(0), sink.stride(1), sink.stride(2),
            c, c.stride(0), c.stride(1), c.stride(2), c.shape[2], sc, z, sc.stride(0), sc.stride(1), sc.stride(2),
            st, cnt, n,
            win, win.stride(0), win.stride(1), win.stride(2), win.shape[2],
        ]  # fmt: skip
        return args, bits, sv.axis == "channel", sv.group_size

    kargs, kbits, kch, kg = stream(ks)
    vargs, vbits, vch, vg = stream(vs)
    _tc_decode_kernel[(B * Hkv, S + 1)](
        query, query.stride(0), query.stride(1),
        part,
        add, add.stride(0) if add is not f32 else 0,
        pads,
        *kargs, *vargs,
        Hkv, R, view.N, min(view.sink_tokens, view.N), CH, scaling * LOG2E,
        D=D, BH=BH, NSLOT=NSLOT, RP=RP, BN=BN, BF16=query.dtype == torch.bfloat16,
        KBITS=kbits, K_CH=kch, K_TOK=not kch, KG=kg, VBITS=vbits, V_CH=vch, V_TOK=not vch, VG=vg, LEAD_K=lead_k,
        RAGGED=view.pads is not None and kch != vch, ROWS=view.pads is not None, HAS_MASK=add is not f32,
        FUSED=query.device.type == "cuda", num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return part, S + 1, RP


def word_rows(bits: int) -> int:
    """Rows of bytes per 32-token block for `bits` (the layout's M), for checks."""
    u, nb = word_layout(bits)
    return nb * BLOCK // u
