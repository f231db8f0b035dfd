"""Quantized KV caches that plug into `transformers` generation (`past_key_values=`).

Names resolve lazily so that config validation (which needs only `CacheConfig`) imports neither torch nor
transformers.
"""

from importlib import import_module

_EXPORTS = {
    "CacheConfig": "config",
    "LAYERS": "base",
    "NonFiniteError": "base",
    "QuantizedKVCache": "base",
    "register_layer": "base",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
