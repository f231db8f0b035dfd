"""The cache's layer objects, one per decoder layer (transformers' `Cache` is a list of them): `base` (the machinery
every mode shares and the mode registry), one module per mode (`simulated`, `packed`, `recompute`) with its parts
(`simulated_stream`, `simulated_batch`, `packed_decode`), and the layers that hold layers of a mode (`tiered`: a token
policy's tiers; `heads`: per-head bits). `kvq_lab.cache.kv_cache` imports the mode modules so they register."""
