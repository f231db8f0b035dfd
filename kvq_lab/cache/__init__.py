"""Quantized KV caches that plug into `transformers` generation (`past_key_values=`)."""

from .base import LAYERS, NonFiniteError, QuantizedKVCache, register_layer
from .config import CacheConfig

__all__ = ["LAYERS", "CacheConfig", "NonFiniteError", "QuantizedKVCache", "register_layer"]
