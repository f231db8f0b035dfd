"""The cache knobs (`key_axis=channel bits=2 ...`) and the `CacheConfig` they build: the one definition of each knob.

`CacheKnobs` holds every knob with its default and meaning. run.py's schema extends it (`kvq_lab.run.config`), lm-eval's
`kvq` model takes the same names as model args, and the README's knob table and conf/config.yaml are checked against
it (tests/run/test_schema.py). `cache_config(knobs)` validates any mapping of knobs (a run config, model args) and
builds the cache, with one-line `ConfigError`s that name the knob as the user spelled it. Torch-free: a format other
than int imports the format registry, nothing else.

A new knob that is one `CacheConfig` field is a field here and the same field (with its check) on `CacheConfig`;
`cache_config` passes it through, and the README's table is regenerated (README.md, "Adding ... / cache knob").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from kvq_lab.cache.config import SLIDING_WINDOW, CacheConfig
from kvq_lab.common.errors import ConfigError, QuantConfigError
from kvq_lab.quant.spec import AXES, BITS, DEFAULT_BITS, DEFAULT_FORMAT, IDENTITY_BITS, INT_BITS, QuantSpec
from kvq_lab.quant.transforms import check_transforms


def knob(default: Any, doc: str = "", row: str | None = None, factory=None) -> Any:
    """A knob's field: its default, its meaning (`doc`, the README table's third column), and `row`: the knob whose
    table row it shares (`value_axis` shares `key_axis`'s)."""
    meta = {"doc": doc, "row": row}
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


@dataclass
class CacheKnobs:
    """What a cache is, as the user sets it. Types are loose on purpose: validation gives every bad value the same
    one-line message, where OmegaConf's own type errors would span several."""

    key_axis: Any = knob(
        "channel",
        "`token`: a group is G consecutive channels of one token; `channel`: G consecutive tokens of one channel",
    )
    value_axis: Any = knob("token", row="key_axis")
    bits: Any = knob(
        None,
        "1, 2, 3, 4, 5, 8 (5: `q5_0`, `q5_1` only); 16 = no quantization. `bits` sets both; `null`: the format's "
        "width (int 2, lut 2, fp8 8, nuq 3, q8_0 8, q4_0 4, q4_1 4, q5_0 5, q5_1 5, iq4_nl 4, turbo 3, nvfp4 4, "
        "mxfp4 4)",
    )
    key_bits: Any = knob(None, row="bits")
    value_bits: Any = knob(None, row="bits")
    format: Any = knob(
        None,
        "code format: `int` (asymmetric uniform, KIVI's; `null` means int), `fp8_e4m3`, `fp8_e5m2` (8-bit float codes "
        "times an fp16 absmax scale per group, no zero point: 8.5 bits per element at G=32; a width other than 8 is an "
        "error), `lut` (2^b sorted code values under a per-group scale and zero, NormalFloat by default), `nuq` "
        "(KVQuant's non-uniform codes: 1-4 bits, a codebook per layer fitted on calibration text, run as `lut`), "
        "llama.cpp's cache types `q8_0`, `q4_0`, `q4_1`, `q5_0`, `q5_1`, `iq4_nl` (ggml's block arithmetic bit for "
        "bit: `group_size=32` per-token is llama.cpp's layout; presets `quant=llamacpp_<type>[_had]`), `turbo` "
        "(TurboQuant's MSE stage, 1-4 bits: one norm per group, Lloyd-Max levels per coordinate; with `rhadamard` "
        "and `group_size` = the head dim: `quant=turboquant_mse_<b>b`), the FP4 caches `nvfp4` (NVIDIA: E2M1 codes, "
        "an E4M3 scale per group, an fp32 scale per layer and tensor fitted on calibration text: 4.5 bits per element "
        "at G=16) and `mxfp4` (OCP MX, ggml's MXFP4 bit for bit: a power-of-two E8M0 scale per group, 4.25 bits at "
        "G=32; the C kernel cannot read it: `backend=auto` takes the PyTorch path on the CPU), one-byte scales counted "
        "at their width; presets `quant=nvfp4` (per-token groups of 16), `quant=mxfp4` (of 32); another `group_size` "
        "runs the same arithmetic per group. `format` sets both",
    )
    key_format: Any = knob(None, row="format")
    value_format: Any = knob(None, row="format")
    group_size: Any = knob(32, "G; per-token groups must divide the head dim")
    mode: Any = knob(
        "simulated",
        "`simulated`: fake quant of every cached token, prefill included (KIVI Table 1); `packed`: the real low-bit "
        "cache; `recompute`: the attention input X is cached instead of K and V (with the key quantizer and the packed "
        "cache's streaming) and K, V are rebuilt every decode step (XQuant; `kvq_lab/cache/layers/recompute.py`)",
    )
    recompute: Any = knob(
        None,
        "`recompute.rank` (`null`): `mode=recompute`: cache X's projection on the top-r right singular vectors of "
        "[W_k; W_v] (at most min(hidden, K+V dims): 384 on SmolLM2) instead of X",
        factory=lambda: {"rank": None},
    )
    prefill: Any = knob(
        None,
        "what the prompt's forward attends to: `exact` (the K/V the model computed; the cache quantizes afterwards, as "
        "KIVI's kernels and vLLM do) or `quantized` (what the cache returns, prefill included, as KIVI's Table 1, "
        "llama.cpp and transformers' QuantizedCache do); `null`: the mode's own (`simulated`: quantized, `packed` and "
        "`recompute`: exact), and tasks with `task.prompt_forward=exact` (ppl, fidelity, retrieval) hand the cache "
        "exact K/V unless `prefill=quantized`. Later chunks of a filled cache read it as stored; token policies "
        "(`policy=`) read the prompt exactly",
    )
    policy: Any = knob(
        None,
        "which tokens are stored at how many bits (`kvq_lab/cache/policies/`): `kivi` (default; every token as `mode` "
        "says), `fakequant` (KIVI Table 1 by name: simulated mode, the prompt quantized), `evict` (keep the top "
        "`policy.keep` share of the prompt by `policy.score`, drop the rest), `mikv` "
        "(the rest at `policy.low_bits` instead), `saliency` (ZipCache: the top `policy.high` share at "
        "`policy.high_bits`); scores `knorm`, `attention` (H2O), `snapkv`, `normalized` (ZipCache); the prompt's "
        "sinks and last `policy.window` tokens (32) stay with the mode's layer. Token policies split each prompt of a "
        "batch on its own (decoded through the routed sdpa attention), keys after RoPE; `nbytes()` and "
        "`cache/bits_total` count every tier",
        factory=lambda: {"name": "kivi"},
    )
    skip_layers: Any = knob(
        None,
        "decoder layers left unquantized (16 bits, as engines' `--kv-cache-dtype-skip-layers`): `none`, "
        "`sliding_window` (the model's sliding-window layers: Gemma-3's 15 of 18; an error before load for a model "
        "without them) or a list of layer indices, e.g. `[0,1]`; counted at 16 bits in `nbytes()` and "
        "`cache/bits_total`",
    )
    exact_window: Any = knob(
        0,
        "R, the most recent tokens kept exact (full precision; packed mode; a multiple of G). Not `residual`, the "
        "error corrections; formerly `residual_length`",
    )
    sink_tokens: Any = knob(0, "first N tokens kept in full precision")
    rope: Any = knob(
        "post",
        "`post`: quantize keys after RoPE (KIVI); `pre`: before RoPE, re-rotated at their positions (KVQuant)",
    )
    transform: Any = knob(
        None,
        "maps around each quantizer, undone after it: `none`, `hadamard` (orthonormal rotation of the head dim, "
        "QuaRot; `hadamard:<n>`: blocks of n channels), `rhadamard` (random signs then Hadamard, seeded: "
        "`rhadamard:<seed>`; the rotation TurboQuant's engines use), `rope_pre` (keys only; what `rope=pre` sets), "
        "`interleave` (keys only: channels in llama.cpp's order for Llama, RoPE pairs adjacent, as its block types "
        "group them); a list composes "
        "in order, e.g. `key_transform=[rope_pre,hadamard]`. Fitted on calibration text: `innerq` (keys only; a "
        "power-of-two scale per head and channel, keys divided, query multiplied: InnerQ; `innerq:<alpha>` scales by "
        "max\\|k\\|^alpha, 0 < alpha <= 1, SmoothQuant-style partial scaling), `rotatekv` (a per-head channel reorder "
        "by calibration magnitude, then Hadamard blocks, `rotatekv:<n>`; RotateKV, use after `rope_pre`). `transform` "
        "sets both",
    )
    key_transform: Any = knob(None, row="transform")
    value_transform: Any = knob(None, row="transform")
    key_outliers: Any = knob(
        0.0,
        "dense-and-sparse (KVQuant): the fraction kept exact in a sparse structure and left out of group min/max, in "
        "[0, 0.5); keys by per-channel thresholds fitted on calibration text, values the top \\|v\\| of each token; "
        "counted in `nbytes()` and `cache/bits_total`",
    )
    value_outliers: Any = knob(0.0, row="key_outliers")
    residual: Any = knob(
        None,
        "corrections of the quantization error, stored beside the codes and counted in `nbytes()` (not "
        "the fp window, `exact_window`): `none`, `qjl:<m>` (QJL: m sign bits of a Gaussian sketch of the error "
        "plus its fp16 norm, rebuilt so that inner products are unbiased; `qjl:<m>:<seed>`; TurboQuant's `_prod` "
        "stage: `quant=turboquant_prod_3b`; on KIVI's keys: `quant=qjl_keys`), `sparse:<frac>` (the largest "
        "errors of each vector as fp16 values and channel indices; GEAR's sparse term), `lowrank:<r>[:<n>]` (the "
        "rank-r SVD of each kv head's error over blocks of n tokens, default 32, as two fp16 factors; GEAR's "
        "low-rank term: `quant=gear_2b`, `quant=gear_4b`); a list composes in order, e.g. "
        "`key_residual=[sparse:0.01,qjl:64]`. `residual` sets both",
    )
    key_residual: Any = knob(None, row="residual")
    value_residual: Any = knob(None, row="residual")
    backend: Any = knob(
        "auto",
        "packed mode's kernels: `torch` (pure PyTorch), `cpu` (a C kernel for decode attention, compiled on first use "
        "with the system C compiler), `triton` (GPU); `auto`: Triton when CUDA is present, else `cpu` where it builds, "
        "else `torch` (with a warning). Records name the one that ran",
    )


CACHE_KNOBS = tuple(f.name for f in fields(CacheKnobs))
DEFAULTS: dict[str, Any] = {f.name: getattr(CacheKnobs(), f.name) for f in fields(CacheKnobs)}
_FIELDS = frozenset(f.name for f in fields(CacheConfig))  # knobs of these names are passed to CacheConfig as given


def _int(k: Mapping, key: str, lo: int = 0, hint: str = "") -> int:
    v = k.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConfigError(f"{key}={v!r} must be an integer >= {lo}{hint}")
    return v


def _choice(k: Mapping, key: str, allowed) -> str:
    v = k.get(key)
    if v not in allowed:
        raise ConfigError(f"{key}={v!r} is not allowed; choose one of: {', '.join(map(str, allowed))}")
    return v


def _bits(k: Mapping, key: str) -> int | None:
    v = k.get(key)
    if v is not None and (isinstance(v, bool) or v not in BITS):
        raise ConfigError(
            f"{key}={v!r} is not supported; choose one of: {', '.join(map(str, BITS))} (16 = no quantization)"
        )
    return v


def _code(k: Mapping, tensor: str) -> tuple[str, int]:
    """(format, bits) of one tensor's quantizer: `format` or `<tensor>_format` (null: int), `bits` or
    `<tensor>_bits` (null: the format's default width). One-line errors name the knobs as the user spelled them."""
    both, own = k.get("format"), k.get(f"{tensor}_format")
    if both is not None and own is not None and both != own:
        raise ConfigError(f"format={both} and {tensor}_format={own} disagree; set one of them")
    bname = "bits" if k.get("bits") is not None else f"{tensor}_bits"
    # the knob an error names: the one set, or (int by default) `format` when `bits` sets both tensors' widths
    fname = "format" if both is not None or (own is None and bname == "bits") else f"{tensor}_format"
    fmt = both if both is not None else own if own is not None else DEFAULT_FORMAT
    bits = _bits(k, bname)
    if fmt == DEFAULT_FORMAT and (bits is None or bits in INT_BITS or bits == IDENTITY_BITS):
        return fmt, DEFAULT_BITS if bits is None else bits  # int at its widths: no registry (stays torch-free)
    # another format, or int at a width it does not take (5): the registry checks it and names the formats that do
    from kvq_lab.quant.formats import FORMATS, check_bits, default_bits, get_format

    try:
        if not isinstance(fmt, str):
            raise QuantConfigError(f"{fname}={fmt!r} must be a format name, e.g. int or fp8_e4m3")
        if bits is None:
            return fmt, default_bits(fmt, fname)
        if bits < 16:  # 16 quantizes nothing, whatever the format (the exact oracle)
            get_format(fmt, bits, bname, fname)
        else:  # the name must still exist; the identity has no format, so 16 bits is one cache however spelled
            default_bits(fmt, fname)
            if not FORMATS[fmt].allows_identity:  # nuq: 16 bits would fit nothing
                check_bits(fmt, bits, bname, fname)
            return DEFAULT_FORMAT, bits
        return fmt, bits
    except QuantConfigError as e:
        raise ConfigError(str(e)) from None


def _listed(v):
    """A knob's list value as a plain list (a Hydra ListConfig or a tuple included); anything else as it is."""
    return list(v) if isinstance(v, Sequence) and not isinstance(v, str) else v


def _transforms(k: Mapping, tensor: str) -> tuple[str, ...]:
    """One tensor's transforms: `transform` or `<tensor>_transform` (null or none: none; a name, or a list that
    composes in order). One-line errors name the knob as the user spelled it."""
    both, own = _listed(k.get("transform")), _listed(k.get(f"{tensor}_transform"))
    if both is not None and own is not None and both != own:
        raise ConfigError(f"transform={_show(both)} and {tensor}_transform={_show(own)} disagree; set one of them")
    name = "transform" if both is not None else f"{tensor}_transform"
    try:
        return check_transforms(both if both is not None else own, tensor, name)
    except QuantConfigError as e:
        keys_only = name == "transform" and tensor == "value"
        hint = f" (it sets keys and values; for keys only: key_transform={_show(both)})" if keys_only else ""
        raise ConfigError(f"{e}{hint}") from None


def _residuals(k: Mapping, tensor: str) -> tuple[str, ...]:
    """One tensor's residual corrections: `residual` or `<tensor>_residual` (null or none: none; a list composes)."""
    from kvq_lab.quant.residuals import check_residuals

    both, own = _listed(k.get("residual")), _listed(k.get(f"{tensor}_residual"))
    if both is not None and own is not None and both != own:
        raise ConfigError(f"residual={_show(both)} and {tensor}_residual={_show(own)} disagree; set one of them")
    name = "residual" if both is not None else f"{tensor}_residual"
    try:
        return check_residuals(both if both is not None else own, name)
    except QuantConfigError as e:
        raise ConfigError(str(e)) from None


def _show(v) -> str:
    """A knob's value as written on the command line: `hadamard`, `[rope_pre,hadamard]`."""
    return f"[{','.join(map(str, v))}]" if isinstance(v, list) else str(v)


def _policy(k: Mapping) -> dict:
    """`policy`: a name, or a section {name: ..., <option>: ...} (`policy=evict policy.keep=0.5`)."""
    v = k.get("policy")
    if v is None or isinstance(v, str):
        return {"policy": v or "kivi", "policy_options": ()}
    if not isinstance(v, Mapping):
        raise ConfigError(f"policy={v!r} must be a policy name, e.g. policy=evict")
    opts = dict(v)
    name = opts.pop("name", None) or "kivi"
    return {"policy": name, "policy_options": tuple(sorted(opts.items()))}


def _skip_layers(k: Mapping) -> tuple[int, ...] | str:
    """`skip_layers`: null/none -> (); `sliding_window`; an index or a list of them (duplicates merged, sorted)."""
    v = _listed(k.get("skip_layers"))
    if v is None or v == "none":
        return ()
    if v == SLIDING_WINDOW:
        return v
    items = v if isinstance(v, list) else [v]
    if not items or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in items):
        raise ConfigError(
            f"skip_layers={_show(v)} is not allowed; choose none, sliding_window or a list of layer indices, e.g. [0,1]"
        )
    return tuple(sorted(set(items)))


