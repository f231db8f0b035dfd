"""`policy=kivi` (the default): every token stored as the cache's mode says, nothing chosen per token.

Packed mode: KIVI's streaming (exact sinks, an exact window of `exact_window` tokens, groups quantized as they
fill); simulated mode: KIVI Table 1's fake quant of every token; the prompt's forward as `prefill` says."""

from __future__ import annotations

from dataclasses import dataclass

from kvq_lab.cache.policies import Policy, register_policy


@register_policy
@dataclass(frozen=True)
class Kivi(Policy):
    name = "kivi"
    summary = "every token stored as `mode` says (KIVI: packed streaming, or Table 1's fake quant in simulated mode)"
