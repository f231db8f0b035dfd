"""`policy=mikv`: MiKV (arXiv 2402.18096): the tokens an eviction method would drop are kept at low precision
instead.

The prompt's middle tokens ranked by `score` (H2O's accumulated attention by default); the top `keep` share at the
cache's own quantizer, the rest at `low_bits` (groups of `low_group` tokens or channels; null: the cache's
`group_size`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvq_lab.cache.policies import Tier, TokenPolicy, _count, _fraction, check_tier_bits, register_policy


@register_policy
@dataclass(frozen=True)
class MiKV(TokenPolicy):
    name = "mikv"
    summary = "the top `keep` share of the prompt at the cache's bits, the rest at `low_bits` instead of dropped"
    lossless = {"low_bits": 16}

    score: str = "attention"
    keep: float = 0.2
    low_bits: int = 2
    low_group: int | None = None

    def __post_init__(self):
        super().__post_init__()
        _fraction("keep", self.keep)
        check_tier_bits("low_bits", self.low_bits)
        if self.low_group is not None:
            _count("low_group", self.low_group, lo=1)

    def tiers(self, cache):
        low = self.tier_config(cache, self.low_bits, self.low_group)
        return (Tier(self.keep, self.tier_config(cache)), Tier(1 - self.keep, low))
