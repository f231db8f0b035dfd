"""Unpack + dequantize: packed codes with their parameters -> fp32 [B, H, n, D] of storage positions [0, n).

x' = table[code] * scale (+ zero) for every code format (`common`: HAS_TABLE; HAS_ZERO: the format stores a zero
point, fp8 does not), reading the layout of `common` (`kvq_lab/quant/pack.py`). A grid of (batch row x head, tile of
TT positions) programs.

Reference: `kvq_lab.quant.reference.dequantize` (through `kvq_lab.quant.pack.PackedQTensor`); tests require identical
values (tests/kernels/test_triton.py, under `TRITON_INTERPRET=1`). Bit parity needs the reference's two roundings in
`code * scale + zero`: the launch disables fp contraction, which would fuse them into an fma.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvq_lab.quant.pack import BLOCK, word_layout
from kvq_lab.quant.reference import code_format
from kvq_lab.quant.spec import QuantSpec

from .common import check_power_of_two, code_values, load_codes


@triton.jit
def _dequant_kernel(
    p_ptr, spb, sph, spr,  # packed codes uint8 [B, H, rows, D]
    # scale / zero fp16 with the same strides (per-token [B, H, T, D/G], per-channel [B, H, T/G, D]); zero: HAS_ZERO
    s_ptr, z_ptr, sqb, sqh, sqt,
    t_ptr,  # fp32 [2^BITS] code values (HAS_TABLE)
    o_ptr, sob, soh, sot,  # output fp32 [B, H, n, D]
    H, n,  # n: storage positions [0, n) dequantized
    D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr, M: tl.constexpr, BLK: tl.constexpr,
    TT: tl.constexpr, AXIS_TOKEN: tl.constexpr, HAS_TABLE: tl.constexpr, HAS_ZERO: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    pos = tl.program_id(1) * TT + tl.arange(0, TT)
    d = tl.arange(0, D)
    ok = pos < n
    c = load_codes(p_ptr + b * spb + h * sph, pos, ok, spr, d, BITS, NB, M, BLK)
    c = code_values(c, t_ptr, ok, HAS_TABLE)
    if AXIS_TOKEN:
        q_off = b * sqb + h * sqh + pos[:, None] * sqt + (d // G)[None, :]
    else:
        q_off = b * sqb + h * sqh + (pos // G)[:, None] * sqt + d[None, :]
    s = tl.load(s_ptr + q_off, mask=ok[:, None], other=0.0).to(tl.float32)
    out = c * s
    if HAS_ZERO:  # two roundings, as the reference (the launch disables fma contraction)
        out = out + tl.load(z_ptr + q_off, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(o_ptr + b * sob + h * soh + pos[:, None] * sot + d[None, :], out, mask=ok[:, None])


def _table_and_zero(spec: QuantSpec, zero, device):
    """(table or a dummy, HAS_TABLE, zero or a dummy, HAS_ZERO) for a launch: int has no table, fp8 no zero."""
    fmt = code_format(spec)
    dummy = torch.zeros(1, dtype=torch.float32, device=device)
    table = dummy if fmt.codes_are_values else fmt.table(device)
    return table, not fmt.codes_are_values, (zero if zero is not None else dummy), zero is not None


def unpack_dequantize(packed, scale, zero, spec: QuantSpec, n: int) -> torch.Tensor:
    """fp32 [B, H, n, D] = table[code] * scale + zero of storage positions [0, n), the spec's format (the
    reference's `dequantize`); zero None for formats without a zero point."""
    B, H, _, D = packed.shape
    check_power_of_two(spec, D)
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
