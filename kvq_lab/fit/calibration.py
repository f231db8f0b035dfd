"""Calibration: the data that fitted methods learn from, fitted once per (model, method, settings, code version).

Fitted methods (`needs_calibration`): fitted formats (`CodeFormat.fitted`: nuq codebooks, KVQuant; nvfp4's per-tensor
scale), key outlier
thresholds (`key_outliers`), and fitted transforms (`Transform.fitted`: innerq, rotatekv). One mechanism serves all
of them, `calibrate` (the run's entry point, and lm-eval's `kvq` model's):

1. Text (`calibration.source`), never the evaluated text: `gsm8k_train` (default), `coqa_stories` or `file`
   (`kvq_lab.fit.calibration_settings`: the settings, their checks before the load, the text and its tokens).
2. Capture (`kvq_lab.fit.capture`): the first `calibration.tokens` tokens through the model, pre-RoPE keys and
   values of every layer and the gradient g of the next-token loss at them.
3. Fit (`fit`, here), per layer and tensor, in the order the quantizer sees the tensor: the transforms in their order
   (a fitted one fits on the tensor as it arrives there: rotatekv after rope_pre sees pre-RoPE keys), gradients
   mapped alongside (g M^-T: `fold_query` of a foldable map, `forward` of rope_pre, both exact for these maps);
   then key outlier thresholds (`kvq_lab.quant.outliers.fit_thresholds`); then a fitted format's `fit` (nuq: a
   codebook on the group-normalized values with weights g^2 * range^2, outliers excluded; nvfp4: its fp32 tensor
   scale, the layer's amax / (448 * 6), outliers excluded).
   The result is a `CacheConfig` with one config per layer (`layers`): a fitted format becomes the spec its `fit`
   returns (nuq: `lut` with the fitted codebook; nvfp4: itself with `tensor_scale`), fitted transforms are named by
   their `name@digest` spellings.
4. Cache (`kvq_lab.fit.fit_cache`): one file per (model, method, settings, text, code), verified against its digest
   on every read; the fitted parameters' own digest (`fitted_digest`) is part of the run's inputs and run key.

Layering: above `models`/`cache` (it runs the model on text); `kvq_lab.run.config`'s validation reads only the
model-free `calibration_settings`. Formats and transforms receive plain tensors. Torch and transformers are imported
inside functions.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvq_lab.cache.config import CacheConfig
from kvq_lab.common.errors import ConfigError
from kvq_lab.quant.transforms import get_transform

from .calibration_settings import calibration_text, needs_calibration, settings, token_ids
from .capture import capture
from .fit_cache import cache_dir, calibration_key, read_fit, write_fit

log = logging.getLogger("kvq_lab")


# -- fit -----------------------------------------------------------------------------------------------------------
def _grad_map(t, g, pos):
    """The gradient of what comes out of transform t, from the gradient g of what goes in (g M^-T)."""
    return t.fold_query(g) if t.foldable else t.forward(g, pos)


def fit_layer(cache: CacheConfig, cap: dict[str, Any], rope) -> CacheConfig:
    """One decoder layer's config fitted on its captured tensors (see the module docstring, step 3)."""
    from kvq_lab.quant.outliers import Outliers, fit_thresholds
    from kvq_lab.quant.reference import code_format
    from kvq_lab.quant.transforms.rope_pre import rotate

    pos = rope.positions(cap["key_pre"], cap["positions"]) if rope is not None else None
    k_post = rotate(cap["key_pre"], pos.cos, pos.sin) if pos is not None else cap["key_pre"]
    g_post = rotate(cap["g_key_pre"], pos.cos, pos.sin) if pos is not None else cap["g_key_pre"]
    changes: dict[str, Any] = {}
    for tensor, x, g in (("key", k_post, g_post), ("value", cap["value"], cap["g_value"])):
        spec = getattr(cache, f"{tensor}")
        if spec.is_identity:
            continue
        fitted = []
        for s in getattr(cache, f"{tensor}_transform"):
            t = get_transform(s).fit(x) if get_transform(s).fitted else get_transform(s)
            x, g = t.forward(x, pos), _grad_map(t, g, pos)
            fitted.append(t.spelling)
        changes[f"{tensor}_transform"] = tuple(fitted)
        outliers = cache.outliers(tensor) if tensor == "value" else None
        if tensor == "key" and cache.key_outliers:
            th = fit_thresholds(x, cache.key_outliers)
            changes["key_outlier_thresholds"] = th
            outliers = Outliers(cache.key_outliers, "channel", th)
        fmt = code_format(spec)
        if fmt.fitted:
            changes[tensor] = fmt.fit(spec, x, g, None if outliers is None else outliers.mask(x))
    return replace(cache, layers=(), **changes)


def fit(cache: CacheConfig, caps: list[dict[str, Any]], rope: list | None) -> CacheConfig:
    """The cache config with one fitted config per layer (`CacheConfig.layers`). `rope`: each layer's RopeHelper
    (`layer_ropes`), or None (no RoPE)."""
    ropes = rope if rope is not None else [None] * len(caps)
    return replace(cache, layers=tuple(fit_layer(cache.unfitted(), c, r) for c, r in zip(caps, ropes, strict=True)))


def layer_ropes(model) -> list | None:
    """Each decoder layer's RoPE as the model rotates its keys there: the model's rotary module, asked with the
    layer's type where it takes one (Gemma 3: one base frequency on sliding-window layers, another on global ones);
    None without a rotary module."""
    import inspect

    from kvq_lab.cache.routing.rope import RopeHelper

    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    if rotary is None:
        return None
    text_cfg = model.config.get_text_config(decoder=True)
    n = text_cfg.num_hidden_layers
    if "layer_type" not in inspect.signature(rotary.forward).parameters:
        return [RopeHelper(rotary)] * n
    return [RopeHelper(rotary, t) for t in text_cfg.layer_types]


# -- the run's entry point: text, capture, fit, kept on disk -----------------------------------------------------------
def calibrate(
    model,
    tok,
    cache: CacheConfig,
    s: Mapping[str, Any] | None = None,
    data_dir: Path | None = None,
    model_id: Any = None,
    task: Mapping | None = None,
) -> CacheConfig:
    """The cache config fitted on the calibration text of settings `s` (`settings`: defaults when None; `task`: the
    run's task section, whose windows coqa_stories must not overlap), from the disk cache when this
    (model, method, settings, text, code) was fitted before and the kept file matches its digest; `cache` itself
    when nothing in it is fitted."""

    if not needs_calibration(cache):
        return cache
    s = settings(s)
    text, sha = calibration_text(s, data_dir)
    key = calibration_key(model_id if model_id is not None else model.name_or_path, cache, s, sha)
    path = cache_dir() / f"{key}.pt"
    kept = read_fit(path, cache)
    if kept is not None:
        log.info("calibration: %s (cached, digest verified)", path)
        return kept
    try:
        ids = token_ids(tok, text, s, task)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    caps = capture(model, ids, s["chunk"])
    fitted = fit(cache.unfitted(), caps, layer_ropes(model))
    write_fit(path, fitted, s)
    log.info("calibration: fitted on %d tokens of %s -> %s", ids.shape[1], s["source"], path)
    return fitted
