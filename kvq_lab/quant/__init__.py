"""Quantizers: the spec (`QuantSpec`), the pure-PyTorch reference (the specification), and kernels.

Names resolve lazily so that config validation (which needs only `QuantSpec`) does not import torch.
"""

from importlib import import_module

_EXPORTS = {
    "AXES": "spec",
    "BITS": "spec",
    "QuantConfigError": "spec",
    "QuantSpec": "spec",
    "QTensor": "reference",
    "dequantize": "reference",
    "fake_quant": "reference",
    "quantize": "reference",
    "step_size": "reference",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
