"""Quantizers: the spec (`QuantSpec`), the pure-PyTorch reference (the specification), and bit packing.

The bottom of kvq_lab's import graph (above `_lazy` only): it imports no other kvq_lab package. Kernels that
accelerate this arithmetic live one layer up, in `kvq_lab.kernels`, and are tested against it.

Names resolve lazily so that config validation (which needs only `QuantSpec`) does not import torch.
"""

from kvq_lab.common.lazy import lazy_getattr

_EXPORTS = {
    "AXES": "spec",
    "BITS": "spec",
    "QuantConfigError": "spec",
    "QuantSpec": "spec",
    "QTensor": "reference",
    "code_format": "reference",
    "dequantize": "reference",
    "fake_quant": "reference",
    "quantize": "reference",
    "step_size": "reference",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
