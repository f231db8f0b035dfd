"""Quantized KV caches that plug into `transformers` generation (`past_key_values=`).

Folders by role, as kvq_lab/quant/ has formats/, transforms/, residuals/:
    kv_cache.py   `QuantizedKVCache`, the assembly: imports the layer modules so they register
    layers/       one layer object per decoder layer: `base` (shared machinery, the mode registry), a module per mode
                  (`simulated`, `packed`, `recompute`) and its parts, `tiered` (token policies), `heads` (per-head bits)
    storage/      what a layer keeps and how it streams in: `store` (packed bits), `streams` (KIVI's window and
                  flushes), `rows` (the left-padded prefill layout)
    routing/      where the cache meets attention and kernels: `attention` (`kvq_sdpa`), `backends` (kernel choice),
                  `rope` (cos/sin at each token's positions)
    policies/     which tokens get which bits (a registry of plug-ins, and their scores)
    config.py, knobs.py, checks.py, modes.py, labels.py, accounting.py: what a cache is (the frozen config, the user's
                  knobs that build it, the checks against the machine, what each mode supports, its short name, its
                  stored bits). Kernels live below, in `kvq_lab.kernels`.

Names resolve lazily so that config validation (which needs only `CacheConfig`) imports neither torch nor
transformers.
"""

from kvq_lab.common.lazy import lazy_getattr

_EXPORTS = {
    "CacheConfig": "config",
    "LAYERS": "kv_cache",  # through kv_cache: the registry with every built-in mode registered
    "NonFiniteError": "layers.base",
    "QuantizedKVCache": "kv_cache",
    "register_layer": "layers.base",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
