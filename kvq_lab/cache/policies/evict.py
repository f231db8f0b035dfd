"""`policy=evict`: eviction, then quantization of what is kept (SnapKV / H2O / key-norm eviction under a low-bit
cache, as kvpress's presses over a quantized cache, MiniKV).

The prompt's middle tokens (after the sinks, before the last `window`) ranked by `score`; the top `keep` share is
stored at the cache's own quantizer (`bits`, `group_size`, axes, format), the rest dropped: attention never reads
them again and their bytes are not stored."""

from __future__ import annotations

from dataclasses import dataclass

from kvq_lab.cache.policies import Tier, TokenPolicy, _fraction, register_policy


@register_policy
@dataclass(frozen=True)
class Evict(TokenPolicy):
    name = "evict"
    summary = "keep the top `keep` share of the prompt by `score` at the cache's bits, drop the rest (SnapKV, H2O)"
    lossless = {"keep": 1.0}

    keep: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        _fraction("keep", self.keep)

    def tiers(self, cache):
        return (Tier(self.keep, self.tier_config(cache)), Tier(1 - self.keep, None))
