"""`mxfp4`: OCP Microscaling FP4 (MXFP4, OCP MX v1.0; llama.cpp's MXFP4 block type; an FP4 KV cache in vLLM, SGLang
and TensorRT-LLM): E2M1 codes and one power-of-two E8M0 scale per block of 32, 4.25 bits per element. ggml's reference
quantizer (`quantize_row_mxfp4_ref`) bit for bit; the `gguf` package's numpy port is the test oracle for codes and
exponents.

Arithmetic (per group, fp32; MX's block is 32, `quant=mxfp4`; another group size runs the same arithmetic per group):

    a     = max |x| over the group's valid elements
    e     = floor(fp32(log2(a))) - 2 + 127     stored: one byte (E8M0); e = 0 for a group of zeros
    scale = 2^(e - 127)                        read as fp32 (exact for every e; fp16 holds only 2^-24 .. 2^15)
    code  = the c minimizing |scale * table[c] - x| in fp32, the lowest c on a tie (ggml's argmin)
    x'    = table[code] * scale                table: the E2M1 values (`fp4`), codes 8-15 negative

ggml writes the table doubled (0, 1, ..., 12) under 2^(e - 128): the same products, so the same errors and codes.
log2 is rounded to fp32 before the floor, as `log2f` and numpy's float32 log2 do (computed here in float64 and rounded:
numpy's results, checked on a million values): for a within ~2^-21 of a power of two below it, the exponent is one
higher than exact arithmetic gives (a coarser scale; nothing clips). a / scale lies in [4, 8) otherwise, so elements
above 6 * scale saturate to 6 (MX's clipping, up to 2 * scale). Ties go to the lower magnitude (0.75 -> 0.5), and a
value rounding to zero gets code 0 (+0), never 8. Below ggml's range, a < 2^-125 (fp32 subnormals), ggml's exponent
turns negative and its uint8 cast wraps; here it stays e = 0 (scale 2^-127; such a group's elements are then below
4 * scale, none saturates). Elements outside `valid` get code 0; a group without one gets e = 0.

Error: |x - x'| <= scale * u(|x| / scale), u = 1/4 up to 2, 1/2 up to 4, 1 up to 6, and |x| / scale - 6 beyond.

Backends: the C decode kernel reads fp16 parameters (kvq_lab/kernels/cpu_kernel.c) and an E8M0 scale reads as fp32,
so `unsupported_backends = ("cpu",)`: `backend=auto` takes the PyTorch path on the CPU with one warning, and
`backend=cpu` is refused before the model loads. The Triton kernels load any float parameter and read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvq_lab.quant.formats import CodeFormat, register_format
from kvq_lab.quant.formats.encodings import decode
from kvq_lab.quant.formats.fp4 import e2m1_values, unit_error
from kvq_lab.quant.formats.ggml import masked, zero_invalid

E8M0_BIAS = 127


@register_format("mxfp4")
@dataclass(frozen=True)
class MXFP4Format(CodeFormat):
    """OCP MX FP4: E2M1 codes under a power-of-two E8M0 scale per group, ggml's MXFP4 arithmetic (module docstring)."""

    bits: int = 4
    name: str = "mxfp4"
    supported_bits = (4,)
    params = ("scale",)
    param_encodings = {"scale": "e8m0"}
    unsupported_backends = ("cpu",)

    def build_table(self) -> torch.Tensor:
        return e2m1_values().float()

    def exponents(self, g: torch.Tensor, valid=None) -> torch.Tensor:
        """The stored E8M0 byte of each group: g [..., n, G] -> uint8 [..., n]."""
        a = masked(g.float(), valid, 0.0).abs().amax(-1)
        lg = torch.log2(a.double()).float().floor()  # fp32(log2 a), floored; -inf where a == 0
        return torch.where(a > 0, lg - 2 + E8M0_BIAS, 0.0).clamp(0, 2 * E8M0_BIAS).to(torch.uint8)

    def quantize_groups(self, g, valid=None):
        """g [..., n, G] -> codes uint8 [..., n, G], scale fp32 [..., n] (powers of two), None."""
        x = g.float()
        scale = decode("e8m0", self.exponents(x, valid))  # 2^(e - 127), exact
        s = scale.unsqueeze(-1)
        t = self.table(x.device)
        best = (s * t[0] - x).abs()  # ggml's argmin, one code at a time: strictly better replaces (lowest c on a tie)
        codes = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
        for c in range(1, 16):
            err = (s * t[c] - x).abs()
            better = err < best
            best = torch.where(better, err, best)
            codes = torch.where(better, c, codes)
        return zero_invalid(codes.to(torch.uint8), valid), scale, None

    def error_bound(self, g, scale, zero):
        """[..., n, G]: scale * u(|x| / scale) (module docstring), exact (powers of two divide exactly)."""
        s = scale.double().unsqueeze(-1)
        return (s * unit_error(g.double().abs() / s)).float()
