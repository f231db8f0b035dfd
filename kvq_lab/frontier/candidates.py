"""Stage 1 of the frontier, enumeration: every cache worth trying, its stored bits counted before anything runs.

Sources (`frontier.sources`):
    preset   every conf/quant/*.yaml but fp16 (the reference)
    grid     int codes: (key bits, value bits) x axes x group size, Hadamard keys (per-token), QJL / sparse / low-rank
             error corrections, and the other formats (lut, turbo, fp8) at their widths
    policy   conf/policy/ token policies (evict, mikv, saliency) over KIVI int2 and int4 K-C/V-T
    search   precision=search (conf/precision/search.yaml: per-layer key/value bits from [2, 3, 4, 8] on KIVI's
             K-C/V-T) at each budget; its budget is raised by what the packed cache it prices keeps besides the
             codes (the per-channel keys' fill buffer), so that the cache it picks stores at most the budget as the
             frontier counts bits; its `bits` are that bound (`exact` False), its record the exact count
    engine   the kvq_lab caches of the engine table (`kvq_lab.report.engines`)

Each candidate is a set of knob overrides applied to the run's config with the quantizer's knobs reset first
(`apply`). Its bits: `QuantizedKVCache.stored_bits` of the cache those knobs build (validated as a run validates
it), for the model's shape read from its files (`Shape`), at the rank stage's sequence length (`Task.cached_tokens`):
codes, per-group parameters, tables, outliers, corrections and token-policy tiers, all per cached K/V element.
Two candidates that build the same cache (the same `CacheConfig` and per-layer precision settings) are one; the
first source named keeps it. A candidate belongs to every budget it fits under (`bits <= budget`).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from kvq_lab.cache.accounting import Shape
from kvq_lab.common.errors import ConfigError
from kvq_lab.preflight import cache_config

CONF = Path(__file__).resolve().parents[2] / "conf"
# the quantizer's knobs, reset before a candidate's are applied (mode, windows, sinks, prefill stay the run's)
CLEAN: dict[str, Any] = {
    "bits": None, "key_bits": None, "value_bits": None, "format": None, "key_format": None, "value_format": None,
    "transform": None, "key_transform": None, "value_transform": None, "residual": None, "key_residual": None,
    "value_residual": None, "key_outliers": 0.0, "value_outliers": 0.0, "group_size": 32, "key_axis": "channel",
    "value_axis": "token", "rope": "post", "skip_layers": None,
}  # fmt: skip
SECTIONS = {"policy": {"name": "kivi"}, "precision": {"name": "uniform"}}
AXES = {"KC_VT": ("channel", "token"), "KT_VT": ("token", "token"), "KC_VC": ("channel", "channel"),
        "KT_VC": ("token", "channel")}  # fmt: skip


@dataclass
class Candidate:
    """One cache to try: its name, where it came from, its knob overrides, and what it stores."""

    name: str
    source: str
    overrides: dict[str, Any]
    bits: float = float("nan")  # stored bits per K/V element (an upper bound where not `exact`)
    exact: bool = True
    label: str = ""  # the cache's label (records carry it)
    budgets: list[float] = field(default_factory=list)  # the budgets it fits under
    same_as: list[str] = field(default_factory=list)  # other names of the same cache, dropped as duplicates
    engines: list[str] = field(default_factory=list)  # engine settings that run this cache (`engine_settings`)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def apply(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """The run config of a candidate: `base` (plain values) with the quantizer knobs reset, then `overrides`."""
    c = json.loads(json.dumps(base))
    c.update(CLEAN)
    c.update(json.loads(json.dumps(SECTIONS)))
    c.update(json.loads(json.dumps(overrides)))
    return c


def _yaml(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


def presets() -> list[tuple[str, dict]]:
    return [(p.stem, _yaml(p)) for p in sorted((CONF / "quant").glob("*.yaml")) if p.stem != "fp16"]


def grid() -> list[tuple[str, dict]]:
    """The int grid and the other formats at their widths (module docstring)."""
    out = []
    pairs = [(b, b) for b in (2, 3, 4, 8)] + [(4, 2), (8, 4), (4, 3), (8, 2), (3, 2), (2, 4)]
    for (kb, vb), (ax, (ka, va)), g in itertools.product(pairs, AXES.items(), (16, 32, 64)):
        base = {"key_bits": kb, "value_bits": vb, "key_axis": ka, "value_axis": va, "group_size": g}
        out.append((f"int_K{kb}V{vb}_{ax}_G{g}", base))
        if ka == "token" and kb <= 4:
            out.append((f"int_K{kb}V{vb}_{ax}_G{g}_hadK", {**base, "key_transform": "hadamard"}))
    for b, (ax, (ka, va)) in itertools.product((2, 3), list(AXES.items())[:2]):
        base = {"key_bits": b, "value_bits": b, "key_axis": ka, "value_axis": va}
        out.append((f"int{b}_{ax}_qjlK", {**base, "key_residual": "qjl:64"}))
        out.append((f"int{b}_{ax}_sparse1", {**base, "residual": "sparse:0.01"}))
        out.append((f"int{b}_{ax}_lowrank1", {**base, "residual": "lowrank:1"}))
        out.append((f"int{b}_{ax}_out1", {**base, "key_outliers": 0.01, "value_outliers": 0.01}))
    for b, g in itertools.product((2, 3, 4), (32, 64)):
        out.append((f"lut{b}_KC_VT_G{g}", {"format": "lut", "bits": b, "group_size": g}))
    for b in (2, 3, 4):
        out.append((f"turbo{b}_G64_rhad", {"format": "turbo", "bits": b, "key_axis": "token", "group_size": 64,
                                             "transform": "rhadamard"}))  # fmt: skip
    for fmt, ax in itertools.product(("fp8_e4m3", "fp8_e5m2"), ("KC_VT", "KT_VT")):
        ka, va = AXES[ax]
        out.append((f"{fmt}_{ax}", {"format": fmt, "key_axis": ka, "value_axis": va}))
    return out


def policies() -> list[tuple[str, dict]]:
    out = []
    for name, b in itertools.product(("evict", "mikv", "saliency"), (2, 4)):
        pol = _yaml(CONF / "policy" / f"{name}.yaml")
        out.append((f"{name}_int{b}_KC_VT", {"bits": b, "policy": pol}))
    return out


def _engine_rows(architecture: str | None) -> list[tuple[Any, dict]]:
    """The engine table's rows that run on a model of `architecture` (None: every row), each with the knobs of its
    cache (its preset's, then its own on top)."""
    from kvq_lab.report.engines import ROWS

    by_name = dict(presets())
    return [
        (row, {**(by_name.get(row.quant, {}) if row.quant else {}), **row.knobs})
        for row in ROWS
        if row.runs_on(architecture)
    ]


def engines(architecture: str | None = None) -> list[tuple[str, dict]]:
    """The engine table's caches that run on a model of `architecture` (None: every row's), each named by its row."""
    return [(row.candidate_name(), knobs) for row, knobs in _engine_rows(architecture)]


def searches(budgets: list[float]) -> list[tuple[str, dict]]:
    s = _yaml(CONF / "precision" / "search.yaml")
    return [(f"search_KC_VT_B{b:g}", {"bits": 2, "precision": {**s, "budget": b}}) for b in budgets]


def shape_of(facts, dtype: str = "float32") -> Shape | None:
    """The byte count's shape from the model's files (`ModelFacts`); None for a hub id (nothing local to read)."""
    if facts is None:
        return None
    import torch

    return Shape(facts.layers, facts.kv_heads, facts.head_dim, facts.hidden, getattr(torch, dtype))


def stored_bits(cache, shape: Shape | None, tokens: int) -> float:
    """`cache/bits_total` of `cache` on `shape` at `tokens` tokens, counted as a run reports it (its fitted per-layer
    key thresholds, 16 bits per channel and head, counted before the fit exists)."""
    from kvq_lab.cache import QuantizedKVCache

    bits = QuantizedKVCache.stored_bits(cache, tokens, shape)["cache/bits_total"]
    if cache.key_outliers and cache.key_outlier_thresholds is None:
        bits += 16 / tokens / 2  # per layer H*D fp16 thresholds over H*N*D keys; the mean of keys and values
    return bits


def _search_budget(cache, budget: float, shape: Shape, precision: dict, tokens: int) -> float:
    """The search's own budget (packed bytes at precision.tokens) for a cache storing at most `budget` bits here."""
    from kvq_lab.fit.precision import check_budget, shape_costs

    b = min(precision["choices"])
    costs = shape_costs((shape.layers, shape.heads, shape.head_dim), shape.dtype, cache, [b], precision["tokens"])
    low = replace(cache, key=replace(cache.key, bits=b), value=replace(cache.value, bits=b))
    offset = costs.bits([b] * costs.units, [b] * costs.units) - stored_bits(low, shape, tokens)
    raised = round(budget + max(0.0, offset), 4)
    check_budget(costs, raised, [b])  # a budget even the cheapest assignment exceeds: no such candidate
    return raised


def identity(cache, c: dict) -> str:
    """What makes two candidates one cache: the cache config and the per-layer precision settings."""
    prec = c.get("precision") or {}
    return json.dumps([asdict(cache), prec if prec.get("name") != "uniform" else None], sort_keys=True, default=str)


def engine_settings(base: dict[str, Any], architecture: str | None = None) -> dict[str, list[str]]:
    """cache identity -> `engine: setting (match; backing test or the difference)` of every engine-table row that
    runs on a model of `architecture` (None, not known: every row, saying which models it is for)."""
    from kvq_lab.report.engines import FOR_MODELS

    out: dict[str, list[str]] = {}
    for row, knobs in _engine_rows(architecture):
        c = apply(base, knobs)
        try:
            key = identity(cache_config(c), c)
        except ConfigError:
            continue
        why = row.test if row.match == "same arithmetic" else row.difference
        only = "" if row.models == "any" or architecture else f", {FOR_MODELS[row.models]}"
        out.setdefault(key, []).append(f"{row.engine}: `{row.setting}` ({row.match}{only}; {why})")
    return out


def packed(base: dict[str, Any], overrides: dict[str, Any]) -> str | None:
    """kvq_lab's packed cache storing this cache for real, or None where packed mode cannot hold it."""
    from kvq_lab.report.engines import packed_setting

    try:
        cache_config(apply(base, {**overrides, "mode": "packed"}))
    except ConfigError:
        return None
    return f"kvq_lab packed cache: `{packed_setting(overrides)}`"


def enumerate_candidates(
    base: dict[str, Any], facts, budgets: list[float], sources: list[str], tokens: int, validate=None
) -> tuple[list[Candidate], list[str]]:
    """Every candidate of `sources`, counted, deduplicated and kept where it fits a budget; -> (candidates, notes:
    one line per candidate dropped as invalid or over every budget). `base`: the run's config as plain values;
    `validate(config dict)`: the run's own check (raises ConfigError), else the cache's knobs alone are checked."""
    shape = shape_of(facts, (base.get("model") or {}).get("dtype") or "float32")
    architecture = facts.architecture if facts is not None else None
    made = {"preset": presets, "grid": grid, "policy": policies, "engine": lambda: engines(architecture)}
    raw = [(src, n, o) for src in sources for n, o in (searches(budgets) if src == "search" else made[src]())]
    out: dict[str, Candidate] = {}
    notes: list[str] = []
    engine = engine_settings(base, architecture)
    names: dict[str, str] = {}  # candidate name -> its cache's identity: one name never stands for two caches
    for src, name, overrides in raw:
        c = apply(base, overrides)
        try:
            cache = validate(c) if validate is not None else cache_config(c)
            if src == "search":
                if shape is None:
                    raise ConfigError("precision=search needs the model's shape from its files (a hub id has none)")
                budget = c["precision"]["budget"]
                c["precision"]["budget"] = overrides["precision"]["budget"] = _search_budget(
                    cache, budget, shape, c["precision"], tokens
                )
                bits, exact = budget, False
            else:
                bits, exact = stored_bits(cache, shape, tokens), True
        except ConfigError as e:
            notes.append(f"{name} ({src}): not valid here: {e}")
            continue
        key = identity(cache, c)
        if key in out:
            out[key].same_as.append(name)
            continue
        if names.setdefault(name, key) != key:
            name = f"{name}@{src}"  # another source's cache took the name first
            names[name] = key
        fits = [b for b in budgets if bits <= b + 1e-9]
        cand = Candidate(name, src, overrides, round(bits, 6), exact, cache.label(), fits)
        cand.engines = list(engine.get(key, []))
        if fits and packed(base, overrides):
            cand.engines.append(packed(base, overrides))
        if not fits:
            notes.append(f"{name} ({src}): {bits:.3f} bits per element, over every budget")
        out[key] = cand
    return [c for c in out.values() if c.budgets], notes


def cheapest(cands: list[Candidate]) -> float | None:
    return min((c.bits for c in cands), default=None)


def cap(cands: list[Candidate], n: int | None, sources: list[str]) -> list[Candidate]:
    """At most n candidates: round-robin over the sources (in `sources` order), within each the most bits first
    (those closest to their budget), so a small n still spans the sources; searched candidates only once the others
    are all in (each search first measures every layer's sensitivity: ~15 min on SmolLM2 and 2 cores, then cached)."""
    if n is None or n >= len(cands):
        return cands
    picked: list[Candidate] = []
    for group in ([s for s in sources if s != "search"], ["search"]):  # a search costs minutes of sensitivity: last
        queues = [sorted((c for c in cands if c.source == s), key=lambda c: (-c.bits, c.name)) for s in group]
        while len(picked) < n and any(queues):
            for q in queues:
                if q and len(picked) < n:
                    picked.append(q.pop(0))
    return picked
