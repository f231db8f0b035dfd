"""The user's contract: the run config schema and its validation.

Hydra composes `conf/` against `RunSchema` (registered as `kvq_schema`), so an unknown top-level key fails at
compose time. `validate(cfg)` then checks every value and turns the config into typed objects *before any
model loads*; each failure is a `ConfigError` whose one-line message names the key, the bad value and what
is allowed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from kvq_lab.cache.config import BACKENDS, MODES, ROPE, CacheConfig
from kvq_lab.checks import (
    LOGGER_KEYS,
    WANDB_MODES,
    _bool,
    _check_keys,
    check_device,
    check_model,
    check_paths,
    data_dir,
)
from kvq_lab.errors import ConfigError
from kvq_lab.quant.spec import AXES, BITS, DEFAULT_BITS, DEFAULT_FORMAT, QuantConfigError, QuantSpec
from kvq_lab.quant.transforms import check_transforms

__all__ = ["ConfigError", "RunPlan", "RunSchema", "cache_config", "config_hash", "register_schema", "validate"]


@dataclass
class RunSchema:
    """Top-level knobs (see conf/config.yaml for defaults and meaning). Types are loose on purpose: `validate`
    gives every bad value the same one-line message, where OmegaConf's own type errors would span several."""

    key_axis: Any = "channel"
    value_axis: Any = "token"
    bits: Any = None  # sets key_bits and value_bits together when given
    key_bits: Any = None  # null: the format's default width (int: 2, fp8: 8)
    value_bits: Any = None
    format: Any = None  # sets key_format and value_format together when given
    key_format: Any = None  # null: int
    value_format: Any = None
    group_size: Any = 32
    residual_length: Any = 0
    sink_tokens: Any = 0
    rope: Any = "post"
    transform: Any = None  # sets key_transform and value_transform together when given
    key_transform: Any = None  # null or none: no transform; a name or a list of names
    value_transform: Any = None
    key_outliers: Any = 0.0  # fraction kept exact, dense-and-sparse (kvq_lab.quant.outliers)
    value_outliers: Any = 0.0
    mode: Any = "simulated"
    backend: Any = "auto"
    limit: Any = None
    seed: Any = 0
    batch_size: Any = 1
    prefix_reuse: Any = True  # lm-eval tasks: reuse the cache of a shared prompt prefix where the cut changes nothing
    probe: Any = False
    results_dir: Any = "results"
    data_dir: Any = None
    run_name: Any = None
    resume: Any = True
    resume_dirty: Any = False  # also reuse records made from a git tree with uncommitted changes
    device: Any = "cpu"
    experiment_name: Any = None
    model: dict[str, Any] = field(default_factory=dict)
    task: dict[str, Any] = field(default_factory=dict)
    logger: dict[str, Any] = field(default_factory=dict)
    probes: dict[str, Any] = field(default_factory=dict)  # probe settings (prompts, lengths), see conf/config.yaml
    calibration: dict[str, Any] = field(default_factory=dict)  # fitted methods' data (kvq_lab.calibration)
    recompute: dict[str, Any] = field(default_factory=dict)  # mode=recompute settings (rank), see conf/config.yaml
    precision: dict[str, Any] = field(default_factory=dict)  # per-layer key/value bits (kvq_lab.precision)


def register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="kvq_schema", node=RunSchema)


def _int(cfg, key: str, lo: int = 0, allow_none: bool = False, hint: str = "") -> int | None:
    v = cfg.get(key)
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        what = f"an integer >= {lo}" + (" or null" if allow_none else "")
        raise ConfigError(f"{key}={v!r} must be {what}{hint}")
    return v


def _choice(cfg, key: str, allowed) -> str:
    v = cfg.get(key)
    if v not in allowed:
        raise ConfigError(f"{key}={v!r} is not allowed; choose one of: {', '.join(map(str, allowed))}")
    return v


def _bits(cfg, key: str) -> int | None:
    v = cfg.get(key)
    if v is not None and (isinstance(v, bool) or v not in BITS):
        raise ConfigError(
            f"{key}={v!r} is not supported; choose one of: {', '.join(map(str, BITS))} (16 = no quantization)"
        )
    return v


