"""Pure-PyTorch reference quantizer: the specification every kernel and fast path is tested against.

Arithmetic (asymmetric uniform, per group, computed in fp32):

    zero  = fp16_round_down(min(group))                 # stored zero point (fp16), <= every element
    scale = fp16_round_up((max(group) - zero) / L)      # stored step (fp16), L = 2^bits - 1
    code  = clamp(round_half_even((x - zero) / scale), 0, L)      (code = 0 where scale == 0)
    x'    = code * scale + zero

Rounding the stored parameters *outwards* (zero down, scale up) keeps every element of the group inside
the representable range, so no code is clamped and every element's error is at most half a step:
|x - x'| <= scale / 2 (up to fp32 rounding). KIVI rounds its fp16 parameters to nearest instead; the
difference is below one fp16 ulp of the parameters. A zero-width group (max == min, e.g. all zeros)
gets scale 0 and reproduces its value exactly instead of dividing by zero.

Groups (`[B, H_kv, T, D]` tensors; axis names are mapped to dimensions here and nowhere else):
    axis="token"   -> groups of G consecutive channels inside one token   (params: [B, H, T, D/G])
    axis="channel" -> groups of G consecutive tokens inside one channel   (params: [B, H, ceil(T/G), D])

Partial groups (per-channel only, T not a multiple of G): `partial="zero"` pads the last group with
zeros that take part in its min/max, as KIVI's fake quant does; `partial="exclude"` leaves them out.
`valid` (bool, broadcastable to [B, H, T]) marks positions that may enter min/max: padding tokens of a
left-padded batch are excluded this way. Excluded positions get code 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .spec import QuantSpec

PARAM_DTYPE = torch.float16
_FP16_MAX = torch.finfo(torch.float16).max


def fp16_round_down(x: torch.Tensor) -> torch.Tensor:
    """Largest fp16 value <= x (x fp32). Values beyond fp16's range become -inf/+inf."""
    y = x.to(PARAM_DTYPE)
    too_big = y.float() > x
    return torch.where(too_big, torch.nextafter(y, torch.full_like(y, -float("inf"))), y)


def fp16_round_up(x: torch.Tensor) -> torch.Tensor:
    """Smallest fp16 value >= x (x fp32)."""
    y = x.to(PARAM_DTYPE)
    too_small = y.float() < x
    return torch.where(too_small, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


@dataclass
class QTensor:
    """Quantized `[B, H, T, D]` tensor in the reference layout.

    codes: uint8 `[B, H, T_pad, D]` (T_pad = T rounded up to G for per-channel groups), one code per element.
    scale, zero: fp16 params, `[B, H, T, D/G]` (token axis) or `[B, H, T_pad/G, D]` (channel axis).
    length: the true token count T; dtype: the dtype dequantization returns.
    Bit packing of `codes` is the storage layer's business (`kvq_lab.quant.pack`).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    spec: QuantSpec
    length: int
    dtype: torch.dtype


def _grouped(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """View `[B, H, T, D]` as `[..., n_groups..., G]` with each group's elements on the last dim.

    token:   [B, H, T, D]    -> [B, H, T, D/G, G]
    channel: [B, H, T_pad, D] -> [B, H, T_pad/G, D, G]   (T_pad must be a multiple of G)
    """
    B, H, T, D = x.shape
    G = spec.group_size
    if spec.axis == "token":
        return x.reshape(B, H, T, D // G, G)
    return x.reshape(B, H, T // G, G, D).transpose(-1, -2)


def _ungrouped(g: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Inverse of `_grouped`."""
    if spec.axis == "token":
        B, H, T, nG, G = g.shape
        return g.reshape(B, H, T, nG * G)
    B, H, nT, D, G = g.shape
    return g.transpose(-1, -2).reshape(B, H, nT * G, D)


def _check_shape(x: torch.Tensor, spec: QuantSpec) -> None:
    if x.dim() != 4:
        raise ValueError(f"expected a [B, H, T, D] tensor, got shape {tuple(x.shape)}")
    spec.check_head_dim(x.shape[-1])


def quantize(x: torch.Tensor, spec: QuantSpec, valid: torch.Tensor | None = None, partial: str = "zero") -> QTensor:
    """Quantize x `[B, H, T, D]` (any float dtype) following the module docstring's arithmetic."""
    if spec.is_identity:
        raise ValueError("bits=16 is the identity: there is nothing to quantize (use fake_quant, or store x)")
    if partial not in ("zero", "exclude"):
        raise ValueError(f"partial={partial!r}; allowed: zero, exclude")
    _check_shape(x, spec)
    B, H, T, D = x.shape
    xf = x.float()
    pad = (-T) % spec.group_size if spec.axis == "channel" else 0
    if valid is not None:
        valid = valid.to(torch.bool).expand(B, H, T)
    if pad:
        xf = F.pad(xf, (0, 0, 0, pad))
        if partial == "exclude" or valid is not None:
            base = torch.ones(B, H, T, dtype=torch.bool, device=x.device) if valid is None else valid
            valid = F.pad(base, (0, pad), value=(partial == "zero"))

    g = _grouped(xf, spec)
    if valid is None:
        mn, mx = g.amin(-1), g.amax(-1)
        vg = None
    else:
        vg = _grouped(valid.unsqueeze(-1).expand(B, H, T + pad, D), spec)
        mn = torch.where(vg, g, float("inf")).amin(-1)
        mx = torch.where(vg, g, -float("inf")).amax(-1)
        empty = ~vg.any(-1)  # a group of padding only: any params will do
        mn = torch.where(empty, 0.0, mn)
        mx = torch.where(empty, 0.0, mx)

    zero = fp16_round_down(mn)
    scale = fp16_round_up((mx - zero.float()) / spec.levels)
    s = scale.float().unsqueeze(-1)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round((g - zero.float().unsqueeze(-1)) / safe).clamp_(0, spec.levels)
    codes = torch.where(s > 0, codes, torch.zeros_like(codes))
    if vg is not None:
        codes = torch.where(vg, codes, torch.zeros_like(codes))
    return QTensor(_ungrouped(codes.to(torch.uint8), spec).contiguous(), scale, zero, spec, T, x.dtype)


def dequantize(q: QTensor) -> torch.Tensor:
    """`[B, H, T, D]` in q.dtype: code * scale + zero, computed in fp32."""
    g = _grouped(q.codes.float(), q.spec)
    x = g * q.scale.float().unsqueeze(-1) + q.zero.float().unsqueeze(-1)
    return _ungrouped(x, q.spec)[..., : q.length, :].to(q.dtype)


def fake_quant(
    x: torch.Tensor, spec: QuantSpec, valid: torch.Tensor | None = None, partial: str = "zero"
) -> torch.Tensor:
    """dequantize(quantize(x)): what attention sees in simulated mode. Identity at 16 bits."""
    if spec.is_identity:
        return x
    return dequantize(quantize(x, spec, valid=valid, partial=partial))


def step_size(q: QTensor) -> torch.Tensor:
    """Per-element quantization step `[B, H, T, D]` (fp32), for error bounds: |x - x'| <= step / 2."""
    g = _grouped(torch.zeros_like(q.codes, dtype=torch.float32), q.spec) + q.scale.float().unsqueeze(-1)
    return _ungrouped(g, q.spec)[..., : q.length, :]
