"""Quantized KV caches that plug into `transformers` generation (`past_key_values=`).

Names resolve lazily so that config validation (which needs only `CacheConfig`) imports neither torch nor
transformers.
"""

from kvq_lab._lazy import lazy_getattr

_EXPORTS = {
    "CacheConfig": "config",
    "LAYERS": "base",
    "NonFiniteError": "base",
    "QuantizedKVCache": "base",
    "register_layer": "base",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
