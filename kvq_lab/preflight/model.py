"""The preflight's checks against the model's files, before its weights load, for a run and for lm-eval's `kvq`
model alike: the model's shape against the cache (group tiling, transforms, a per-layer bits file), the calibration
and sensitivity texts against the token counts they must hold (the model's own tokenizer), mode=recompute against the
architecture, and the backend `auto` stands for. `kvq_lab.preflight` runs them in its order.

Each check raises a one-line `ConfigError`. Sections are the run's validated settings (`calibration`, `precision`,
`task`, `model`: mappings; `kvq_lab.fit.calibration_settings.settings`, `kvq_lab.fit.precision_settings.settings`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from kvq_lab.cache.config import CacheConfig
from kvq_lab.common.errors import ConfigError, QuantConfigError
from kvq_lab.fit import calibration_settings as calibration
from kvq_lab.fit import precision_settings as precision


def model_facts(model: str, head_dim: int | None = None):
    """What the model is (`kvq_lab.models.files.ModelFacts`: layers, heads, head dim) read from its local files
    without loading weights, None for a hub id; `head_dim` (the model section's, when given) overrides the files. One-
    line ConfigError for a file that is not what it claims (a truncated GGUF)."""
    from kvq_lab.models.files import BadModelFile, ModelFacts, facts
    from kvq_lab.models.loading import resolve

    try:
        f = facts(resolve(model))
    except BadModelFile as e:
        raise ConfigError(f"model.path={model!r} is not a valid model file (truncated?): {e}") from None
    if head_dim:
        f = replace(f, head_dim=int(head_dim)) if f is not None else ModelFacts(0, 0, 0, int(head_dim), 0, None)
    return f


def check_model_features(cache: CacheConfig, facts, model: str, task, task_cfg) -> None:
    """What this model's files say it cannot do, before its weights load: a task that prompts through a chat template
    on a model without one, and keys quantized before RoPE (rope=pre) on a model whose RoPE differs between layer
    types, which kvq_lab's RoPE helper does not model yet (it would fail after the load); a token policy on
    sliding-window layers."""
    if facts is None:
        return
    if task.uses_chat(task_cfg) and facts.chat_template is False:
        alt = f"{task.plain_prompt} or " if task.plain_prompt else ""
        raise ConfigError(
            f"task={task.name} prompts through the model's chat template, and model={model} has none (a base "
            f"model): use {alt}a chat/instruct model"
        )
    sliding = set(facts.sliding_layers or ())
    if cache.splits_tokens and sliding - set(cache.skip_layers):
        raise ConfigError(
            f"policy={cache.policy} on model={model}: its sliding-window layers read only their last tokens, which a "
            "token policy's split does not model; add skip_layers=sliding_window (the policy then runs on the global "
            "layers)"
        )
    if facts.rope_by_layer_type and cache.rope == "pre" and not cache.key.is_identity:
        raise ConfigError(
            f"rope=pre (rope_pre) on model={model}: its RoPE differs between sliding-window and global layers, "
            "which rope=pre does not model yet; use rope=post"
        )


def resolve_layers(cache: CacheConfig, facts, model: str) -> CacheConfig:
    """`skip_layers` against the model's files before its weights load: `sliding_window` becomes the model's sliding-
    window layers (an error for a model without them), indices past its last layer are refused. A hub id (no facts)
    is resolved when the cache is built (`QuantizedKVCache.for_model`)."""
    if facts is None or not cache.skip_layers:
        return cache
    try:
        return cache.resolve_layers(facts.sliding_layers, facts.layers, f"model={model}")
    except QuantConfigError as e:
        raise ConfigError(str(e)) from None


def check_recompute(cache: CacheConfig, model: str, probes: bool) -> None:
    """mode=recompute before any weights load: the probes (`probes`: the run measures them) model K/V quantizers,
    not X; a local model's architecture (built from its config.json on the meta device) has separable K/V projections
    and room for the rank. Other sources (hub ids, GGUF files) are checked the same way when the cache is built, right
    after loading."""
    if probes:
        raise ConfigError("the probes measure K/V quantizers; mode=recompute quantizes X: use mode=packed or simulated")
    if calibration.needs_calibration(cache):
        raise ConfigError(f"{calibration.what_is_fitted(cache)} is fitted on K/V; mode=recompute quantizes X: unset it")
    from kvq_lab.models.loading import resolve

    path = Path(resolve(model)).expanduser()
    if not (path / "config.json").is_file():
        return
    from kvq_lab.cache.layers.recompute import check_model_config

    try:
        check_model_config(str(path), cache.recompute_rank, cache.key)
    except QuantConfigError as e:
        raise ConfigError(str(e)) from None


def check_against_model(
    cache: CacheConfig,
    model: str,
    facts,
    cal: Mapping,
    prec: Mapping,
    data_dir: Path | None,
    task: Mapping | None = None,
    dtype: str = "float32",
) -> None:
    """The checks that need the model's shape or tokenizer but not its weights, before it loads: group tiling and
    transforms against the head dim, a per-layer bits file against the layer count, a search budget against the
    cheapest assignment's bytes as the search will count them (the model's shape and `dtype`: exact windows, sinks,
    per-head layers), the calibration (`cal`) and sensitivity (`prec`) texts against the token counts they must
    hold, with the model's own tokenizer where it is local (a text that would be downloaded is checked once the model
    loads)."""
    if facts is None:
        return
    if facts.head_dim:
        try:
            cache.check_head_dim(facts.head_dim)
        except QuantConfigError as e:
            raise ConfigError(str(e)) from None
    if facts.layers:
        precision.check_layers(prec, cache, facts.layers, facts.kv_heads)
    search = precision.settings(prec)["name"] == "search"
    if search and facts.layers and facts.kv_heads and facts.head_dim:
        from kvq_lab.fit.precision import check_budget, shape_costs

        s = precision.settings(prec)
        shape = (facts.layers, facts.kv_heads, facts.head_dim)
        costs = shape_costs(shape, dtype, cache, s["choices"], s["tokens"], s["granularity"])
        check_budget(costs, s["budget"], s["choices"])
    if not (calibration.needs_calibration(cache) or search):
        return
    sources = {calibration.settings(cal)["source"], precision.settings(prec)["source"]}
    if data_dir is None and "gsm8k_train" in sources:
        return
    from kvq_lab.models.files import load_tokenizer
    from kvq_lab.models.loading import resolve

    tok = load_tokenizer(resolve(model))
    calibration.check_text_length(cal, cache, tok, data_dir, task)
    precision.check_text_length(prec, tok, data_dir)


def resolve_backend(cache: CacheConfig, facts) -> CacheConfig:
    """The cache with the backend that will run in place of `auto` (`kvq_lab.cache.routing.backends.resolve`): records
    name it, and `backend=auto` is the same run as an explicit choice of what it picks."""
    if not cache.caps.kernels:
        return replace(cache, backend="torch") if cache.backend != "torch" else cache
    from kvq_lab.cache.routing.backends import resolve

    width = None
    if not cache.caps.stores_kv and facts is not None and facts.hidden:  # X's width: the rank or the hidden size
        width = cache.recompute_rank or facts.hidden
    name = resolve(cache, width)
    return cache if name is None or name == cache.backend else replace(cache, backend=name)
