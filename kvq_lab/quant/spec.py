"""The quantizer's recipe: a frozen, validated description of how one tensor is quantized.

A spec says *what* (bits, group size, grouping axis); `kvq_lab.quant.reference` says *how*
(the arithmetic), and kernels accelerate the same arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("token", "channel")
BITS = (1, 2, 3, 4, 8, 16)
# 16 means "no quantization": the identity quantizer, used as the exact oracle in tests.
IDENTITY_BITS = 16


class QuantConfigError(ValueError):
    """A quantization setting is out of range. The message names the setting, its value and the fix."""


@dataclass(frozen=True)
class QuantSpec:
    """Asymmetric uniform integer quantization of `[B, H_kv, T, D]` tensors in groups of `group_size`.

    axis:
        `token`   -> one group = `group_size` consecutive channels of one token (KIVI's "per-token").
        `channel` -> one group = `group_size` consecutive tokens of one channel (KIVI's "per-channel").
    bits: 1, 2, 3, 4, 8, or 16 (identity, nothing is quantized).
    """

    bits: int = 2
    group_size: int = 32
    axis: str = "token"

    def __post_init__(self):
        if self.axis not in AXES:
            raise QuantConfigError(f"axis={self.axis!r} is not a grouping axis; allowed: {', '.join(AXES)}")
        if isinstance(self.bits, bool) or self.bits not in BITS:
            raise QuantConfigError(f"bits={self.bits!r} is not supported; allowed: {', '.join(map(str, BITS))}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise QuantConfigError(f"group_size={self.group_size!r} must be a positive integer (e.g. 32)")

    @property
    def is_identity(self) -> bool:
        return self.bits >= IDENTITY_BITS

    @property
    def levels(self) -> int:
        """Largest code: 2^bits - 1."""
        return (1 << self.bits) - 1

    def check_head_dim(self, head_dim: int, name: str = "group_size") -> None:
        """Per-token groups run along channels, so they must tile the head dimension exactly."""
        if self.axis == "token" and not self.is_identity and head_dim % self.group_size:
            divisors = [g for g in range(1, head_dim + 1) if head_dim % g == 0]
            raise QuantConfigError(
                f"{name}={self.group_size} does not divide head_dim={head_dim} (per-token groups run along "
                f"channels); use one of {divisors}"
            )

    def short(self) -> str:
        """Compact label, e.g. `2b-C32` (C = per-channel, T = per-token), `16b`."""
        if self.is_identity:
            return "16b"
        return f"{self.bits}b-{'C' if self.axis == 'channel' else 'T'}{self.group_size}"