def _recompute_rank(k: Mapping) -> int | None:
    """`recompute.rank` (mode=recompute: cache X's projection on r singular vectors; null: X itself)."""
    r = k.get("recompute") or {}
    unknown = sorted(set(r) - {"rank"})
    if unknown:
        raise ConfigError(f"recompute.{unknown[0]} is not a setting of recompute; allowed: rank")
    return r.get("rank")


def cache_config(knobs: Mapping) -> CacheConfig:
    """The cache the knobs describe, every layer alike (validated, one-line errors). Knobs not given take their
    defaults (`CacheKnobs`); other keys of the mapping are ignored. A knob named as a `CacheConfig` field and not
    built here (`mode`, `exact_window`, `key_outliers`, a new knob) is passed through as given: `CacheConfig` checks it,
    so a new knob needs no line here."""
    k = {**DEFAULTS, **{n: knobs[n] for n in CACHE_KNOBS if n in knobs}}
    key_axis = _choice(k, "key_axis", AXES)
    value_axis = _choice(k, "value_axis", AXES)
    key_format, key_bits = _code(k, "key")
    value_format, value_bits = _code(k, "value")
    g = _int(k, "group_size", lo=1, hint=" (e.g. 32)")
    try:  # mode, prefill, rope, backend, exact_window, sink_tokens, outliers: checked once, by CacheConfig itself
        built = {  # the knobs that are not one field each: set for both tensors, sections, lists (checked in order)
            "key": QuantSpec(key_bits, g, key_axis, key_format),
            "value": QuantSpec(value_bits, g, value_axis, value_format),
            "skip_layers": _skip_layers(k),
            **_policy(k),
            "key_transform": _transforms(k, "key"),
            "value_transform": _transforms(k, "value"),
            "key_residual": _residuals(k, "key"),
            "value_residual": _residuals(k, "value"),
            "recompute_rank": _recompute_rank(k),
        }
        given = {n: k[n] for n in CACHE_KNOBS if n in _FIELDS and n not in built}  # mode, exact_window, a new knob
        return CacheConfig(**built, **given)
    except QuantConfigError as e:
        raise ConfigError(str(e)) from None
