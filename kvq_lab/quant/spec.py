"""The quantizer's recipe: a frozen, validated description of how one tensor is quantized.

A spec says *what* (bits, group size, grouping axis, code format); `kvq_lab.quant.reference` says *how* (the
grouping, and the format's arithmetic from `kvq_lab.quant.formats`), and kernels accelerate the same arithmetic.
This module imports nothing heavy: config validation reads it without torch.
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
from dataclasses import dataclass

from kvq_lab.common.errors import QuantConfigError  # noqa: F401  (raised here; re-exported for callers)

AXES = ("token", "channel")
BITS = (1, 2, 3, 4, 5, 8, 16)
# 16 means "no quantization": the identity quantizer, used as the exact oracle in tests. Each format takes some of
# the others (5: llama.cpp's q5_0 and q5_1 only).
IDENTITY_BITS = 16
DEFAULT_FORMAT = "int"
DEFAULT_BITS = 2  # int's width when none is given (`key_bits: null`); config validation reads it without torch
INT_BITS = (1, 2, 3, 4, 8)  # int's widths (`IntFormat.supported_bits`), here so config validation needs no torch
_FORMAT_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class QuantSpec:
    """Quantization of `[B, H_kv, T, D]` tensors in groups of `group_size`, with one code format.

    axis:
        `token`   -> one group = `group_size` consecutive channels of one token (KIVI's "per-token").
        `channel` -> one group = `group_size` consecutive tokens of one channel (KIVI's "per-channel").
    bits: 1, 2, 3, 4, 5, 8, or 16 (identity, nothing is quantized, whatever the format); the format may allow fewer
        (fp8: 8 only; int: `INT_BITS`; 5: q5_0 and q5_1).
    format: a registered code format (`kvq_lab.quant.formats.FORMATS`, listed in its docstring): `int` (asymmetric
        uniform, KIVI's), `fp8_e4m3`, `lut`, `nvfp4`, ... Resolved, and its bits checked, by
        `kvq_lab.quant.reference.code_format`.
    codebook: the format's code values where it takes them (lut: 2^bits sorted numbers; None = its default),
        kept as a tuple so the spec stays hashable; a list is converted.
    tensor_scale: the per-tensor scale of a format that has one (nvfp4's global scale, fitted per layer and tensor by
        calibration), a positive number rounded to fp32; None = the format's default.
    """

    bits: int = 2
    group_size: int = 32
    axis: str = "token"
    format: str = DEFAULT_FORMAT
    codebook: tuple[float, ...] | None = None
    tensor_scale: float | None = None

    def __post_init__(self):
        if self.axis not in AXES:
            raise QuantConfigError(f"axis={self.axis!r} is not a grouping axis; allowed: {', '.join(AXES)}")
        if isinstance(self.bits, bool) or self.bits not in BITS:
            raise QuantConfigError(f"bits={self.bits!r} is not supported; allowed: {', '.join(map(str, BITS))}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise QuantConfigError(f"group_size={self.group_size!r} must be a positive integer (e.g. 32)")
        if not isinstance(self.format, str) or not _FORMAT_NAME.fullmatch(self.format):
            raise QuantConfigError(f"format={self.format!r} is not a format name; e.g. int, fp8_e4m3, lut")
        if self.codebook is not None:
            try:
                cb = tuple(float(v) for v in self.codebook)
            except (TypeError, ValueError):
                raise QuantConfigError(f"codebook={self.codebook!r} must be a sequence of numbers") from None
            object.__setattr__(self, "codebook", cb)
        if self.tensor_scale is not None:
            object.__setattr__(self, "tensor_scale", fp32_tensor_scale(self.tensor_scale))

    def format_options(self) -> dict:
        """What the spec hands its code format besides the width (`get_format`): the options it gives (lut's
        `codebook`, nvfp4's `tensor_scale`); a format without such an option refuses it in one line."""
        given = (("codebook", self.codebook), ("tensor_scale", self.tensor_scale))
        return {k: v for k, v in given if v is not None}

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

    def code_tag(self) -> str:
        """The codes in a label: `2b` for int (as before formats existed), else the format's name without `_`,
        plus the width where the name does not state it (`fp8e4m3`, `lut2b`), plus a hash of a given codebook or
        tensor scale."""
        if self.format == DEFAULT_FORMAT and self.codebook is None:
            return f"{self.bits}b"
        tag = self.format.replace("_", "")
        if not any(c.isdigit() for c in tag):
            tag += f"{self.bits}b"
        if self.codebook is not None:
            tag += "." + hashlib.sha256(repr(self.codebook).encode()).hexdigest()[:6]
        if self.tensor_scale is not None:
            tag += ".s" + hashlib.sha256(repr(self.tensor_scale).encode()).hexdigest()[:6]
        return tag

    def short(self) -> str:
        """Compact label, e.g. `2b-C32` (C = per-channel, T = per-token), `fp8e4m3-T32`, `16b`."""
        if self.is_identity:
            return "16b"
        return f"{self.code_tag()}-{'C' if self.axis == 'channel' else 'T'}{self.group_size}"


def fp32_tensor_scale(v) -> float:
    """A per-tensor scale as stored: a positive finite number rounded to fp32 (one-line QuantConfigError if not)."""
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0
    try:
        f = struct.unpack("f", struct.pack("f", float(v)))[0] if ok else 0.0
    except OverflowError:
        f = 0.0
    if not (math.isfinite(f) and f > 0):
        raise QuantConfigError(f"tensor_scale={v!r} must be a positive number within fp32's range (e.g. 0.01)")
    return f
