"""Storage encodings of per-group parameters (`CodeFormat.param_encodings`): the bytes a store holds, and the float
they are read as. Not a format itself.

    encoding  stored                                         read as (exactly)
    fp16      fp16, 2 bytes                                  the same tensor
    e4m3      uint8: the bits of an fp8 E4M3 value (e4m3fn)   fp16 (every finite e4m3 value is an fp16 value)
    e8m0      uint8: e, the biased exponent of 2^(e - 127)   fp32 (e = 0 .. 254: 2^-127 is an fp32 subnormal; fp16
                                                             would hold only 2^-24 .. 2^15)

`encode` takes the read float, which the format guarantees representable (an e4m3 value; a power of two in
[2^-127, 2^127]), and `decode(enc, encode(enc, v)) == v` bit for bit (tested). A store keeps `encode`'s bytes and
counts them (`PARAM_ENCODINGS`); quantization, the dequantize formula and the kernels read `decode`'s floats.
e8m0's byte 255 (NaN in OCP MX) is never produced; it decodes to +inf.
"""

from __future__ import annotations

import torch

from kvq_lab.quant.rounding import PARAM_DTYPE

STORED = {"fp16": PARAM_DTYPE, "e4m3": torch.uint8, "e8m0": torch.uint8}
READ = {"fp16": PARAM_DTYPE, "e4m3": torch.float16, "e8m0": torch.float32}
_FP32_2_M127 = 0x00400000  # the bits of 2^-127, an fp32 subnormal (e8m0's e = 0)


def encode(enc: str, v: torch.Tensor | None) -> torch.Tensor | None:
    """v as read (READ[enc]) -> as stored (STORED[enc]); None stays None."""
    if v is None or enc == "fp16":
        return v
    if enc == "e4m3":
        return v.to(torch.float8_e4m3fn).view(torch.uint8)
    bits = v.float().view(torch.int32)  # a positive power of two: its exponent field, or 2^-127's subnormal pattern
    return torch.where(bits == _FP32_2_M127, 0, bits >> 23).to(torch.uint8)


def decode(enc: str, b: torch.Tensor | None) -> torch.Tensor | None:
    """b as stored (STORED[enc]) -> as read (READ[enc]); None stays None."""
    if b is None or enc == "fp16":
        return b
    if enc == "e4m3":
        return b.view(torch.float8_e4m3fn).to(torch.float16)
    e = b.to(torch.int32)
    return torch.where(e == 0, _FP32_2_M127, e << 23).view(torch.float32)
