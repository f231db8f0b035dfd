"""Triton kernels for the packed cache, one per file, each tested against its PyTorch reference.

- `quantize`: quantize + pack int codes straight into the cache's storage (`quantize_into`, `quantize_pack`).
- `dequantize`: unpack + dequantize every code format (`unpack_dequantize`, `dequantize_packed`).
- `attention`: fused decode attention over packed K/V (`decode_attention`): `supports` picks the route, the general
  kernel (any view: rope=pre, every code format, fp32 models) lives here, with flash-decoding's merge of chunks.
- `attention_tc`: its fast route, tensor cores over the grouped query heads (fp16 / bf16 models, int codes).
- `common`: what they share: the packed layout's reader, dequantized rows, the code formats' values, the merge of
  split partials, the shape check.

Tests run them on CPU under `TRITON_INTERPRET=1` (tests/kernels/test_triton.py) and build every launch for sm_90 without
a GPU (tests/kernels/test_triton_compile.py: also reads the tensor-core route's machine code back, via
scripts/kernel_report.py). `kvq_lab.cache.routing.backends` wires them in. Import is lazy: only
`backend=triton` (or `auto` on a CUDA machine) imports this package, and with it triton.
"""

from .attention import decode_attention, supports
from .dequantize import dequantize_packed, unpack_dequantize
from .quantize import quantize_into, quantize_pack, quantizes

__all__ = [
    "decode_attention",
    "dequantize_packed",
    "quantize_into",
    "quantize_pack",
    "quantizes",
    "supports",
    "unpack_dequantize",
]
