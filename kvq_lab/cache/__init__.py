"""Quantized KV caches that plug into `transformers` generation (`past_key_values=`).

Modules, one role each: `config` (what a cache does), `base` (layer machinery and the mode registry), `kv_cache`
(`QuantizedKVCache`, which imports the layer modules so they register), `simulated` and `packed` (the layers),
`simulated_stream` (fake-quant arithmetic), `simulated_batch` (growing buffers, batch row edits), `packed_decode`
(what a packed layer hands the decode kernels), `store` (packed bits), `streams` (streaming policies), `backends`
(kernel selection), `attention` (`kvq_sdpa` routing), `rope` (RoPE cos/sin at each token's positions, for positional
transforms). Kernels live below, in `kvq_lab.kernels`.

Names resolve lazily so that config validation (which needs only `CacheConfig`) imports neither torch nor
transformers.
"""

from kvq_lab.common.lazy import lazy_getattr

_EXPORTS = {
    "CacheConfig": "config",
    "LAYERS": "kv_cache",  # through kv_cache: the registry with every built-in mode registered
    "NonFiniteError": "base",
    "QuantizedKVCache": "kv_cache",
    "register_layer": "base",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
