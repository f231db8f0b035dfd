"""Quantizers: the spec (`QuantSpec`), the pure-PyTorch reference (the specification), and kernels."""

from .reference import QTensor, dequantize, fake_quant, quantize, step_size
from .spec import AXES, BITS, QuantConfigError, QuantSpec

__all__ = ["AXES", "BITS", "QTensor", "QuantConfigError", "QuantSpec", "dequantize", "fake_quant", "quantize", "step_size"]
