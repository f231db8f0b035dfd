"""The pure-PyTorch path (`backend=torch`): whole-group quantization, dequantization of packed storage, and decode
attention over a `DecodeView`. The specification the C and Triton kernels are tested against; the quantization
and dequantization are themselves bit for bit `kvq_lab.quant.reference` (tested).

Every code format dequantizes as table[code] * scale + zero (`kvq_lab.quant.formats`; zero absent for fp8); for
`int` the code is its own table entry, so that path converts the code and skips the lookup, as before formats.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvq_lab.quant.pack import BLOCK, plane_shifts, unpack, word_layout
from kvq_lab.quant.reference import code_format
from kvq_lab.quant.spec import QuantSpec

from .view import DecodeView, StreamView, Unsupported
from .workspace import const, workspace


def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether no element of the tensors is NaN or inf: one fp32 sum per tensor (non-finite exactly when an element
    is, short of fp32 overflow, ~3e38) instead of an elementwise pass. Any device, any float dtype."""
    return all(math.isfinite(float((t.detach() if t.requires_grad else t).sum(dtype=torch.float32))) for t in tensors)


def quantize_whole_groups(x: torch.Tensor, spec: QuantSpec):
    """`reference.quantize` for x [B, H, T, D] made of whole groups and no padding, in fewer ops (decode steps);
    `int` format only (other formats quantize through `reference.quantize`).

    Bit for bit the reference's arithmetic (tested): same min/max, outward fp16 rounding, IEEE division, round
    half to even. A zero-width group divides 0 by a tiny positive number instead of selecting 0: same code, 0.
    Returns codes uint8 [B, H, T, D] and fp16 scale, zero in the reference's parameter layout.
    """
    if spec.format != "int" or spec.codebook is not None:
        raise ValueError(f"quantize_whole_groups is int's fast path; format={spec.format}: use reference.quantize")
    B, H, T, D = x.shape
    G, L = spec.group_size, spec.levels
    xf = x.float()
    g = xf.view(B, H, T, D // G, G) if spec.axis == "token" else xf.view(B, H, T // G, G, D).transpose(-1, -2)
    mn, mx = torch.aminmax(g, dim=-1)
    neg = const("-inf16", x.device, lambda: torch.tensor(float("-inf"), dtype=torch.float16))
    pos = const("+inf16", x.device, lambda: torch.tensor(float("inf"), dtype=torch.float16))
    zero = mn.half()
    zero = torch.where(zero.float() > mn, zero.nextafter(neg), zero)  # fp16, rounded down
    z = zero.float()
    want = (mx - z) / L
    scale = want.half()
    scale = torch.where(scale.float() < want, scale.nextafter(pos), scale)  # fp16, rounded up
    s = scale.float().clamp_min(1e-38)
    codes = torch.round((g - z.unsqueeze(-1)) / s.unsqueeze(-1)).clamp_(0, L).to(torch.uint8)
    if spec.axis == "token":
        return codes.view(B, H, T, D), scale, zero
    return codes.transpose(-1, -2).reshape(B, H, T, D), scale, zero


def unpack_dequantize(packed, scale, zero, spec: QuantSpec, n: int) -> torch.Tensor:
    """fp32 [B, H, n, D] = table[code] * scale + zero of storage positions [0, n) of packed uint8 [B, H, rows, D]
    and its params as read (fp16, or fp32 for e8m0: `PackedStore.read_params`; zero None: no zero point), the spec's
    format (the reference's `dequantize`: two roundings, no fma)."""
    B, H, _, D = packed.shape
    G = spec.group_size
    fmt = code_format(spec)
    bits = fmt.code_bits
    c = unpack(packed[:, :, : -(-n // BLOCK) * BLOCK * bits // 8], bits)[:, :, :n]
    c = c.float() if fmt.codes_are_values else fmt.table(c.device)[c.long()]
    if spec.axis == "token":
        x = c.view(B, H, n, D // G, G) * scale[:, :, :n, :, None].float()
        z = None if zero is None else zero[:, :, :n, :, None].float()
    else:
        x = c.view(B, H, n // G, G, D) * scale[:, :, : n // G, None, :].float()
        z = None if zero is None else zero[:, :, : n // G, None, :].float()
    return (x if z is None else x + z).view(B, H, n, D)


def decode_attention_torch(view: DecodeView, query: torch.Tensor, mask, scaling: float) -> torch.Tensor:
    """One decode step's attention over packed K/V (no padding).

    query [B, Hq, 1, D] (post-RoPE) -> output [B, 1, Hq, D] in query's dtype (the layout `sdpa_attention_forward`
    returns); mask: SDPA's, over >= N positions (the last N are used), or None. K and V are assembled for this step
    only, each in a reused fp32 workspace (sinks and window copied, history unpacked into a reused uint8 workspace
    and dequantized in place with the reference's arithmetic), then one SDPA call with grouped query heads (GQA
    without repeating K/V). No decode step allocates anything of the cache's size: fresh multi-MB buffers cost
    more in page faults than the arithmetic that fills them.
    """
    if view.rope is not None or view.pads is not None or view.hadamard is not None:
        raise Unsupported(
            "the PyTorch path reads none of `rope` (its keys come as a dequantized, rotated history), `pads` (padded "
            "batches attend materialized K/V) and `hadamard` (the caller maps query and output): rebuild the view "
            "without them"
        )
    k = _assemble(view.keys, view.N, view.sink_tokens, "k")  # [B, Hkv, N, D] fp32
    v = _assemble(view.values, view.N, view.sink_tokens, "v")
    if mask is not None:
        mask = mask[..., -view.N :]
    out = F.scaled_dot_product_attention(query.float(), k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).to(query.dtype)


def _codes_into(sv: StreamView, name: str) -> torch.Tensor:
    """uint8 codes [B, H, n', D] (n' >= n, whole blocks) of storage positions [0, n), unpacked into a workspace."""
    bits, n = sv.bits, sv.n
    u, nb = word_layout(bits)
    nblk = -(-n // BLOCK)
    if nb != 1:  # 3- and 5-bit words span 3 and 5 bytes: the general unpack (allocates)
        return unpack(sv.codes[:, :, : nblk * BLOCK * bits // 8], bits)
    B, H, _, D = sv.codes.shape
    m = BLOCK // u  # rows per plane
    packed = sv.codes[:, :, : nblk * m].view(B, H, nblk, 1, m, D)
    out = workspace(name + "codes", B * H * nblk * BLOCK * D, packed.device, torch.uint8)
    out = out.view(B, H, nblk, u, m, D)
    torch.bitwise_right_shift(packed, plane_shifts(bits, torch.uint8, packed.device), out=out)
    return out.bitwise_and_((1 << bits) - 1).view(B, H, nblk * BLOCK, D)


def _assemble(sv: StreamView, N: int, S: int, name: str) -> torch.Tensor:
    """fp32 [B, H, N, D] of one stream for this step: sinks | dequantized history | window."""
    B, H, _, D = sv.sink.shape
    s, n, w = min(S, N), sv.n, sv.w
    out = workspace(name, B * H * N * D, sv.sink.device).view(B, H, N, D)
    if s:
        out[:, :, :s] = sv.sink[:, :, :s]
    if n:
        if sv.history is not None:  # rope=pre keys, dequantized and re-rotated by the cache
            out[:, :, s : s + n] = sv.history
        else:
            G = sv.group_size
            if sv.axis == "token":  # params [B, H, n, D/G] broadcast over each group's channels
                shape = (B, H, n, D // G, G)
                sc = sv.scale[:, :, :n, :, None]
                z = None if sv.zero is None else sv.zero[:, :, :n, :, None]
            else:  # params [B, H, n/G, D] broadcast over each group's tokens
                shape = (B, H, n // G, G, D)
                sc = sv.scale[:, :, : n // G, None, :]
                z = None if sv.zero is None else sv.zero[:, :, : n // G, None, :]
            # code (or its table entry) -> fp32 in place, then * scale, + zero: the reference's two roundings, no
            # intermediate buffer of the history's size for int
            dst = out[:, :, s : s + n].view(shape)
            codes = _codes_into(sv, name)[:, :, :n]
            if sv.table is None:
                dst.copy_(codes.view(shape))
            else:
                dst.copy_(torch.index_select(sv.table, 0, codes.reshape(-1).int()).view(shape))
            dst.mul_(sc.float())
            if z is not None:
                dst.add_(z.float())
    if w:
        out[:, :, N - w :] = sv.window[:, :, sv.window.shape[2] - w :]
    return out
