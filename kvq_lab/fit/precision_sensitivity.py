"""Layer-wise mixed precision, the sensitivities: how much the next-token distribution moves when one layer's (or
one KV head's) keys or values are quantized at b bits, measured on the loaded model and kept on disk.

Sensitivity signal: the KL divergence of the next-token distribution, KL(p_fp || p_q) averaged over the positions
of `precision.tokens` tokens of text (`precision.source`, GSM8K train by default: text no task scores), with ONE
layer's keys (or values) fake-quantized at b bits (simulated mode, every token quantized, the run's axes, group
size, format, transforms and sinks) and everything else exact. Why KL and not the probes' per-layer attention-output
error: the probes measure each layer in its own units (a relative error at layer 0 and at layer 29 do not cost the
same), and ignore how the error propagates through the later layers; the logit KL measures the change of the
next-token distribution itself, what decode perplexity (exp of the mean NLL) and generation read, through the whole
path. The cost is 2 L |choices| forward passes of the text, each from the quantized layer on (the layers before it
are exact, their output is kept from one exact run); measured once per model, quantizer settings and text and kept
on disk, so a sweep over budgets measures once. The search (`kvq_lab.fit.precision`) assumes the per-(layer,
tensor) KLs add up, which holds for small perturbations; it is tested end to end by the mixed-precision experiment,
not assumed to be exact.

`precision.granularity=head`: the sensitivity of one head's keys (values) at b bits, all else exact
(2 L H_kv |choices| measurements).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from kvq_lab.cache.config import CacheConfig
from kvq_lab.common import integrity
from kvq_lab.common.spellings import as_hashed
from kvq_lab.fit.precision_costs import flat

log = logging.getLogger("kvq_lab")


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
    base = replace(cache, mode="simulated", prefill=None, exact_window=0, layers=())
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
    base = replace(cache, mode="simulated", prefill=None, exact_window=0, backend="auto", layers=())
    base = replace(base, key=replace(base.key, bits=2), value=replace(base.value, bits=2))
    what = {
        "model": model_id,
        "cache": as_hashed(asdict(base)),  # renamed fields under their old names: kept files stay
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
