"""Calibration, the config side (model-free): the `calibration.*` settings, their checks before anything loads, and
the calibration text with its tokens.

Fitted methods (`needs_calibration`): fitted formats (`CodeFormat.fitted`: nuq codebooks, KVQuant; nvfp4's per-tensor
scale), key outlier
thresholds (`key_outliers`), and fitted transforms (`Transform.fitted`: innerq, rotatekv); `kvq_lab.fit.calibration`
fits them. Their text (`calibration.source`) is never the evaluated text:
   - `gsm8k_train` (default): GSM8K *train* questions and answers (`<data_dir>/gsm8k/train.jsonl`, else the hub's
     `openai/gsm8k` train split); no task evaluates the train split (gsm8k scores the test split).
   - `coqa_stories`: the *last* `calibration.tokens` tokens of the CoQA stories text (`task=ppl` scores windows
     from its start: `token_ids` checks the two do not overlap, with the run's tokenizer); refused for the CoQA
     question-answering tasks, which read every story.
   - `file`: `calibration.path`, any UTF-8 text.

The preflight (`kvq_lab.preflight`) calls the checks here (`check_calibration`, `needs_calibration`, `settings`);
`kvq_lab.preflight.model` the ones that need the model's tokenizer alone (`check_text_length`). Nothing here loads a
model; torch is imported inside `token_ids`, so validation stays torch-free.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvq_lab.cache.config import CacheConfig
from kvq_lab.common.errors import ConfigError
from kvq_lab.quant.formats import FORMATS
from kvq_lab.quant.transforms import TRANSFORMS, get_transform
from kvq_lab.tasks.datasets import GSM8K_FILES

SOURCES = ("gsm8k_train", "coqa_stories", "file")
DEFAULTS = {"source": "gsm8k_train", "path": None, "tokens": 2048, "chunk": 512}
GSM8K_TRAIN = Path(GSM8K_FILES["train"])


# -- settings and checks (model-free, before anything loads) -----------------------------------------------------------
def needs_calibration(cache: CacheConfig) -> bool:
    """Some part of the cache is fitted on data: a fitted format (nuq), key outliers, or a fitted transform."""
    return what_is_fitted(cache) is not None


def what_is_fitted(cache: CacheConfig) -> str | None:
    """The first knob that asks for calibration, for messages (`key_format=nuq`); None when nothing is fitted.
    Formats and transforms say whether they are fitted (their `fitted` flag); key outliers are a cache knob."""
    for t, spec in (("key", cache.key), ("value", cache.value)):
        fmt = None if spec.is_identity else FORMATS.get(spec.format, None)
        if fmt is not None and fmt.fitted:
            return f"{t}_format={spec.format}"
    if cache.key_outliers and not cache.key.is_identity:
        return f"key_outliers={cache.key_outliers:g}"
    for t in ("key", "value"):
        for s in getattr(cache, f"{t}_transform"):
            if s.partition(":")[0].partition("@")[0] in TRANSFORMS and get_transform(s).fitted:
                return f"{t}_transform={s}"
    return None


def settings(given: Mapping | None = None) -> dict[str, Any]:
    """The run's calibration settings (its `calibration` section over DEFAULTS), validated: one-line ConfigError."""
    given = dict(given or {})
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"calibration.{unknown[0]} is not a calibration setting; allowed: {', '.join(DEFAULTS)}")
    s = {**DEFAULTS, **given}
    if s["source"] not in SOURCES:
        raise ConfigError(f"calibration.source={s['source']!r}; choose one of: {', '.join(SOURCES)}")
    for key, lo in (("tokens", 64), ("chunk", 16)):
        v = s[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(f"calibration.{key}={v!r} must be an integer >= {lo}")
    if s["source"] == "file":
        p = s["path"]
        if not isinstance(p, str) or not Path(p).expanduser().is_file():
            raise ConfigError(f"calibration.source=file needs calibration.path=<a UTF-8 text file> (got {p!r})")
    return s


def check_calibration(given: Mapping | None, cache: CacheConfig, task: str | None, data_dir: Path | None) -> None:
    """Before any model loads: a fitted method has a calibration source (`given`: the run's calibration section), and
    the source is not the text `task` evaluates (one-line ConfigError)."""
    if not needs_calibration(cache):
        return
    given = given or {}
    if "source" in given and given["source"] is None:
        raise ConfigError(
            f"{what_is_fitted(cache)} is fitted on calibration data: set calibration.source={' | '.join(SOURCES)}"
        )
    s = settings(given)
    if s["source"] == "coqa_stories" and task in ("coqa", "coqa_turns"):
        raise ConfigError(
            f"calibration.source=coqa_stories would fit {what_is_fitted(cache)} on the stories task={task} "
            "evaluates; use calibration.source=gsm8k_train"
        )
    if s["source"] == "gsm8k_train" and data_dir is not None:
        path = Path(data_dir) / GSM8K_TRAIN
        if not path.is_file():
            raise ConfigError(
                f"calibration.source=gsm8k_train: {path} does not exist; give data_dir=<folder with {GSM8K_TRAIN}> "
                "or calibration.source=file calibration.path=<text>"
            )


def data_dir_from_env() -> Path | None:
    """$KVQ_DATA_DIR as a folder, for callers without a run config (lm-eval's `--model kvq`)."""
    d = os.environ.get("KVQ_DATA_DIR")
    return Path(d).expanduser() if d else None


def text_at_hand(s: dict[str, Any], data_dir: Path | None) -> bool:
    """Whether the calibration text can be read without a download (what validation may read before the load)."""
    return s["source"] == "file" or data_dir is not None


def check_text_length(
    s: Mapping[str, Any], cache: CacheConfig, tok, data_dir: Path | None, task: Mapping | None = None
) -> None:
    """ConfigError (one line) when the calibration text has fewer tokens than the fit needs, or (coqa_stories) its
    tail overlaps the windows task=ppl scores; `tok`: the model's tokenizer (validation loads it alone)."""
    if not needs_calibration(cache):
        return
    s = settings(s)
    try:
        token_ids(tok, calibration_text(s, data_dir)[0], s, task)
    except ValueError as e:
        raise ConfigError(str(e)) from None


# -- text ----------------------------------------------------------------------------------------------------------
def calibration_text(s: dict[str, Any], data_dir: Path | None) -> tuple[str, str]:
    """(text, sha256 of the text) of the calibration source; coqa_stories: the whole stories text (its tail is used)."""
    if s["source"] == "file":
        from kvq_lab.tasks.text import read_text_file

        text = read_text_file(s["path"])[0]
    elif s["source"] == "coqa_stories":
        from kvq_lab.tasks.text import coqa_text

        text = coqa_text(data_dir)
    else:
        from kvq_lab.tasks.text import gsm8k_text

        text = gsm8k_text(
            data_dir if data_dir is not None and (data_dir / GSM8K_TRAIN).is_file() else None, "train", 600
        )
    return text, hashlib.sha256(text.encode()).hexdigest()


def token_ids(tok, text: str, s: Mapping[str, Any], task: Mapping | None = None):
    """LongTensor [1, tokens]: the first `tokens` tokens (coqa_stories: the last, after any task=ppl windows, which
    read the head of the same text; ValueError naming the overlap)."""
    import torch

    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    n = s["tokens"]
    if ids.numel() < n:
        raise ValueError(
            f"calibration.source={s['source']} has {ids.numel()} tokens; calibration.tokens={n} needs more: lower "
            "calibration.tokens or give a longer text"
        )
    if s["source"] != "coqa_stories":
        return ids[:n][None]
    t = task or {}
    if t.get("name") == "ppl" and t.get("source") == "coqa_stories":
        used = int(t.get("windows", 0)) * (int(t.get("context_tokens", 0)) + int(t.get("eval_tokens", 0)))
        if used + n > ids.numel():
            raise ValueError(
                f"calibration.source=coqa_stories: the last {n} tokens overlap the {used} that task=ppl scores "
                f"({ids.numel()} in all); lower calibration.tokens to {max(0, ids.numel() - used)} or use gsm8k_train"
            )
    return torch.as_tensor(ids[-n:])[None]
