"""`policy=saliency`: token-level mixed precision by saliency (ZipCache, arXiv 2405.14256).

The prompt's middle tokens ranked by ZipCache's normalized attention (attention a token receives, summed over the
queries that can see it, divided by their number, so early tokens are not favoured for being early); the top
`high` share at `high_bits` (groups of `high_group`; null: the cache's `group_size`), the rest at the cache's own
quantizer."""

from __future__ import annotations

from dataclasses import dataclass

from kvq_lab.cache.policies import Tier, TokenPolicy, _count, _fraction, check_tier_bits, register_policy


@register_policy
@dataclass(frozen=True)
class Saliency(TokenPolicy):
    name = "saliency"
    summary = "the top `high` share of the prompt by normalized attention at `high_bits`, the rest at the cache's bits"
    lossless = {"high_bits": 16}

    score: str = "normalized"
    high: float = 0.2
    high_bits: int = 4
    high_group: int | None = None

    def __post_init__(self):
        super().__post_init__()
        _fraction("high", self.high)
        check_tier_bits("high_bits", self.high_bits)
        if self.high_group is not None:
            _count("high_group", self.high_group, lo=1)

    def tiers(self, cache):
        high = self.tier_config(cache, self.high_bits, self.high_group)
        return (Tier(self.high, high), Tier(1 - self.high, self.tier_config(cache)))