def _code(cfg, tensor: str) -> tuple[str, int]:
    """(format, bits) of one tensor's quantizer: `format` or `<tensor>_format` (null: int), `bits` or
    `<tensor>_bits` (null: the format's default width). One-line errors name the knobs as the user spelled them."""
    both, own = cfg.get("format"), cfg.get(f"{tensor}_format")
    if both is not None and own is not None and both != own:
        raise ConfigError(f"format={both} and {tensor}_format={own} disagree; set one of them")
    fname = "format" if both is not None else f"{tensor}_format"
    fmt = both if both is not None else own if own is not None else DEFAULT_FORMAT
    bname = "bits" if cfg.get("bits") is not None else f"{tensor}_bits"
    bits = _bits(cfg, bname)
    if fmt == DEFAULT_FORMAT:  # int: every width in BITS, no registry (validation stays torch-free)
        return fmt, DEFAULT_BITS if bits is None else bits
    from kvq_lab.quant.formats import FORMATS, check_bits, default_bits, get_format
    from kvq_lab.quant.formats import builtin as _formats  # noqa: F401  (registers the built-in formats)

    try:
        if not isinstance(fmt, str):
            raise QuantConfigError(f"{fname}={fmt!r} must be a format name, e.g. int or fp8_e4m3")
        if bits is None:
            return fmt, default_bits(fmt, fname)
        if bits < 16:  # 16 quantizes nothing, whatever the format (the exact oracle)
            get_format(fmt, bits, bname, fname)
        else:  # the name must still exist; the identity has no format, so 16 bits is one cache however spelled
            default_bits(fmt, fname)
            if not getattr(FORMATS[fmt], "allows_identity", True):  # nuq: 16 bits would fit nothing
                check_bits(fmt, bits, bname, fname)
            return DEFAULT_FORMAT, bits
        return fmt, bits
    except QuantConfigError as e:
        raise ConfigError(str(e)) from None


def _transforms(cfg, tensor: str) -> tuple[str, ...]:
    """One tensor's transforms: `transform` or `<tensor>_transform` (null or none: none; a name, or a list that
    composes in order). One-line errors name the knob as the user spelled it."""

    def given(key):
        v = cfg.get(key)
        return OmegaConf.to_container(v) if isinstance(v, ListConfig) else v

    both, own = given("transform"), given(f"{tensor}_transform")
    if both is not None and own is not None and both != own:
        raise ConfigError(f"transform={_show(both)} and {tensor}_transform={_show(own)} disagree; set one of them")
    knob = "transform" if both is not None else f"{tensor}_transform"
    try:
        return check_transforms(both if both is not None else own, tensor, knob)
    except QuantConfigError as e:
        keys_only = knob == "transform" and tensor == "value"
        hint = f" (it sets keys and values; for keys only: key_transform={_show(both)})" if keys_only else ""
        raise ConfigError(f"{e}{hint}") from None


def _show(v) -> str:
    """A knob's value as written on the command line: `hadamard`, `[rope_pre,hadamard]`."""
    return f"[{','.join(map(str, v))}]" if isinstance(v, list) else str(v)


def _uniform_cache_config(cfg: DictConfig) -> CacheConfig:
    """The cache of the top-level knobs, every layer alike (validated, one-line errors)."""
    key_axis = _choice(cfg, "key_axis", AXES)
    value_axis = _choice(cfg, "value_axis", AXES)
    key_format, key_bits = _code(cfg, "key")
    value_format, value_bits = _code(cfg, "value")
    g = _int(cfg, "group_size", lo=1, hint=" (e.g. 32)")
    _int(cfg, "residual_length", lo=0)
    _int(cfg, "sink_tokens", lo=0)
    rope = _choice(cfg, "rope", ROPE)
    key_transform, value_transform = _transforms(cfg, "key"), _transforms(cfg, "value")
    mode = _choice(cfg, "mode", MODES)
    backend = _choice(cfg, "backend", BACKENDS)
    outliers = {k: cfg.get(k, 0.0) for k in ("key_outliers", "value_outliers")}
    try:
        return CacheConfig(
            key=QuantSpec(key_bits, g, key_axis, key_format),
            value=QuantSpec(value_bits, g, value_axis, value_format),
            mode=mode,
            residual_length=cfg.residual_length,
            sink_tokens=cfg.sink_tokens,
            rope=rope,
            backend=backend,
            key_transform=key_transform,
            value_transform=value_transform,
            **outliers,
            recompute_rank=_recompute_rank(cfg),
        )
    except QuantConfigError as e:
        raise ConfigError(str(e)) from None


