"""Per-layer key/value bits, the config side (model-free): the `precision.*` settings, their checks before anything
loads, and the per-layer bits file.

`precision=uniform` (default): every layer uses `key_bits`/`value_bits`. `precision=search`: the runner searches
per-layer bits (`precision.granularity=head`: per KV head of each layer) on the loaded model
(`kvq_lab.fit.precision`, the measurement side) and writes them with `write_file` to `<run folder>/precision.yaml`;
`precision=file precision.path=<that file>` reruns them exactly (`apply_file`: the same per-layer specs,
`CacheConfig.layers`, so the same cache; `hash_part`: the run hash follows the bits, not the file's location).
`kvq_lab.run.config` reads this module only; nothing here loads a model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvq_lab.cache.config import CacheConfig
from kvq_lab.common.errors import ConfigError
from kvq_lab.quant.spec import BITS, DEFAULT_FORMAT, QuantConfigError, QuantSpec

MODES = ("uniform", "search", "file")
DEFAULTS = {"name": "uniform", "budget": None, "choices": [2, 3, 4, 8], "tokens": 512, "source": "gsm8k_train"}
DEFAULTS["granularity"] = "layer"  # what one choice of bits covers: a layer's keys (values), or one KV head's
GRANULARITIES = ("layer", "head")
KEYS = (*DEFAULTS, "path")
SOURCES = ("gsm8k_train", "file")  # the sensitivity text: read by kvq_lab.fit.calibration_settings.calibration_text
FILE_KIND = "kvq_lab.precision/per_layer_bits/v1"  # kept from before the split: older files still read


# -- settings (model-free, before anything loads) --------------------------------------------------------------------
def settings(given: Mapping | None = None) -> dict[str, Any]:
    """The run's `precision` section over DEFAULTS, validated (one-line ConfigError). Idempotent: a validated dict
    validates to itself."""
    given = dict(given or {})
    unknown = sorted(set(given) - set(KEYS))
    if unknown:
        raise ConfigError(f"precision.{unknown[0]} is not a precision setting; allowed: {', '.join(KEYS)}")
    s = {**DEFAULTS, "path": None, **given}
    if s["name"] not in MODES:
        raise ConfigError(f"precision={s['name']!r}; choose one of: {', '.join(MODES)}")
    if s["name"] == "search":
        ch = s["choices"]
        ch = list(ch) if not isinstance(ch, (str, int)) else None
        if not ch or any(isinstance(b, bool) or b not in BITS for b in ch):
            raise ConfigError(
                f"precision.choices={s['choices']!r} must be a list of bit widths from {', '.join(map(str, BITS))}"
            )
        s["choices"] = sorted(set(ch))
        b = s["budget"]
        if isinstance(b, bool) or not isinstance(b, (int, float)) or b <= 0:
            raise ConfigError(
                f"precision.budget={b!r} must be a number of stored bits per K/V element, e.g. precision.budget=3.5"
            )
        t = s["tokens"]
        if isinstance(t, bool) or not isinstance(t, int) or t < 32:
            raise ConfigError(f"precision.tokens={t!r} must be an integer >= 32")
        if s["source"] not in SOURCES:
            raise ConfigError(f"precision.source={s['source']!r}; choose one of: {', '.join(SOURCES)}")
        if s["granularity"] not in GRANULARITIES:
            raise ConfigError(f"precision.granularity={s['granularity']!r}; choose one of: {', '.join(GRANULARITIES)}")
        if s["source"] == "file" and not (isinstance(s["path"], str) and Path(s["path"]).expanduser().is_file()):
            raise ConfigError(f"precision.source=file needs precision.path=<a UTF-8 text file> (got {s['path']!r})")
    if s["name"] == "file" and not (isinstance(s["path"], str) and Path(s["path"]).expanduser().is_file()):
        raise ConfigError(
            f"precision=file needs precision.path=<a precision.yaml written by precision=search> (got {s['path']!r})"
        )
    return s


def lower_bound_bits(cache: CacheConfig, choices: list[int]) -> float:
    """Stored bits per element of the cheapest assignment (every layer at the smallest choice), codes and per-group
    parameters only: windows and sinks can only add to it. Model-free."""
    b = min(choices)

    def one(spec: QuantSpec) -> float:
        if b >= 16:
            return 16.0
        if spec.format == DEFAULT_FORMAT and spec.codebook is None:
            return b + 32 / spec.group_size  # int: fp16 scale and zero per group
        from kvq_lab.quant.formats import bits_per_element
        from kvq_lab.quant.reference import code_format

        return bits_per_element(code_format(replace(spec, bits=b)), spec.group_size, spec.axis)

    return (one(cache.key) + one(cache.value)) / 2


def check(precision: Mapping | None, cache: CacheConfig) -> None:
    """Before any model loads: the settings, a budget the cheapest assignment can meet, a mode that has per-layer
    key and value specs (one-line ConfigError)."""
    s = settings(precision)
    if s["name"] == "uniform":
        return
    if not cache.caps.per_layer_precision:
        raise ConfigError(
            f"precision={s['name']} sets per-layer key/value bits; mode={cache.mode} stores X: use uniform"
        )
    if cache.skip_layers:
        raise ConfigError(
            f"precision={s['name']} sets every layer's bits; skip_layers would override some of them: unset one"
        )
    if cache.splits_tokens:  # a tier's bits are the policy's; the search prices and stores the mode's own layers
        raise ConfigError(
            f"precision={s['name']} with policy={cache.policy}: the policy's tiers give tokens their own bits, which "
            "per-layer bits neither price nor store; use precision=uniform, or policy=kivi"
        )
    from kvq_lab.fit.calibration_settings import needs_calibration, what_is_fitted

    if needs_calibration(cache):  # calibration fits one config per layer at the run's bits (nuq codebooks...)
        raise ConfigError(f"precision={s['name']} with {what_is_fitted(cache)} (fitted per layer) is not supported")
    if s["name"] == "file":
        read_file(s["path"])
        return
    try:
        for b in s["choices"]:  # every choice must be a width the run's formats take (fp8: 8 only)
            for spec in (cache.key, cache.value):
                CacheConfig(key=replace(spec, bits=b), value=replace(spec, bits=b))
    except QuantConfigError as e:
        raise ConfigError(f"precision.choices: {e}") from None
    low = lower_bound_bits(cache, s["choices"])
    if s["granularity"] == "head":
        _check_per_head_bytes(cache)
    if s["budget"] < low:
        raise ConfigError(
            f"precision.budget={s['budget']:g} is below the smallest choice: every layer at {min(s['choices'])} bits "
            f"stores {low:g} bits per element (codes + per-group parameters, before windows and sinks); raise the "
            f"budget to >= {low:g} or add a smaller choice"
        )


def _check_per_head_bytes(cache: CacheConfig) -> None:
    """granularity=head prices each head's bits alone; a format that stores a table per tensor (lut/nuq codebooks,
    nvfp4's tensor scale) stores one per layer and width, which no per-head price counts exactly."""
    from kvq_lab.quant.reference import code_format

    for tensor in ("key", "value"):
        spec = getattr(cache, tensor)
        if not spec.is_identity and code_format(spec).table_bytes:
            raise ConfigError(
                f"precision.granularity=head with {tensor}_format={spec.format}: it stores a table per layer and "
                "width, which per-head byte counts cannot price exactly; use precision.granularity=layer"
            )


