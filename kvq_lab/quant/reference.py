"""Pure-PyTorch reference quantizer: the specification every kernel and fast path is tested against.

A spec (`QuantSpec`) names a code format (`kvq_lab.quant.formats`: int, fp8_e4m3, fp8_e5m2, lut); this module forms
the groups and hands them to the format, whose docstring pins the per-group arithmetic. Every format dequantizes
with one formula (fp32):

    x' = table[code] * scale + zero          (`zero` absent, i.e. 0, for formats that store none: fp8)

`int` (the default, KIVI's asymmetric uniform code, `kvq_lab.quant.formats.int_`): zero = fp16_round_down(min),
scale = fp16_round_up((max - zero) / (2^bits - 1)), code = round_half_even((x - zero) / scale), table[c] = c;
every element's error is at most scale / 2. The results are bit for bit those of this module before formats
existed.

Groups (`[B, H_kv, T, D]` tensors; axis names are mapped to dimensions here and nowhere else):
    axis="token"   -> groups of G consecutive channels inside one token   (params: [B, H, T, D/G])
    axis="channel" -> groups of G consecutive tokens inside one channel   (params: [B, H, ceil(T/G), D])

Partial groups (per-channel only, T not a multiple of G): `partial="zero"` pads the last group with
zeros that take part in its statistics (min/max, absmax), as KIVI's fake quant does; `partial="exclude"` leaves
them out. `valid` (bool, broadcastable to [B, H, T], or [B, H, T, D] per element) marks positions that may enter the
statistics: padding tokens of a left-padded batch are excluded this way, and outliers kept exact
(`kvq_lab.quant.outliers`). Excluded elements get code 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from kvq_lab.quant.formats import CodeFormat, get_format

from .groups import grouped as _grouped
from .groups import ungrouped as _ungrouped
from .rounding import PARAM_DTYPE, fp16_round_down, fp16_round_up
from .spec import QuantSpec

__all__ = [
    "PARAM_DTYPE",
    "QTensor",
    "code_format",
    "dequantize",
    "fake_quant",
    "fp16_round_down",
    "fp16_round_up",
    "quantize",
    "step_size",
]


@cache
def code_format(spec: QuantSpec) -> CodeFormat:
    """The code format a (non-identity) spec names, at its bits and with its codebook: one-line QuantConfigError
    if the format is unknown or takes other widths (fp8: 8 bits). Cached per spec (specs are frozen)."""
    if spec.is_identity:
        raise ValueError("bits=16 is the identity: it has no code format (nothing is quantized)")
    return get_format(spec.format, spec.bits, **spec.format_options())


@dataclass
class QTensor:
    """Quantized `[B, H, T, D]` tensor in the reference layout.

    codes: uint8 `[B, H, T_pad, D]` (T_pad = T rounded up to G for per-channel groups), one code per element.
    scale, zero: params, `[B, H, T, D/G]` (token axis) or `[B, H, T_pad/G, D]` (channel axis), in the format's
    `param_dtype` (fp16; fp32 for mxfp4's e8m0 scale), each exactly the value its stored encoding holds; zero is None
    for formats that store no zero point (fp8).
    length: the true token count T; dtype: the dtype dequantization returns.
    Bit packing of `codes` is the storage layer's business (`kvq_lab.quant.pack`).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    spec: QuantSpec
    length: int
    dtype: torch.dtype


def _check_shape(x: torch.Tensor, spec: QuantSpec) -> None:
    if x.dim() != 4:
        raise ValueError(f"expected a [B, H, T, D] tensor, got shape {tuple(x.shape)}")
    spec.check_head_dim(x.shape[-1])


def quantize(x: torch.Tensor, spec: QuantSpec, valid: torch.Tensor | None = None, partial: str = "zero") -> QTensor:
    """Quantize x `[B, H, T, D]` (any float dtype): groups as the module docstring says, codes and parameters by
    the spec's format (`code_format(spec).quantize_groups`)."""
    if spec.is_identity:
        raise ValueError("bits=16 is the identity: there is nothing to quantize (use fake_quant, or store x)")
    if partial not in ("zero", "exclude"):
        raise ValueError(f"partial={partial!r}; allowed: zero, exclude")
    fmt = code_format(spec)
    _check_shape(x, spec)
    B, H, T, D = x.shape
    xf = x.float()
    pad = (-T) % spec.group_size if spec.axis == "channel" else 0
    if valid is not None:  # per position [B, H, T], or per element [B, H, T, D] (outliers: kvq_lab.quant.outliers)
        valid = valid.to(torch.bool)
        valid = valid.expand(B, H, T, D) if valid.dim() == 4 else valid.expand(B, H, T).unsqueeze(-1).expand(B, H, T, D)
    if pad:
        xf = F.pad(xf, (0, 0, 0, pad))
        if partial == "exclude" or valid is not None:
            base = torch.ones(B, H, T, D, dtype=torch.bool, device=x.device) if valid is None else valid
            valid = F.pad(base, (0, 0, 0, pad), value=(partial == "zero"))

    g = _grouped(xf, spec)
    vg = None if valid is None else _grouped(valid, spec)
    codes, scale, zero = fmt.quantize_groups(g, vg)
    return QTensor(_ungrouped(codes, spec).contiguous(), scale, zero, spec, T, x.dtype)


def dequantize(q: QTensor) -> torch.Tensor:
    """`[B, H, T, D]` in q.dtype: table[code] * scale + zero of the spec's format, computed in fp32."""
    x = code_format(q.spec).dequantize_groups(_grouped(q.codes, q.spec), q.scale, q.zero)
    return _ungrouped(x, q.spec)[..., : q.length, :].to(q.dtype)


def fake_quant(
    x: torch.Tensor, spec: QuantSpec, valid: torch.Tensor | None = None, partial: str = "zero"
) -> torch.Tensor:
    """dequantize(quantize(x)): what attention sees in simulated mode. Identity at 16 bits."""
    if spec.is_identity:
        return x
    return dequantize(quantize(x, spec, valid=valid, partial=partial))


def step_size(q: QTensor) -> torch.Tensor:
    """Per-element scale `[B, H, T, D]` (fp32). For `int` it is the quantization step, the error bound being
    |x - x'| <= step / 2; other formats state their bound in `error_bound` (`code_format(q.spec)`)."""
    g = _grouped(torch.zeros_like(q.codes, dtype=torch.float32), q.spec) + q.scale.float().unsqueeze(-1)
    return _ungrouped(g, q.spec)[..., : q.length, :]
