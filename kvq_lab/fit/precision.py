"""Layer-wise mixed precision (KVTuner-like), the measurement side: per-layer (key bits, value bits) searched on the
loaded model under an average-bits budget. The settings, their checks and the per-layer bits file (model-free, what
`kvq_lab.run.config` reads) are `kvq_lab.fit.precision_settings`.

`precision=search`: after the model loads, (1) measure each layer's sensitivity, (2) count each choice's bytes,
(3) pick the per-layer bits with the least total sensitivity whose bytes fit the budget, (4) write them to
`<run folder>/precision.yaml`, which `precision=file precision.path=<that file>` reruns exactly (the same per-layer
specs, so the same cache).

Sensitivity signal: the KL divergence of the next-token distribution, KL(p_fp || p_q) averaged over the positions
of `precision.tokens` tokens of text (`precision.source`, GSM8K train by default: text no task scores), with ONE
layer's keys (or values) fake-quantized at b bits (simulated mode, every token quantized, the run's axes, group
size, format, transforms and sinks) and everything else exact. Why KL and not the probes' per-layer attention-output
error: the probes measure each layer in its own units (a relative error at layer 0 and at layer 29 do not cost the
same), and ignore how the error propagates through the later layers; the logit KL measures the change of the
next-token distribution itself, what decode perplexity (exp of the mean NLL) and generation read, through the whole
path. The cost is 2 L |choices| forward passes of the text, each from the quantized layer on (the layers before it
are exact, their output is kept from one exact run); measured once per model, quantizer settings and text and kept
on disk, so a sweep over budgets measures once. The search assumes the per-(layer, tensor) KLs add up, which holds for
small perturbations; it is tested end to end by the mixed-precision experiment, not assumed to be exact.

Bytes, "everything counted as `nbytes()` counts": one packed-cache layer with the run's residual window, sinks,
transforms and the model's (heads, head dim, dtype) is filled with `precision.tokens` tokens per choice, and its
key and value streams' `nbytes()` (codes, fp16 parameters, exact window) plus its sinks are what a choice costs.
Simulated-mode runs store nothing; they are budgeted as the packed cache with the same quantizers (R = 0) would
store them. The budget is in bits per cached K/V element: stored bits / (2 L H_kv T D).

Search: an exact multiple-choice knapsack (dynamic programming over total bytes, Pareto-pruned: costs are linear
in bits, so the frontier holds a few hundred entries), one item per (layer, tensor), one option per choice.

`precision.granularity=head`: the same with one item per (layer, KV head, tensor): the sensitivity of one head's
keys (values) at b bits, all else exact (2 L H_kv |choices| measurements), and the bytes of a one-head layer (a
layer's streams, sinks and window are per head, so H_kv of them are the layer's, checked on every measurement). The
searched layer stores each width's heads as one layer of their own (`kvq_lab.cache.heads`), counted by `nbytes()` as
the search counts it; formats with a table per tensor (lut, nvfp4) are refused before load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvq_lab.cache.config import CacheConfig
from kvq_lab.common import integrity
from kvq_lab.common.errors import ConfigError
from kvq_lab.fit.precision_settings import check_layers, per_layer, read_file, settings, write_file

log = logging.getLogger("kvq_lab")


# -- bytes -----------------------------------------------------------------------------------------------------------
@dataclass
class Costs:
    """Bytes of one unit (a layer, or at head granularity one KV head of a layer) at T tokens: `key[b]`, `value[b]`
    for each choice b (that tensor's stream as stored), and `fixed` (sinks and other state, the same for every
    choice); `shared`: bytes a cache holds once for all its layers (rope=pre's position ids). `elements`: 2 H T D, K
    and V, H the unit's heads. `heads`: units per layer (1, or H_kv at head granularity)."""

    key: dict[int, int]
    value: dict[int, int]
    fixed: int
    elements: int
    layers: int
    shared: int = 0
    heads: int = 1

    @property
    def units(self) -> int:
        return self.layers * self.heads

    def bits(self, key_bits: list, value_bits: list) -> float:
        """Stored bits per K/V element of an assignment (per layer, or per layer a list per head), as `nbytes()`
        counts them."""
        kb, vb = flat(key_bits), flat(value_bits)
        streams = sum(self.key[k] + self.value[v] for k, v in zip(kb, vb, strict=True))
        total = self.units * self.fixed + self.shared + streams
        return 8 * total / (self.units * self.elements)


def flat(bits: list) -> list[int]:
    """Per-layer bits, or per-layer lists of per-head bits, as one list of units."""
    return [b for x in bits for b in (x if isinstance(x, list) else [x])]


def measure_costs(model, cache: CacheConfig, choices: list[int], tokens: int, granularity: str = "layer") -> Costs:
    """`shape_costs` with the loaded model's shape, dtype, device and rotary module."""
    text_cfg = model.config.get_text_config(decoder=True)
    D = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
    w = next(model.parameters())
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    shape = (text_cfg.num_hidden_layers, text_cfg.num_key_value_heads, D)
    return shape_costs(shape, w.dtype, cache, choices, tokens, granularity, w.device, rotary)


class _AnyRope:
    """A rotary module for counting bytes before the model loads (`rope=pre`): standard RoPE cos/sin [B, T, D]; the
    bytes stored do not depend on the frequencies."""

    def __init__(self, head_dim: int):
        self.D = head_dim

    def __call__(self, x, position_ids):
        import torch

        inv = 10000.0 ** (-torch.arange(0, self.D, 2, dtype=torch.float32, device=x.device) / self.D)
        ang = position_ids.float()[..., None] * inv
        emb = torch.cat([ang, ang], dim=-1)
        return emb.cos(), emb.sin()


def shape_costs(
    shape: tuple[int, int, int],
    dtype,
    cache: CacheConfig,
    choices: list[int],
    tokens: int,
    granularity: str = "layer",
    device="cpu",
    rotary=None,
) -> Costs:
    """Fill one packed layer of a model of `shape` (decoder layers, KV heads, head dim) and `dtype` (a torch dtype or
    its name) with `tokens` random tokens per choice and read its streams' bytes (module docstring); granularity=head:
    a one-head layer's, checked to be 1/H_kv of the layer's. Needs no model: the check before the load reads the
    same bytes from the model's files (`check_budget`); `rotary` (rope=pre): the model's rotary module, else one
    that counts the same."""
    import torch

    from kvq_lab.cache import QuantizedKVCache

    L, H, D = shape
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    R = cache.residual_length  # 0 in a mode without a window: budgeted as the packed cache without one
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, H, tokens, D, generator=gen).to(device, dtype)
    v = torch.randn(1, H, tokens, D, generator=gen).to(device, dtype)
    if cache.rope == "pre" and rotary is None:
        rotary = _AnyRope(D)

    def one(heads: int) -> tuple[dict, dict, int, int]:
        key, value, fixed = {}, {}, None
        for b in choices:
            c = replace(cache, mode="packed", prefill=None, residual_length=R, backend="torch", layers=())
            c = replace(c, key=replace(c.key, bits=b), value=replace(c.value, bits=b))
            c.check_head_dim(D)
            layer = QuantizedKVCache(c, 1, rotary_emb=rotary).layers[0]
            layer.update(k[:, :heads], v[:, :heads])
            key[b], value[b] = layer.k_stream.nbytes(), layer.v_stream.nbytes()
            shared = 0 if layer._log is None else layer._log.nbytes_for(layer)  # counted by this layer, held once
            f = layer.nbytes()[0] - key[b] - value[b] - shared
            if fixed is not None and f != fixed:
                raise RuntimeError(f"the packed layer's fixed bytes changed with the bits ({fixed} vs {f})")
            fixed = f
        return key, value, fixed, shared

    key, value, fixed, shared = one(H)
    if granularity == "layer":
        return Costs(key, value, fixed, 2 * H * tokens * D, L, shared)
    hk, hv, hf, _ = one(1)
    if (
        [H * hk[b] for b in choices] != [key[b] for b in choices]
        or H * hf != fixed
        or [H * hv[b] for b in choices] != [value[b] for b in choices]
    ):
        raise RuntimeError(
            "a packed layer's bytes are not H_kv times a one-head layer's: per-head costs would be wrong"
        )
    return Costs(hk, hv, hf, 2 * tokens * D, L, shared, heads=H)