def check_layers(precision: Mapping | None, cache: CacheConfig, layers: int, kv_heads: int | None = None) -> None:
    """precision=file against the model's layer count (and KV heads, for per-head bits), read from its files before
    it loads (one-line ConfigError)."""
    s = settings(precision)
    if s["name"] != "file":
        return
    if len(cache.layers) != layers:
        raise ConfigError(
            f"precision.path={s['path']} gives {len(cache.layers)} layers but the model has {layers}; search again "
            "for this model (precision=search)"
        )
    if kv_heads:
        try:
            cache.check_heads(kv_heads)
        except QuantConfigError as e:
            raise ConfigError(f"precision.path={s['path']}: {e}") from None


def check_text_length(precision: Mapping | None, tok, data_dir: Path | None) -> None:
    """precision=search: the sensitivity text holds `precision.tokens` tokens of the model's tokenizer (one-line
    ConfigError; validation loads the tokenizer alone)."""
    s = settings(precision)
    if s["name"] != "search":
        return
    from kvq_lab.fit.calibration_settings import calibration_text

    text = calibration_text({"source": s["source"], "path": s["path"]}, data_dir)[0]
    n = len(tok(text, add_special_tokens=False).input_ids)
    if n < s["tokens"]:
        raise ConfigError(f"precision.source={s['source']} has {n} tokens; lower precision.tokens={s['tokens']}")


