"""Arithmetic shared by llama.cpp's KV-cache block types (`q8_0`, `q4_0`, `q4_1`, `q5_0`, `q5_1`, `iq4_nl`; `turbo`
reuses its masking, zero-safe inverse and fp16 storage): not a format itself.

ggml quantizes each block of 32 values of a row (here: a group, `group_size=32 key_axis=token` for llama.cpp's own
layout) from fp32, computing codes with the fp32 scale and storing the scale (and q4_1's / q5_1's minimum) rounded to
fp16; dequantization reads the fp16 values, `x' = table[code] * d (+ m)`, the formula every kvq_lab kernel reads. The
operations below follow ggml's reference quantizers (ggml-quants.c, and the `gguf` package's numpy port, which is
the test oracle) operation for operation, so codes and parameters are ggml's bit for bit.
"""

from __future__ import annotations

import torch

FP16_MAX = 65504.0


def masked(g: torch.Tensor, valid: torch.Tensor | None, fill: float) -> torch.Tensor:
    """g (fp32) with the elements outside `valid` replaced by `fill` (so they do not enter a statistic)."""
    if valid is None:
        return g
    return torch.where(torch.broadcast_to(valid.to(torch.bool), g.shape), g, fill)


def signed_absmax(g: torch.Tensor) -> torch.Tensor:
    """[..., n]: the element of largest magnitude of each group, with its sign (the first one on a tie, as ggml)."""
    return g.gather(-1, g.abs().argmax(-1, keepdim=True)).squeeze(-1)


def inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d, and 0 where d is 0 (ggml's `id = d ? 1/d : 0`)."""
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (half away from zero), computed as gguf's numpy port does: floor(a) + floor(2 (a - floor(a)))."""
    a = x.abs()
    f = torch.floor(a)
    return torch.sign(x) * (f + torch.floor(2 * (a - f)))


def to_fp16(d: torch.Tensor) -> torch.Tensor:
    """The fp32 parameter as ggml stores it: rounded to the nearest fp16 (saturated, where ggml would overflow)."""
    return d.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)


def zero_invalid(codes: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Code 0 for the elements outside `valid` (the format contract)."""
    if valid is None:
        return codes
    return torch.where(torch.broadcast_to(valid.to(torch.bool), codes.shape), codes, torch.zeros_like(codes))
