"""The general route of `attention.decode_attention` (its launcher, and the choice of route, are `attention`): every
view, fp32 models, every code format, rope=pre.

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

import triton
import triton.language as tl

from .common import deq_rows, fp_rows, row_layout


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
    Hkv, R, N, s, CH, SPAN,  # s: sink positions present; CH: positions per program (a multiple of TT); SPAN: those
    # the loop visits, min(CH, N rounded up to TT): one chunk's loop ends at N's last tile, not at CH
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
        pad, k0, kc, v0, vc = row_layout(pads_ptr, kst_ptr, kcnt_ptr, vst_ptr, vcnt_ptr, b)
    else:
        pad, k0, kc, v0, vc = 0, s, kn, s, vn
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
    for t0 in range(0, SPAN, TT):
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