# -- sensitivity -----------------------------------------------------------------------------------------------------
def sensitivity_text(s: dict[str, Any], data_dir: Path | None) -> str:
    """The sensitivity text of `precision.source`: calibration's reader (gsm8k_train: the first 600 GSM8K train
    rows as Question/Answer pairs, from data_dir else the hub; file: `precision.path`), one reader for both."""
    from kvq_lab.fit.calibration_settings import calibration_text

    return calibration_text({"source": s["source"], "path": s["path"]}, data_dir)[0]


class _Tail:
    """Logits of ids [1, T] with decoder layers from `start` on run through a cache, the layers before `start` taken
    from the exact run: in every measurement they are exact, so their output is the exact run's (a measurement at
    layer l then costs L - l layers, about half on average). Used where the model is Llama-shaped (`model.model
    .layers`, a forward taking `inputs_embeds` as is) and checked once against a whole forward; otherwise whole
    forwards."""

    def __init__(self, model, ids):
        import torch

        self.model, self.ids = model, ids
        inner = getattr(model, "model", None)
        self.layers = getattr(inner, "layers", None)
        self.inputs: list = []
        hooks = []
        if isinstance(self.layers, torch.nn.ModuleList):
            for layer in self.layers:
                hooks.append(layer.register_forward_pre_hook(self._keep, with_kwargs=True))
        try:
            self.ref = model(ids).logits[0].float()  # [T, V]
        finally:
            for h in hooks:
                h.remove()
        self.ok = len(self.inputs) == len(self.layers or ()) and all(x is not None for x in self.inputs)
        if self.ok:
            mid = self.logits(len(self.inputs) // 2, None)
            self.ok = bool(torch.allclose(mid, self.ref, rtol=1e-4, atol=1e-4 * float(self.ref.abs().max())))
            if not self.ok:
                log.info("precision: the model's forward from a middle layer differs; whole forwards instead")

    def _keep(self, module, args, kwargs) -> None:
        """Forward pre-hook of each decoder layer in the exact run: keep its input hidden states [1, T, d]."""
        self.inputs.append(args[0] if args else kwargs.get("hidden_states"))

    def logits(self, start: int, cache):
        """[T, V] fp32: layers from `start` on through `cache` (None: exact)."""
        import torch

        from kvq_lab.models.loading import cache_kwarg

        kw = {} if cache is None else {cache_kwarg(): cache}
        if not self.ok:
            return self.model(self.ids, **kw).logits[0].float()
        inner = self.model.model
        inner.layers = torch.nn.ModuleList(list(self.layers)[start:])  # attention modules keep their layer_idx
        try:
            return self.model(inputs_embeds=self.inputs[start], **kw).logits[0].float()
        finally:
            inner.layers = self.layers


def sensitivities(model, ids, cache: CacheConfig, choices: list[int], granularity: str = "layer"):
    """{"key"|"value": {b: [KL per layer]}} (granularity=head: {b: [[KL per KV head] per layer]}): mean KL(p_fp ||
    p_q) over the positions of ids [1, T] with one layer's (one head's) keys or values fake-quantized at b bits and
    everything else exact (module docstring)."""
    import torch
    from tqdm import tqdm

    from kvq_lab.cache import QuantizedKVCache

    text_cfg = model.config.get_text_config(decoder=True)
    L, H = text_cfg.num_hidden_layers, text_cfg.num_key_value_heads
    units = H if granularity == "head" else 1
    base = replace(cache, mode="simulated", prefill=None, residual_length=0, layers=())
    exact = replace(base, key=replace(base.key, bits=16), value=replace(base.value, bits=16))

    def quantized(tensor: str, b: int, h: int | None) -> CacheConfig:
        """One layer's config: its keys (values) at b bits, on head h only where h is given."""
        if h is None:
            return replace(exact, **{tensor: replace(getattr(base, tensor), bits=b)})
        pair = (b, 16) if tensor == "key" else (16, b)
        return replace(exact, head_bits=tuple(pair if j == h else (16, 16) for j in range(H)))

    measured = [b for b in choices if b < 16]
    bar = tqdm(total=2 * len(measured) * L * units, desc=f"precision: sensitivity per {granularity}", leave=False)
    with torch.inference_mode(), bar:
        tail = _Tail(model, ids)
        ref = torch.log_softmax(tail.ref, -1)  # [T, V]
        p = ref.exp()
        out: dict[str, dict[int, list]] = {"key": {}, "value": {}}
        for tensor in ("key", "value"):
            for b in choices:
                kls = []
                for i in range(L):
                    row = []
                    for h in range(units) if b < 16 else ():
                        one = quantized(tensor, b, h if granularity == "head" else None)
                        cfg = replace(exact, layers=tuple(one if j == i else exact for j in range(L)))
                        logp = torch.log_softmax(tail.logits(i, QuantizedKVCache.for_model(model, cfg)), -1)
                        row.append(float((p * (ref - logp)).sum(-1).mean()))
                        bar.update()
                    row = row or [0.0] * units
                    kls.append(row if granularity == "head" else row[0])
                out[tensor][b] = kls
                shown = " ".join(f"{x:.3g}" for x in flat(kls))
                log.info("precision: %s %d-bit KL per %s %s", tensor, b, granularity, shown)
    return out


def sensitivity_dir() -> Path:
    return Path(os.environ.get("KVQ_PRECISION_CACHE", Path.home() / ".cache" / "kvq_lab" / "precision"))


def cached_sensitivities(
    model, ids, cache: CacheConfig, choices: list[int], model_id: Any, text: str, granularity: str = "layer"
):
    """`sensitivities`, measured once per (model, quantizer settings, choices, text, code version) and kept in
        $KVQ_PRECISION_CACHE (default ~/.cache/kvq_lab/precision), with its digest beside it, verified on every read:
    every budget of a sweep reads the same measurement.
        -> (sensitivities, path of the cached file)."""
    from kvq_lab.records.provenance import code_version

    # what the measurement reads: the quantizers' settings but not their bits, the run's mode, window or backend
    base = replace(cache, mode="simulated", prefill=None, residual_length=0, backend="auto", layers=())
    base = replace(base, key=replace(base.key, bits=2), value=replace(base.value, bits=2))
    what = {
        "model": model_id,
        "cache": asdict(base),
        "choices": choices,
        "tokens": int(ids.shape[1]),
        "text": hashlib.sha256(text.encode()).hexdigest(),
        "code": code_version(),
    }
    if granularity != "layer":  # left out at its default: measurements kept before it existed stay valid
        what["granularity"] = granularity
    key = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = sensitivity_dir() / f"{key}.json"
    if path.is_file():
        try:
            raw = json.loads(integrity.read_verified(path))
            log.info("precision: sensitivities from %s (digest verified)", path)
            return {t: {int(b): v for b, v in d.items()} for t, d in raw.items()}, path
        except integrity.Corrupt as e:
            integrity.note_rebuild(e, "measuring again")
            integrity.remove(path)
    sens = sensitivities(model, ids, cache, choices, granularity)
    integrity.write_verified(path, json.dumps(sens).encode())
    return sens, path


# -- search ----------------------------------------------------------------------------------------------------------
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
    before the load from the model's files (`kvq_lab.fit.checks`), and before any sensitivity is measured. `met`
    False: the search found no assignment (a budget equal to the cheapest, lost to rounding)."""
    U, b = costs.units, min(choices)
    low = costs.bits([b] * U, [b] * U)
    if budget < low or not met:
        unit = "head" if costs.heads > 1 else "layer"
        raise ConfigError(
            f"precision.budget={budget:g} cannot be met: every {unit} at {b} bits stores {low:.4g} bits per element "
            "with exact windows and sinks counted (per-channel groups keep up to G tokens exact until full); raise "
            f"the budget to >= {math.ceil(low * 1000) / 1000:g} or lower residual_length"
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
        "sensitivity_cache": str(sens_path),
        "bytes": {"key": costs.key, "value": costs.value, f"fixed_per_{unit}": costs.fixed, "shared": costs.shared},
    }
    write_file(run_dir / "precision.yaml", key_bits, value_bits, meta)
    log.info("precision: key bits %s, value bits %s (%.3f bits/element)", key_bits, value_bits, meta["stored_bits"])
    return per_layer(cache, key_bits, value_bits)


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
