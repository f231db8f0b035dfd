"""Groups of a [B, H, T, D] tensor along its quantization axis: the layout every code format sees (`quantize_groups`).
Torch-free at import (tensors come in); the reference quantizer and fitted formats both group with it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .spec import QuantSpec


def grouped(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """View `[B, H, T, D]` as `[..., n_groups..., G]` with each group's elements on the last dim.

    token:   [B, H, T, D]    -> [B, H, T, D/G, G]
    channel: [B, H, T_pad, D] -> [B, H, T_pad/G, D, G]   (T_pad must be a multiple of G)
    """
    B, H, T, D = x.shape
    G = spec.group_size
    if spec.axis == "token":
        return x.reshape(B, H, T, D // G, G)
    return x.reshape(B, H, T // G, G, D).transpose(-1, -2)


def ungrouped(g: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Inverse of `grouped`."""
    if spec.axis == "token":
        B, H, T, nG, G = g.shape
        return g.reshape(B, H, T, nG * G)
    B, H, nT, D, G = g.shape
    return g.transpose(-1, -2).reshape(B, H, nT * G, D)
