"""Calibration: the data that fitted methods learn from, fitted once per (model, method, settings, code version).

Fitted methods (`needs_calibration`): fitted formats (`CodeFormat.fitted`: nuq codebooks, KVQuant), key outlier
thresholds (`key_outliers`), and fitted transforms (`Transform.fitted`: innerq, rotatekv). One mechanism serves all
of them:

1. Text (`calibration.source`), never the evaluated text:
   - `gsm8k_train` (default): GSM8K *train* questions and answers (`<data_dir>/gsm8k/train.jsonl`, else the hub's
     `openai/gsm8k` train split); no task evaluates the train split (gsm8k scores the test split).
   - `coqa_stories`: the *last* `calibration.tokens` tokens of the CoQA stories text (`task=ppl` scores windows
     from its start: calibration checks the two do not overlap, with the run's tokenizer); refused for the CoQA
     question-answering tasks, which read every story.
   - `file`: `calibration.path`, any UTF-8 text.
2. Capture (`capture`): the first `calibration.tokens` tokens (default 2048), in chunks of `calibration.chunk`
   (512), through the model with hooks on each layer's k_proj and v_proj: pre-RoPE keys and values
   [1, H_kv, T, D]; post-RoPE keys by the model's own rotation at the chunk's positions. One backward pass of the
   next-token loss per chunk gives each element's gradient g: KVQuant's sensitivity is the Fisher information
   approximation g^2 (used here as the k-means weight of nuq; the other fits use magnitudes only).
3. Fit (`fit`), per layer and tensor, in the order the quantizer sees the tensor: the transforms in their order
   (a fitted one fits on the tensor as it arrives there: rotatekv after rope_pre sees pre-RoPE keys), gradients
   mapped alongside (g M^-T: `fold_query` of a foldable map, `forward` of rope_pre, both exact for these maps);
   then key outlier thresholds (`kvq_lab.quant.outliers.fit_thresholds`); then a fitted format's `fit` (nuq: a
   codebook on the group-normalized values with weights g^2 * range^2, outliers excluded).
   The result is a `CacheConfig` with one config per layer (`layers`): a fitted format becomes the spec its `fit`
   returns (nuq: `lut` with the fitted codebook), fitted transforms are named by their `name@digest` spellings.
4. Cache: `~/.cache/kvq_lab/calibration/<hash>.pt` ($KVQ_CALIBRATION_CACHE), the hash over the model's identity,
   the method's settings (the cache config), the calibration settings and text, and kvq_lab's code version; written
   with its digest beside it and verified on every read (a changed or truncated fit is named and fitted again).
   The fitted parameters' own digest (`fitted_digest`) is part of the run's inputs and run key.

Layering: above `models`/`cache`/`eval` (it runs the model on text), below `config` (whose validation calls the
model-free checks here: `check_calibration`, `needs_calibration`); formats and transforms receive plain tensors.
Torch and transformers are imported inside functions, so validation stays torch-free.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from kvq_lab.cache.config import CacheConfig
from kvq_lab.common.errors import ConfigError
from kvq_lab.quant.formats import FORMATS
from kvq_lab.quant.transforms import TRANSFORMS, get_transform

log = logging.getLogger("kvq_lab")

SOURCES = ("gsm8k_train", "coqa_stories", "file")
DEFAULTS = {"source": "gsm8k_train", "path": None, "tokens": 2048, "chunk": 512}
GSM8K_TRAIN = Path("gsm8k") / "train.jsonl"
GSM8K_HUB = ("openai/gsm8k", "main", "train")


def needs_calibration(cache: CacheConfig) -> bool:
    """Some part of the cache is fitted on data: a fitted format (nuq), key outliers, or a fitted transform."""
    return what_is_fitted(cache) is not None


def what_is_fitted(cache: CacheConfig) -> str | None:
    """The first knob that asks for calibration, for messages (`key_format=nuq`); None when nothing is fitted.
    Formats and transforms say whether they are fitted (their `fitted` flag); key outliers are a cache knob."""
    for t, spec in (("key", cache.key), ("value", cache.value)):
        fmt = None if spec.is_identity else FORMATS.get(spec.format)
        if fmt is not None and fmt.fitted:
            return f"{t}_format={spec.format}"
    if cache.key_outliers and not cache.key.is_identity:
        return f"key_outliers={cache.key_outliers:g}"
    for t in ("key", "value"):
        for s in getattr(cache, f"{t}_transform"):
            if TRANSFORMS.get(s.partition(":")[0].partition("@")[0]) is not None and get_transform(s).fitted:
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
        rows = _gsm8k_train(data_dir)
        text = "\n\n".join(f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows)
    return text, hashlib.sha256(text.encode()).hexdigest()


def _gsm8k_train(data_dir: Path | None, n: int = 600) -> list[dict]:
    """The first n GSM8K train rows (~100 tokens each), from the data dir, else the hub."""
    if data_dir is not None and (data_dir / GSM8K_TRAIN).is_file():
        lines = (data_dir / GSM8K_TRAIN).read_text().splitlines()
        return [json.loads(x) for x in lines[:n] if x.strip()]
    import datasets

    return list(datasets.load_dataset(GSM8K_HUB[0], GSM8K_HUB[1], split=f"{GSM8K_HUB[2]}[:{n}]"))


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


# -- capture -------------------------------------------------------------------------------------------------------
def capture(model, ids, chunk: int) -> list[dict[str, Any]]:
    """Per decoder layer: {"key_pre", "value", "g_key_pre", "g_value"}, fp32 [1, H_kv, T, D] on the CPU, and
    "positions" [1, T]. Llama-style models (`model.model.layers[i].self_attn.k_proj / v_proj`)."""
    import torch
    from tqdm.auto import tqdm

    text_cfg = model.config.get_text_config(decoder=True)
    H = text_cfg.num_key_value_heads
    D = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(hasattr(m.self_attn, "k_proj") and hasattr(m.self_attn, "v_proj") for m in layers):
        raise ValueError(
            f"calibration reads k_proj/v_proj of model.model.layers[i].self_attn (Llama-style); "
            f"{type(model).__name__} has another layout"
        )
    live: list[tuple[int, str, torch.Tensor]] = []

    def hook(i, name):
        def fn(module, args, out):
            out.retain_grad()
            live.append((i, name, out))

        return fn

    def leaf(module, args, out):  # gradients flow from the embeddings: no parameter needs one
        return out.detach().requires_grad_(True)

    handles = [model.model.embed_tokens.register_forward_hook(leaf)]
    for i, layer in enumerate(layers):
        handles.append(layer.self_attn.k_proj.register_forward_hook(hook(i, "key_pre")))
        handles.append(layer.self_attn.v_proj.register_forward_hook(hook(i, "value")))
    grads = {id(p): p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    out: list[dict[str, Any]] = [{"key_pre": [], "value": [], "g_key_pre": [], "g_value": []} for _ in layers]
    try:
        with torch.enable_grad():
            starts = range(0, ids.shape[1], chunk)
            for c0 in tqdm(starts, desc="calibration", unit="chunk", leave=False):
                live.clear()
                x = ids[:, c0 : c0 + chunk].to(model.device)
                logits = model(x, use_cache=False).logits
                loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), x[0, 1:])
                loss.backward()
                for i, name, t in live:  # [1, T, H * D] -> [1, H, T, D]
                    T = t.shape[1]
                    out[i][name].append(t.detach().float().view(1, T, H, D).transpose(1, 2).cpu())
                    out[i]["g_" + name].append(t.grad.float().view(1, T, H, D).transpose(1, 2).cpu())
    finally:
        for h in handles:
            h.remove()
        for p in model.parameters():
            p.requires_grad_(grads[id(p)])
    # each chunk is its own sequence (positions restart): its keys were rotated at 0..chunk-1
    pos = torch.cat([torch.arange(min(chunk, ids.shape[1] - c0)) for c0 in range(0, ids.shape[1], chunk)])
    return [{k: torch.cat(v, 2) for k, v in d.items()} | {"positions": pos[None]} for d in out]


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


def fit(cache: CacheConfig, caps: list[dict[str, Any]], rope) -> CacheConfig:
    """The cache config with one fitted config per layer (`CacheConfig.layers`)."""
    return replace(cache, layers=tuple(fit_layer(cache.unfitted(), c, rope) for c in caps))


# -- the run's entry point, cached on disk -------------------------------------------------------------------------
def cache_dir() -> Path:
    return Path(os.environ.get("KVQ_CALIBRATION_CACHE", Path.home() / ".cache" / "kvq_lab" / "calibration"))


def calibration_key(model_id: Any, cache: CacheConfig, s: dict[str, Any], text_sha: str) -> str:
    """Hash of what a fit depends on: model identity, method settings, calibration settings and text, code."""
    from kvq_lab.records.provenance import code_version

    what = {
        "model": model_id,
        "cache": asdict(cache.unfitted()),
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
    blob = json.dumps([asdict(c) for c in cache.layers], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def text_at_hand(s: dict[str, Any], data_dir: Path | None) -> bool:
    """Whether the calibration text can be read without a download (what validation may read before the load)."""
    return s["source"] == "file" or data_dir is not None


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
    from kvq_lab.cache.rope import RopeHelper

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
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    caps = capture(model, ids, s["chunk"])
    fitted = fit(cache.unfitted(), caps, RopeHelper(rotary) if rotary is not None else None)
    write_fit(path, fitted, s)
    log.info("calibration: fitted on %d tokens of %s -> %s", ids.shape[1], s["source"], path)
    return fitted
