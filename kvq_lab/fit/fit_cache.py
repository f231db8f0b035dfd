"""Calibration's on-disk fit cache, and the digests that name a fit.

`~/.cache/kvq_lab/calibration/<hash>.pt` ($KVQ_CALIBRATION_CACHE): the hash (`calibration_key`) over the model's
identity, the method's settings (the cache config), the calibration settings and text, and kvq_lab's code version;
each file written with its digest beside it and verified on every read (`kvq_lab.common.integrity`: a changed or
truncated fit is named and fitted again). The fitted parameters' own digest (`fitted_digest`) is part of the run's
inputs and run key. Torch is imported inside the functions that read and write.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from kvq_lab.cache.config import CacheConfig
from kvq_lab.common.spellings import as_hashed
from kvq_lab.quant.transforms import get_transform

from . import calibration_settings, precision_settings
from .calibration_settings import calibration_text


def cache_dir() -> Path:
    return Path(os.environ.get("KVQ_CALIBRATION_CACHE", Path.home() / ".cache" / "kvq_lab" / "calibration"))


def calibration_key(model_id: Any, cache: CacheConfig, s: dict[str, Any], text_sha: str) -> str:
    """Hash of what a fit depends on: model identity, method settings, calibration settings and text, code."""
    from kvq_lab.records.provenance import code_version

    what = {
        "model": model_id,
        "cache": as_hashed(asdict(cache.unfitted())),
        "settings": s,
        "text": text_sha,
        "code": code_version(),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fitted_digest(cache: CacheConfig) -> str | None:
    """16 hex digits identifying every fitted parameter of `cache` (its per-layer configs: codebooks, outlier
    thresholds, fitted transforms by their own digests, per-layer bits), or None when nothing is fitted. A run's
    inputs carry it, so a changed fit is a changed run (`kvq_lab.run.config.RunPlan`)."""
    if not cache.layers:
        return None
    blob = json.dumps([as_hashed(asdict(c)) for c in cache.layers], sort_keys=True, default=str)  # renamed: as before
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def fit_path(cache: CacheConfig, s: Mapping[str, Any], data_dir: Path | None, model_id: Any) -> Path:
    """Where the fit of this (model, method, settings `s`, text, code) is kept in the calibration cache."""
    return cache_dir() / f"{calibration_key(model_id, cache, s, calibration_text(s, data_dir)[1])}.pt"


def read_fit(path: Path, cache: CacheConfig) -> CacheConfig | None:
    """The fitted cache config kept at `path`, verified against its digest (`kvq_lab.common.integrity`); None when there
    is
    none, or when it is unreadable or does not match its digest (then named in one line and removed, to be fitted
    again). Its fitted transforms are registered in this process."""
    import io

    import torch

    from kvq_lab.common import integrity
    from kvq_lab.quant.transforms import register_fitted

    if not path.is_file():
        return None
    try:
        saved = torch.load(io.BytesIO(integrity.read_verified(path)), weights_only=False)  # ours, verified
    except integrity.Corrupt as e:
        integrity.note_rebuild(e, "fitting again")
        integrity.remove(path)
        return None
    for t in saved["transforms"]:
        register_fitted(t)
    return replace(cache.unfitted(), layers=saved["layers"])


def write_fit(path: Path, fitted: CacheConfig, s: dict[str, Any]) -> None:
    import io

    import torch

    from kvq_lab.common import integrity

    transforms = [get_transform(x) for lc in fitted.layers for x in (*lc.key_transform, *lc.value_transform)]
    buf = io.BytesIO()
    torch.save({"layers": fitted.layers, "transforms": [t for t in transforms if t.fitted], "settings": s}, buf)
    integrity.write_verified(path, buf.getvalue())


def fit_pending(cache: CacheConfig, prec: Mapping) -> bool:
    """Whether something of this run is fitted after the model loads (calibration, a per-layer search)."""
    return calibration_settings.needs_calibration(cache) or precision_settings.settings(prec)["name"] == "search"


def kept_fit(cache: CacheConfig, cal: Mapping, prec: Mapping, data_dir: Path | None, model_id) -> CacheConfig | None:
    """The fitted cache from the calibration cache, where this run's fit is kept there and matches its digest
    (read before any model loads, so a rerun finds its completed record at once); None otherwise."""
    if not calibration_settings.needs_calibration(cache) or precision_settings.settings(prec)["name"] == "search":
        return None
    s = calibration_settings.settings(cal)
    if not calibration_settings.text_at_hand(s, data_dir):
        return None
    return read_fit(fit_path(cache, s, data_dir, model_id), cache)
