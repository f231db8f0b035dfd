"""Layer-wise mixed precision (KVTuner-like), the search: per-layer (key bits, value bits) chosen on the loaded model
under an average-bits budget. The settings, their checks and the per-layer bits file (model-free, what
`kvq_lab.run.config` reads) are `kvq_lab.fit.precision_settings`; what each choice stores is
`kvq_lab.fit.precision_costs`; what each choice costs in accuracy is `kvq_lab.fit.precision_sensitivity`.

`precision=search`: after the model loads, (1) measure each layer's sensitivity (the logit KL with one layer's keys
or values quantized), (2) count each choice's bytes, (3) pick the per-layer bits with the least total sensitivity
whose bytes fit the budget, (4) write them to `<run folder>/precision.yaml`, which `precision=file
precision.path=<that file>` reruns exactly (the same per-layer specs, so the same cache).

Search: an exact multiple-choice knapsack (dynamic programming over total bytes, Pareto-pruned: costs are linear
in bits, so the frontier holds a few hundred entries), one item per (layer, tensor), one option per choice.

`precision.granularity=head`: the same with one item per (layer, KV head, tensor). The searched layer stores each
width's heads as one layer of their own (`kvq_lab.cache.layers.heads`), counted by `nbytes()` as the search counts it;
formats with a table per tensor (lut, nvfp4) are refused before load.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvq_lab.cache.config import CacheConfig
from kvq_lab.common.errors import ConfigError
from kvq_lab.fit.precision_costs import Costs, flat, measure_costs, shape_costs
from kvq_lab.fit.precision_sensitivity import (
    _Tail,
    cached_sensitivities,
    sensitivities,
    sensitivity_dir,
    sensitivity_text,
)
from kvq_lab.fit.precision_settings import check_layers, per_layer, read_file, settings, write_file

log = logging.getLogger("kvq_lab")

# the parts, importable from here as before (kvq_lab.preflight.model, the mixed-precision study, the tests)
__all__ = [
    "Costs",
    "_Tail",
    "cached_sensitivities",
    "check_budget",
    "flat",
    "knapsack",
    "measure_costs",
    "metrics",
    "resolve",
    "search",
    "sensitivities",
    "sensitivity_dir",
    "sensitivity_text",
    "shape_costs",
]


def knapsack(items: list[list[tuple[int, float]]], capacity: int) -> list[int] | None:
    """Exact multiple-choice knapsack: items[i] = [(cost, loss) per option]; pick one option per item minimizing the
    total loss with total cost <= capacity (ties: the cheaper). -> option index per item, or None if infeasible.

    Dynamic programming over total cost with a Pareto frontier (a state is kept only if no cheaper state has a
    loss as low)."""
    frontier: list[tuple[int, float, tuple[int, ...]]] = [(0, 0.0, ())]
    for opts in items:
        cand: dict[int, tuple[float, tuple[int, ...]]] = {}
        for c, loss, picks in frontier:
            for j, (oc, ol) in enumerate(opts):
                c2, l2 = c + oc, loss + ol
                if c2 <= capacity and (c2 not in cand or l2 < cand[c2][0]):
                    cand[c2] = (l2, (*picks, j))
        frontier, best = [], float("inf")
        for c in sorted(cand):
            loss, picks = cand[c]
            if loss < best:
                frontier.append((c, loss, picks))
                best = loss
        if not frontier:
            return None
    return list(min(frontier, key=lambda e: (e[1], e[0]))[2])


def check_budget(costs: Costs, budget: float, choices: list[int], met: bool = True) -> None:
    """One-line ConfigError where even every unit at the smallest choice stores more than `budget` bits per element
    as `Costs.bits` counts them (codes, parameters, exact windows and sinks; per head where the search is): checked
    before the load from the model's files (`kvq_lab.preflight.model`), and before any sensitivity is measured. `met`
    False: the search found no assignment (a budget equal to the cheapest, lost to rounding)."""
    U, b = costs.units, min(choices)
    low = costs.bits([b] * U, [b] * U)
    if budget < low or not met:
        unit = "head" if costs.heads > 1 else "layer"
        raise ConfigError(
            f"precision.budget={budget:g} cannot be met: every {unit} at {b} bits stores {low:.4g} bits per element "
            "with exact windows and sinks counted (per-channel groups keep up to G tokens exact until full); raise "
            f"the budget to >= {math.ceil(low * 1000) / 1000:g} or lower exact_window"
        )


def search(sens: dict[str, dict[int, list]], costs: Costs, budget: float, choices: list[int]):
    """-> (key_bits [L], value_bits [L]) (per head, `costs.heads` > 1: [L][H_kv] each) with the least total
    sensitivity whose stored bits per element (as `Costs.bits` counts them) are at most `budget`; ConfigError (one
    line) when even the cheapest is over."""
    L, H, U = costs.layers, costs.heads, costs.units
    capacity = int(budget * U * costs.elements // 8) - U * costs.fixed - costs.shared  # bytes the streams may take
    items = []
    for tensor, cost in (("key", costs.key), ("value", costs.value)):
        for u in range(U):
            items.append([(cost[b], flat(sens[tensor][b])[u]) for b in choices])
    check_budget(costs, budget, choices)
    picks = knapsack(items, capacity)
    if picks is None:
        check_budget(costs, budget, choices, met=False)
    bits = [choices[j] for j in picks]
    kb, vb = bits[:U], bits[U:]
    if H == 1:
        return kb, vb
    return [kb[i * H : (i + 1) * H] for i in range(L)], [vb[i * H : (i + 1) * H] for i in range(L)]


def resolve(
    model, tok, cache: CacheConfig, precision, data_dir: Path | None, run_dir: Path, model_id: Any = None
) -> CacheConfig:
    """After the model loads: uniform -> `cache`; file -> `cache` (per-layer already, from `apply_file`) checked
    against the model's layer count; search -> the searched per-layer cache, written to run_dir/precision.yaml."""
    s = settings(precision)
    text_cfg = model.config.get_text_config(decoder=True)
    if s["name"] == "file":  # validation checked it from the model's files where they are local
        check_layers(s, cache, text_cfg.num_hidden_layers, text_cfg.num_key_value_heads)
        return cache
    if s["name"] != "search":
        return cache
    choices, T, unit = s["choices"], s["tokens"], s["granularity"]
    costs = measure_costs(model, cache, choices, T, unit)
    check_budget(costs, s["budget"], choices)  # before any sensitivity pass (a hub model's first chance)
    text = sensitivity_text(s, data_dir)
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :T]
    if ids.shape[1] < T:
        raise ConfigError(f"precision.source={s['source']} has {ids.shape[1]} tokens; lower precision.tokens={T}")
    ids = ids.to(next(model.parameters()).device)
    model_id = model_id if model_id is not None else getattr(model, "name_or_path", None)
    sens, sens_path = cached_sensitivities(model, ids, cache, choices, model_id, text, unit)
    key_bits, value_bits = search(sens, costs, s["budget"], choices)
    meta = {
        "budget": s["budget"],
        "choices": choices,
        "stored_bits": costs.bits(key_bits, value_bits),
        "signal": "logit_kl",
        "granularity": unit,
        "tokens": T,
        "source": s["source"],
        "cache": cache.label(),
        "sensitivity": {t: {str(b): v for b, v in d.items()} for t, d in sens.items()},
        "sensitivity_cache": _home_relative(sens_path),
        "bytes": {"key": costs.key, "value": costs.value, f"fixed_per_{unit}": costs.fixed, "shared": costs.shared},
    }
    write_file(run_dir / "precision.yaml", key_bits, value_bits, meta)
    log.info("precision: key bits %s, value bits %s (%.3f bits/element)", key_bits, value_bits, meta["stored_bits"])
    return per_layer(cache, key_bits, value_bits)