# -- the precision file ----------------------------------------------------------------------------------------------
def read_file(path: str) -> dict[str, Any]:
    """A precision.yaml (JSON is YAML) written by `write_file`: {"key_bits": [L], "value_bits": [L], ...}, or per
    head {"key_bits": [L][H_kv], "value_bits": [L][H_kv], ...}."""
    import yaml

    try:
        d = yaml.safe_load(Path(path).expanduser().read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"precision.path={path!r} cannot be read: {type(e).__name__}") from None
    ok = isinstance(d, dict) and d.get("kind") == FILE_KIND
    kb, vb = (d.get("key_bits"), d.get("value_bits")) if ok else (None, None)
    if not ok or not isinstance(kb, list) or not isinstance(vb, list) or len(kb) != len(vb) or not kb:
        raise ConfigError(f"precision.path={path!r} is not a precision file (kind {FILE_KIND}) written by search")
    nested = [isinstance(b, list) for b in kb + vb]
    if any(nested) and not (all(nested) and len({len(b) for b in kb + vb}) == 1 and kb[0]):
        raise ConfigError(f"precision.path={path!r}: per-head bits must give every layer the same number of heads")
    flat = [x for b in kb + vb for x in b] if any(nested) else kb + vb
    if any(isinstance(b, bool) or b not in BITS for b in flat):
        raise ConfigError(f"precision.path={path!r}: bits must be among {', '.join(map(str, BITS))}")
    return d


def write_file(path: Path, key_bits: list, value_bits: list, meta: dict[str, Any]) -> None:
    """Write the per-layer bits (per layer, or per layer a list per KV head) and how they were found;
    `precision=file precision.path=<path>` reruns them."""
    import yaml

    what = "per-head" if key_bits and isinstance(key_bits[0], list) else "per-layer"
    header = f"# {what} (key bits, value bits): rerun with precision=file precision.path={path}\n"
    body = {"kind": FILE_KIND, "key_bits": key_bits, "value_bits": value_bits, **meta}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(header + yaml.safe_dump(json.loads(json.dumps(body)), sort_keys=False, width=200))
    tmp.replace(path)


def per_layer(cache: CacheConfig, key_bits: list, value_bits: list) -> CacheConfig:
    """The cache with layer i's key and value quantizers at key_bits[i], value_bits[i] (`CacheConfig.layers`; every
    other setting as the run's). Per-head bits (key_bits[i] a list per KV head): layer i's `head_bits`, or, where
    its heads all have one width, a layer at that width (the mode's own layer, fused decode kernels included)."""
    if cache.layers:
        raise ConfigError("per-layer precision on a cache that calibration already fitted per layer is not supported")

    def layer(kb, vb) -> CacheConfig:
        if isinstance(kb, list):
            pairs = tuple(zip(kb, vb, strict=True))
            if len(set(pairs)) > 1:
                return replace(cache, head_bits=pairs)
            kb, vb = pairs[0]
        return replace(cache, key=replace(cache.key, bits=kb), value=replace(cache.value, bits=vb))

    return replace(cache, layers=tuple(layer(kb, vb) for kb, vb in zip(key_bits, value_bits, strict=True)))


def apply_file(precision: Mapping | None, cache: CacheConfig) -> CacheConfig:
    """precision=file: the run's cache with the file's per-layer bits (model-free: the layer count is checked
    against the model once it loads, `resolve`)."""
    s = settings(precision)
    if s["name"] != "file":
        return cache
    d = read_file(s["path"])
    try:
        return per_layer(cache, d["key_bits"], d["value_bits"])
    except QuantConfigError as e:
        raise ConfigError(f"precision.path={s['path']}: {e}") from None


def hash_part(precision: Mapping | None) -> dict[str, Any] | None:
    """What of `precision.*` determines a run: None for uniform; search: its settings (and the text file's
    content); file: the per-layer bits it holds, not where the file lies."""
    s = settings(precision)
    if s["name"] == "uniform":
        return None
    if s["name"] == "file":
        d = read_file(s["path"])
        return {"name": "file", "key_bits": d["key_bits"], "value_bits": d["value_bits"]}
    part = {k: s[k] for k in ("name", "budget", "choices", "tokens", "source")}
    if s["granularity"] != "layer":  # left out at its default: hashes from before it existed stay
        part["granularity"] = s["granularity"]
    if s["source"] == "file":
        from kvq_lab.tasks.text import read_text_file

        part["text_sha256"] = read_text_file(s["path"])[1]
    return part
