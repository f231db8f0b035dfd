"""The tensor-core route's kernel (`attention_tc`: the route's checks, its tile shapes, splits and launcher; the design,
layouts and arithmetic are written there) and its device helpers: codes to half precision by bit operations, the
per-token parameters, the hi + lo split of an fp32 operand, the base-2 online softmax over slots.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import fp_rows, load_codes, row_layout

TAIL = 32  # positions per step of the last split (sinks, windows, the end of a history)
TAIL_T = tl.constexpr(TAIL)


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
        pad, k0, kc, v0, vc = row_layout(pads_ptr, kst_ptr, kcnt_ptr, vst_ptr, vcnt_ptr, b)
    else:
        pad, k0, kc, v0, vc = 0, s, kn, s, vn
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