def cache_config(cfg: DictConfig) -> CacheConfig:
    """The cache the run asks for, from the top-level knobs (validated, one-line errors); precision=file gives it
    the file's per-layer key/value bits (`kvq_lab.precision_config`)."""
    from kvq_lab import precision_config

    return precision_config.apply_file(cfg, _uniform_cache_config(cfg))


def _recompute_rank(cfg: DictConfig) -> int | None:
    """`recompute.rank` (mode=recompute: cache X's projection on r singular vectors; null: X itself)."""
    r = cfg.get("recompute") or {}
    _check_keys("recompute", r, ("rank",))
    return r.get("rank")


def check_recompute(cfg: DictConfig, cache: CacheConfig, model: str) -> None:
    """mode=recompute before any weights load: the probes model K/V quantizers, not X; a local model's architecture
    (built from its config.json on the meta device) has separable K/V projections and room for the rank. Other
    sources (hub ids, GGUF files) are checked the same way when the cache is built, right after loading."""
    if cfg.get("probe") or cfg.task.get("name") == "probe":
        raise ConfigError("the probes measure K/V quantizers; mode=recompute quantizes X: use mode=packed or simulated")
    from kvq_lab.calibration import needs_calibration, what_is_fitted

    if needs_calibration(cache):
        raise ConfigError(f"{what_is_fitted(cache)} is fitted on K/V; mode=recompute quantizes X: unset it")
    from kvq_lab.models import resolve

    path = Path(resolve(model)).expanduser()
    if not (path / "config.json").is_file():
        return
    from kvq_lab.cache.recompute import check_model_config

    try:
        check_model_config(str(path), cache.recompute_rank, cache.key)
    except QuantConfigError as e:
        raise ConfigError(str(e)) from None


@dataclass
class RunPlan:
    """A validated run: what to build, where to write, and what its numbers are computed from.

    config_hash: the resolved config (cache knobs replaced by the cache they build, its backend resolved); inputs:
    identities of the data files, the model, the package sources, the libraries and, where something is fitted
    (calibration, per-layer bits), the digest of the fitted parameters (`fitted`); run_key: all of it hashed together
    (the resume key), "" while the fit is still to be made (the runner sets it once the fit exists, `refit`);
    row_key: the same without the fit (what a sweep row is claimed and found by, fitted or not).
    """

    cache: CacheConfig
    task: str
    model: str
    results_dir: Path
    data_dir: Path | None
    limit: int | None
    config_hash: str
    inputs: dict[str, Any] = field(default_factory=dict)
    run_key: str = ""
    row_key: str = ""

    def refit(self, cache: CacheConfig) -> bool:
        """Take the fitted cache (after calibration and the per-layer search) and key the run by its fit; -> whether
        the run key changed (then the runner looks for a completed record of the new key)."""
        from kvq_lab.calibration import fitted_digest
        from kvq_lab.provenance import run_key

        self.cache = cache
        digest = fitted_digest(cache)
        if digest == self.inputs.get("fitted") and self.run_key:
            return False
        self.inputs = {k: v for k, v in self.inputs.items() if k != "fitted"}
        if digest:
            self.inputs["fitted"] = digest
        self.run_key = run_key(self.config_hash, self.inputs)
        return True


# knobs that only build the cache: hashed through the CacheConfig they make, so `bits=2` and
# `key_bits=2 value_bits=2` (the same cache) are the same run
CACHE_KNOBS = (
    "key_axis",
    "value_axis",
    "bits",
    "key_bits",
    "value_bits",
    "format",
    "key_format",
    "value_format",
    "group_size",
    "residual_length",
    "sink_tokens",
    "rope",
    "transform",
    "key_transform",
    "value_transform",
    "key_outliers",
    "value_outliers",
    "mode",
    "backend",
)


# CacheConfig fields added after records existed: left out of the hash at their defaults, so older hashes stay
CACHE_DEFAULTS = {"key_outliers": 0.0, "value_outliers": 0.0, "key_outlier_thresholds": None, "layers": ()}
CACHE_DEFAULTS["recompute_rank"] = None  # mode=recompute (kvq_lab.cache.recompute)


