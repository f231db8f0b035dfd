"""E2M1, the 4-bit float of the FP4 formats (`nvfp4`, `mxfp4`; OCP MX v1.0's FP4): what they share. Not a format itself.

A code is an E2M1 bit pattern, sign bit first (bit 3), then 2 exponent bits and 1 mantissa bit: codes 0-7 are the
magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8-15 their negatives (8 is -0.0). Steps between neighbours are 0.5
up to 2, 1 up to 4, 2 up to 6; nothing lies beyond 6 (a block's scale maps its largest element near 6).
"""

from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the values of codes 0-7; code 8 + i is -E2M1[i]
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between neighbouring magnitudes: the decision boundaries
FP4_MAX = E2M1[-1]


def e2m1_values() -> torch.Tensor:
    """float64 [16]: the value of each code (code 8 is -0.0)."""
    return torch.tensor([*E2M1, *(-v for v in E2M1)], dtype=torch.float64)


def unit_error(y: torch.Tensor) -> torch.Tensor:
    """The largest |y - E2M1(y)| rounding y = |x| / scale to its nearest magnitude: half the step it falls in (1/4,
    1/2, 1), or, beyond 6, what saturation loses (y - 6)."""
    return torch.where(y <= 2, 0.25, torch.where(y <= 4, 0.5, torch.where(y <= FP4_MAX, 1.0, y - FP4_MAX)))
