"""`nvfp4`: NVIDIA's FP4 (Blackwell's NVFP4; an FP4 KV cache in TensorRT-LLM, vLLM and SGLang): E2M1 codes, one FP8
E4M3 scale per block of 16 and one fp32 scale per tensor, 4.5 bits per element plus 4 bytes per layer and tensor.

NVIDIA's two-level recipe (TensorRT Model Optimizer, TensorRT-LLM), per group of G values (the block: 16 in NVFP4,
`quant=nvfp4`; another group size runs the same arithmetic per group), fp32:

    global = amax(the tensor) / (448 * 6)         stored once per layer and tensor: fp32 (`tensor_scale`)
    s      = e4m3(a / 6 / global)                  a = max |x| over the group's valid elements; round to nearest
                                                   even, saturated at 448; stored: one byte, read as fp16 (exact)
    code   = E2M1 bit pattern of y = x / fp32(s * global), rounded to nearest even and saturated at +-6 (a value that
             rounds to zero gets code 0, +0; s == 0 gives code 0)
    x'     = table[code] * s                       table[c] = fp32(E2M1[c] * global), the formula every kernel reads

"The tensor", in a cache that quantizes chunks (the prefill, then flushed windows or single tokens, batch row by batch
row): one layer's whole key cache, or its whole value cache, over every chunk and every batch row, as in the engines,
which read a per-layer k/v scale calibrated offline. Calibration fits it per layer and tensor (`fit`: the amax of the
layer's calibration keys or values as the quantizer sees them, after transforms, outliers left out), so it is fixed
before the first chunk is quantized: the codes do not depend on how the cache cuts its chunks (a window flush stores
what one call over the whole history would), and simulated and packed mode quantize alike. It is stored once per
layer and tensor (`table_bytes` = 4: the packed cache's `nbytes()` and `cache/bits_total` count it). Without
calibration (a cache built from a config directly; the registry's tests) global = 1: an engine's k/v scale when a
checkpoint carries none (vLLM's default is 1.0), and ggml's NVFP4, which stores no tensor scale. Values beyond the
calibrated range saturate: s stops at 448, elements at 6 * 448 * global.

Deviations, stated:
- global is folded into the table (16 fp32 products, each rounded once), not into each group's scale, so the scale
  stays the exact e4m3 value in fp16 and the C and Triton kernels read this format unchanged (a per-tensor table, as
  lut's). x' = fp32(fp32(E2M1 * global) * s) where NVIDIA computes fp32(E2M1 * s * global): within one fp32 ulp,
  and the same when global is a power of two (1 without calibration).
- The block scale rounds to nearest even, the hardware's cvt.rn.satfinite (torch's float8_e4m3fn cast). ggml's
  `fp32_to_ue4m3` (the `gguf` package) differs in three places: ties round up, everything from 248 (what rounds to
  256 or more) becomes 448, and values between 7.5 * 2^-9 and 2^-6 stay at its largest subnormal 7 * 2^-9; elsewhere
  the two agree (tested). Decoding agrees everywhere (`ue4m3_to_fp32` with the doubled E2M1 table: the same values).

Error: |x - x'| <= d * u(|x| / d) with d = s * global and u = 1/4 up to 2, 1/2 up to 4, 1 up to 6, |x| / d - 6 beyond
(saturation), plus the table's rounding (6 * 2^-24 * d) and that of d itself; x' = 0 where s == 0 (a / 6 / global below
2^-10, half of e4m3's smallest subnormal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from kvq_lab.quant.formats import CodeFormat, register_format
from kvq_lab.quant.formats.fp4 import FP4_MAX, MIDPOINTS, e2m1_values, unit_error
from kvq_lab.quant.formats.ggml import masked, zero_invalid
from kvq_lab.quant.spec import fp32_tensor_scale

E4M3_MAX = 448.0
_MIDS: dict = {}  # device -> fp32 MIDPOINTS


@register_format("nvfp4")
@dataclass(frozen=True)
class NVFP4Format(CodeFormat):
    """NVIDIA's FP4: E2M1 codes under an E4M3 scale per group and an fp32 scale per tensor (module docstring).

    tensor_scale: the per-tensor (per layer and K/V) global scale, fp32; 1.0 until calibration fits it.
    """

    bits: int = 4
    name: str = "nvfp4"
    tensor_scale: float = 1.0
    supported_bits = (4,)
    params = ("scale",)
    param_encodings = {"scale": "e4m3"}
    fitted = True

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "tensor_scale", fp32_tensor_scale(self.tensor_scale))

    @property
    def table_bytes(self) -> int:
        return 4  # the fp32 tensor scale, once per layer and tensor (the table is E2M1 times it)

    def build_table(self) -> torch.Tensor:
        return (e2m1_values() * self.tensor_scale).float()  # each product rounded once (exact in float64)

    def fit(self, spec, x, g, mask=None):
        """The spec with global = amax(x) / (448 * 6), x the layer's calibration keys or values [1, H, T, D] as the
        quantizer sees them, `mask`ed outliers left out (1.0 for an all-zero tensor). g is not read."""
        a = x.abs() if mask is None else x.abs().masked_fill(mask, 0.0)
        amax = float(a.amax()) if a.numel() else 0.0
        scale = amax / (E4M3_MAX * FP4_MAX)
        return replace(spec, tensor_scale=scale if math.isfinite(scale) and scale > 1e-37 else 1.0)

    def quantize_groups(self, g, valid=None):
        """g [..., n, G] -> codes uint8 [..., n, G], scale fp16 [..., n] (e4m3 values), None."""
        x = g.float()
        a = masked(x, valid, 0.0).abs().amax(-1)  # [..., n]
        s = (a / FP4_MAX / self.tensor_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float16)
        d = (s.float() * self.tensor_scale).unsqueeze(-1)  # fp32(s * global), [..., n, 1]
        y = (x / torch.where(d > 0, d, torch.ones_like(d))).contiguous()
        mids = _MIDS.get(x.device)
        if mids is None:
            mids = _MIDS[x.device] = torch.tensor(MIDPOINTS, device=x.device)
        lo = torch.searchsorted(mids, y.abs())  # magnitudes below |y|'s nearest: midpoints < |y|
        hi = torch.searchsorted(mids, y.abs(), right=True)  # hi = lo + 1 exactly on a midpoint
        mag = torch.where((hi > lo) & (lo % 2 == 1), hi, lo)  # a tie goes to the even code (round half to even)
        codes = torch.where((y < 0) & (mag > 0), mag + 8, mag)  # the sign bit; zero stays +0
        codes = torch.where(d > 0, codes, torch.zeros_like(codes))
        return zero_invalid(codes.to(torch.uint8), valid), s, None

    def error_bound(self, g, scale, zero):
        """[..., n, G]: d * u(|x| / d) plus the table's and d's rounding, d = s * global (module docstring); |x| where
        s == 0."""
        x = g.double().abs()
        d = scale.double().unsqueeze(-1) * self.tensor_scale  # exact in float64
        safe = torch.where(d > 0, d, torch.ones_like(d))
        bound = d * unit_error(x / safe) + (6 * d + x) * 2**-23
        return torch.where(d > 0, bound, x).float()