def config_hash(cfg: DictConfig, cache: CacheConfig | None = None) -> str:
    """Hash of what determines a run's result: everything except where it is written and how it is logged,
    with the cache knobs replaced by the cache they describe."""
    c = OmegaConf.to_container(cfg, resolve=True)
    where = ("results_dir", "run_name", "logger", "resume", "resume_dirty", "experiment_name", "data_dir")
    for k in (*where, *CACHE_KNOBS):
        c.pop(k, None)
    c.pop("recompute", None)  # in the cache config (recompute_rank)
    from kvq_lab import precision_config

    c["precision"] = precision_config.hash_part(cfg)  # per-layer bits by content; uniform: left out (old hashes)
    if c["precision"] is None:
        del c["precision"]
    cache = cache if cache is not None else cache_config(cfg)
    fields = asdict(cache.unfitted()).items()
    c["cache"] = {k: v for k, v in fields if k not in CACHE_DEFAULTS or v != CACHE_DEFAULTS[k]}
    from kvq_lab.calibration import needs_calibration

    if not needs_calibration(cache):
        c.pop("calibration", None)  # calibration settings only matter to fitted methods
    if not cfg.get("probe"):
        c.pop("probes", None)  # probe settings only matter when probes run
    return hashlib.sha256(json.dumps(c, sort_keys=True, default=str).encode()).hexdigest()[:12]


def validate(cfg: DictConfig) -> RunPlan:
    """Check every knob and the task's inputs; no model is loaded. Raises ConfigError (one line, with the fix)."""
    from kvq_lab.plugins import TASKS
    from kvq_lab.provenance import code_version, library_versions, model_identity, run_key

    unknown = sorted(set(cfg.keys()) - set(RunSchema.__dataclass_fields__) - {"hydra"})
    if unknown:  # `+key=value` slips past Hydra's struct check; a typo must not change the run silently
        raise ConfigError(f"{unknown[0]} is not a kvq_lab setting; see conf/config.yaml for the settings")
    cache = cache_config(cfg)
    check_device(cfg, cache)
    from kvq_lab import precision_config

    precision_config.check(cfg, cache)  # per-layer bits: settings, a budget the smallest choice meets, a K/V mode
    from kvq_lab.calibration import check_calibration

    check_calibration(cfg, cache)  # fitted methods: their calibration text exists and is not the evaluated one
    for key in ("limit",):
        _int(cfg, key, lo=1, allow_none=True)
    _int(cfg, "seed", lo=0)
    _int(cfg, "batch_size", lo=1)
    for key in ("probe", "resume", "resume_dirty", "prefix_reuse"):
        _bool(cfg, key)
    results_dir = check_paths(cfg)
    logger = cfg.logger.get("name")
    if logger not in LOGGER_KEYS:
        raise ConfigError(f"logger={logger!r} is not a logger; choose one of: {', '.join(LOGGER_KEYS)}")
    _check_keys("logger", cfg.logger, LOGGER_KEYS[logger])
    if logger == "wandb" and cfg.logger.get("mode") not in WANDB_MODES:
        raise ConfigError(f"logger.mode={cfg.logger.get('mode')!r}; choose offline, online or disabled")
    if cfg.probe:  # the probes' own settings, checked now rather than after a task has run
        from kvq_lab.probes.settings import ProbeSettings

        try:
            ProbeSettings.from_dict(OmegaConf.to_container(cfg.probes, resolve=True))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"probes: {e}") from None
    task_name = cfg.task.get("name")
    if task_name not in TASKS:
        raise ConfigError(f"task.name={task_name!r} is not a known task; choose one of: {', '.join(sorted(TASKS))}")
    model = check_model(cfg)
    facts = model_facts(cfg, model)
    if cache.mode == "recompute":
        check_recompute(cfg, cache, model)
    ddir = data_dir(cfg)
    task = TASKS[task_name]
    task.check(cfg, ddir)
    check_against_model(cfg, cache, model, facts, ddir)  # head dim, layers, calibration and sensitivity text
    cache = resolve_backend(cache, facts)
    h = config_hash(cfg, cache)
    inputs = {
        "data": task.inputs(cfg, ddir),
        "model": model_identity(model, cfg.model.get("revision")),
        "code": code_version(),
        "libraries": library_versions(),
    }
    plan = RunPlan(
        cache=cache,
        task=task_name,
        model=model,
        results_dir=results_dir,
        data_dir=ddir,
        limit=cfg.get("limit"),
        config_hash=h,
        inputs=inputs,
        row_key=run_key(h, inputs),
    )
    fitted = kept_fit(cfg, cache, ddir, inputs["model"])  # None: nothing fitted, or the fit is still to be made
    if fitted is not None or not fit_pending(cfg, cache):
        plan.refit(fitted if fitted is not None else cache)
    return plan


