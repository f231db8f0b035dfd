"""Decode attention on tensor cores over packed int K/V: the fast route of `attention.decode_attention`. This module
holds the route's checks, tile shapes, splits and launcher; the kernel and its device helpers are
`attention_tc_kernel`.

query [B, Hq, 1, D] (fp16 / bf16 model) -> fp32 partials merged by `common.combine_kernel`. The same semantics as the
general route (`attention_kernel._decode_attn_kernel`, the C kernel, `torch_path.decode_attention_torch`): sinks, packed
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

from kvq_lab.quant.pack import BLOCK, word_layout

from ..view import DecodeView
from .attention_tc_kernel import _tc_decode_kernel

LOG2E = 1.4426950408889634
MAX_HEADS = 64  # query heads per kv head the [BH, D] tile takes (BH <= 64)
HEAD_DIMS = (64, 128, 256)
FAST_BITS = (1, 2, 4, 8)  # codes of one byte's planes, exact in fp16 and bf16 (< 2^8)
MIN_SPLIT_TILES = 4  # history tiles per split at least (a split's fixed cost: its query, a partial)
NUM_WARPS, NUM_STAGES = 4, 2  # launch options (no GPU measurement has tuned them yet)


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
