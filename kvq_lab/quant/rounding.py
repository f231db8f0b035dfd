"""fp16 quantization parameters, rounded outward: the rounding every code format uses for its scale and zero point.

Rounding the stored parameters *outwards* (a zero point down, a scale up) keeps every element of a group inside
the range the parameters cover, so no code is clamped by a parameter's own rounding.
"""

from __future__ import annotations

import torch

PARAM_DTYPE = torch.float16  # a per-group parameter stored "fp16", the default encoding (kvq_lab.quant.formats)


def div(x: torch.Tensor, n: float) -> torch.Tensor:
    """x / n (n a Python number) by IEEE division on every device. PyTorch's CUDA kernels divide a tensor by a Python
    scalar as a multiplication by its reciprocal, which can differ from the CPU's quotient in the last bit (seen on an
    H200: int's 3- and 4-bit scales, where the Triton kernel's `tl.div_rn` kept the CPU's); a tensor divisor divides."""
    return x / torch.full_like(x, n)


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