def model_facts(cfg: DictConfig, model: str):
    """What the model is (layers, heads, head dim; `kvq_lab.models.ModelFacts`) read from its local files without
    loading weights, None for a hub id; `model.head_dim` when given overrides the files. One-line ConfigError for a
    file that is not what it claims (a truncated GGUF)."""
    from dataclasses import replace as _replace

    from kvq_lab.models import BadModelFile, facts, resolve

    try:
        f = facts(resolve(model))
    except BadModelFile as e:
        raise ConfigError(f"model.path={model!r} is not a valid model file (truncated?): {e}") from None
    hd = cfg.model.get("head_dim")
    if hd:
        from kvq_lab.models import ModelFacts

        f = _replace(f, head_dim=int(hd)) if f is not None else ModelFacts(0, 0, 0, int(hd), 0, None)
    return f


def check_against_model(cfg: DictConfig, cache: CacheConfig, model: str, facts, ddir: Path | None) -> None:
    """The checks that need the model's shape or tokenizer but not its weights, before it loads: group tiling and
    transforms against the head dim, a per-layer bits file against the layer count, the calibration and sensitivity
    texts against the token counts they must hold (with the model's own tokenizer, where it is local)."""
    if facts is None:
        return
    if facts.head_dim:
        try:
            cache.check_head_dim(facts.head_dim)
        except QuantConfigError as e:
            raise ConfigError(str(e)) from None
    from kvq_lab import precision_config

    if facts.layers:
        precision_config.check_layers(cfg, cache, facts.layers)
    from kvq_lab.calibration import check_text_length, needs_calibration

    needs_text = needs_calibration(cache) or precision_config.settings(cfg)["name"] == "search"
    if not needs_text or (ddir is None and "gsm8k_train" in _text_sources(cfg)):
        return  # the text would be downloaded: checked once the model loads
    from kvq_lab.models import load_tokenizer, resolve

    tok = load_tokenizer(resolve(model))
    check_text_length(cfg, cache, tok, ddir)
    precision_config.check_text_length(cfg, tok, ddir)


def _text_sources(cfg: DictConfig) -> set[str]:
    from kvq_lab import precision_config
    from kvq_lab.calibration import settings

    return {settings(cfg)["source"], precision_config.settings(cfg)["source"]}


def resolve_backend(cache: CacheConfig, facts) -> CacheConfig:
    """The cache with the backend that will run in place of `auto` (`kvq_lab.cache.backends.resolve`): records
    name it, and `backend=auto` is the same run as an explicit choice of what it picks."""
    if cache.mode == "simulated":
        return replace(cache, backend="torch") if cache.backend != "torch" else cache
    from kvq_lab.cache.backends import resolve

    width = None
    if cache.mode == "recompute" and facts is not None and facts.hidden:
        width = cache.recompute_rank or facts.hidden
    name = resolve(cache, width)
    return cache if name is None or name == cache.backend else replace(cache, backend=name)


def fit_pending(cfg: DictConfig, cache: CacheConfig) -> bool:
    """Whether something of this run is fitted after the model loads (calibration, a per-layer search)."""
    from kvq_lab import precision_config
    from kvq_lab.calibration import needs_calibration

    return needs_calibration(cache) or precision_config.settings(cfg)["name"] == "search"


def kept_fit(cfg: DictConfig, cache: CacheConfig, ddir: Path | None, model_id) -> CacheConfig | None:
    """The fitted cache from the calibration cache, where this run's fit is kept there and matches its digest
    (read before any model loads, so a rerun finds its completed record at once); None otherwise."""
    from kvq_lab import precision_config
    from kvq_lab.calibration import fit_path, needs_calibration, read_fit, settings, text_at_hand

    if not needs_calibration(cache) or precision_config.settings(cfg)["name"] == "search":
        return None
    if not text_at_hand(settings(cfg), ddir):
        return None
    return read_fit(fit_path(cache, cfg, ddir, model_id), cache)
