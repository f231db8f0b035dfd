"""`policy=fakequant`: KIVI Table 1's fake quant. Every cached token, the prompt's included, is quantized and
dequantized as it enters the cache and attention reads the result: no exact window, partial per-channel groups
zero-padded and quantized again as they fill (`sink_tokens`, where set, stay exact: an ablation on top of Table 1).

Simulated mode's layers do exactly this (with the prompt quantized: `prefill` unset or `quantized`); the policy names
it, so that a config that says "Table 1" cannot drift into something else: it refuses the packed cache (which keeps
partial groups and its window exact) and an exact prefill, and it quantizes the prompt on every task
(`quantizes_prompt`: task=ppl, fidelity and retrieval, whose `task.prompt_forward=exact` would hand the cache the
exact K/V of their context, forward it through the cache instead; task=probe, which runs no prompt through a cache, is
refused before load). The layers are simulated mode's, unchanged, so the
Table-1 records (experiments/kivi_axis_table, made as `mode=simulated`) reproduce bit for bit through it
(tests/cache/test_policies.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kvq_lab.cache.policies import Policy, register_policy
from kvq_lab.quant.spec import QuantConfigError


@register_policy
@dataclass(frozen=True)
class FakeQuant(Policy):
    name = "fakequant"
    summary = "KIVI Table 1: every token, the prompt's included, fake-quantized (simulated mode, no window)"
    modes = ("simulated",)
    quantizes_prompt = True

    def check(self, cache) -> None:
        if not cache.caps.fake_quant:
            raise QuantConfigError(
                f"policy=fakequant is KIVI Table 1's fake quant of every token; mode={cache.mode} keeps partial groups "
                "and its window exact: use mode=simulated (or policy=kivi for the packed cache's streaming)"
            )
        if cache.prefill == "exact":
            raise QuantConfigError(
                "policy=fakequant quantizes the prompt too (Table 1); prefill=exact keeps its forward exact: unset "
                "prefill or use policy=kivi"
            )