def _home_relative(path: Path) -> str:
    """`path` as `~/...` under the home folder (the default caches): a committed run folder names no one's home."""
    try:
        return str(Path("~") / Path(path).resolve().relative_to(Path.home().resolve()))
    except ValueError:
        return str(path)


def metrics(model, cache: CacheConfig, precision) -> dict[str, float]:
    """A per-layer cache's mean key and value bits and its stored bits per K/V element as the search counts them
    (`Costs.bits`, at `precision.tokens` tokens, or the file's); {} under precision=uniform (calibrated per-layer
    configs included: their bits are the run's). `precision`: the run's precision section."""
    s = settings(precision)
    if s["name"] == "uniform" or not cache.layers:
        return {}
    T = read_file(s["path"]).get("tokens", s["tokens"]) if s["name"] == "file" else s["tokens"]
    H = model.config.get_text_config(decoder=True).num_key_value_heads
    heads = any(c.head_bits for c in cache.layers)

    def per_head(c: CacheConfig, tensor: str) -> list[int]:
        if c.head_bits:
            return [pair[tensor == "value"] for pair in c.head_bits]
        return [getattr(c, tensor).bits] * H

    if heads:  # per-head bits: means over heads, bytes counted per head
        kb, vb = [per_head(c, "key") for c in cache.layers], [per_head(c, "value") for c in cache.layers]
    else:
        kb, vb = [c.key.bits for c in cache.layers], [c.value.bits for c in cache.layers]
    fk, fv = flat(kb), flat(vb)
    costs = measure_costs(model, replace(cache, layers=()), sorted(set(fk) | set(fv)), T, "head" if heads else "layer")
    return {
        "precision/key_bits_mean": sum(fk) / len(fk),
        "precision/value_bits_mean": sum(fv) / len(fv),
        "precision/bits_stored": costs.bits(kb, vb),
        "precision/bits_tokens": float(T),
    }
