"""Decode-mode perplexity: teacher-forced, token by token, through the quantized cache.

A log-likelihood pass over a whole text never reads a generation cache (all positions attend within one
forward), so cache quantization would not reach the score. Here each window of `context_tokens +
eval_tokens` consecutive tokens is scored as a generation would see it:

1. prefill: the context goes through the model once. `prompt_forward: exact` (default) runs it with exact
   attention (a plain `DynamicCache`) and then hands every layer's exact K/V to a fresh quantized cache, as KIVI's
   real cache does; `prompt_forward: cache` runs the prefill forward through the quantized cache itself, which reads
   what the cache's own `prefill` knob says (in `simulated` mode fake-quantized K/V, as KIVI's Table 1).
2. decode: the evaluation tokens are fed one at a time (teacher forcing); each step attends to the cache as the
   quantizer left it, and the NLL of the next true token is accumulated. Only these tokens are scored (the
   first is predicted by the prefill's last logits).

All windows run as one batch (same length, no padding; quantization groups never cross batch rows, so this
equals running them one by one). Source text (`task.source`, kvq_lab/tasks/text.py): the CoQA stories, any UTF-8
file, or a hub dataset, cut into consecutive non-overlapping windows. Where the model's tokenizer adds a BOS, each
window's first token is replaced by it (as llama.cpp's chunks, kvq_lab/tasks/chunks.py): a model that always saw
one at position 0 is scored as it runs (Gemma-3-270M's 16-bit ppl is ~3x higher without); SmolLM2 adds none.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from kvq_lab.cache import NonFiniteError
from kvq_lab.models.loading import cache_kwarg
from kvq_lab.tasks.chunks import bos_to_add
from kvq_lab.tasks.text import check_source, source_text

PROMPT_FORWARD = ("exact", "cache")  # who runs the prompt's forward: the model alone | the cache


def make_windows(ids: list[int], context: int, eval_tokens: int, windows: int, bos: int | None = None) -> torch.Tensor:
    """Consecutive non-overlapping windows of `context + eval_tokens` ids -> [windows, context + eval_tokens], each
    window's first token replaced by `bos` when given (`chunks.bos_to_add`: the tokenizer adds one)."""
    n = context + eval_tokens
    if len(ids) < n * windows:
        raise ValueError(
            f"the source text has {len(ids)} tokens; {windows} windows of {context}+{eval_tokens} need {n * windows}: "
            "lower task.windows, task.context_tokens or task.eval_tokens"
        )
    out = torch.tensor(ids[: n * windows]).view(windows, n)
    if bos is not None:
        out[:, 0] = bos
    return out


def text_windows(ctx) -> torch.Tensor:
    """The run's windows [windows, context + eval tokens] on the model's device: its text (`task.source`) through its
    tokenizer, `task.windows` capped by `limit`, each window starting with the BOS where the tokenizer adds one."""
    t = ctx.cfg.task
    windows = int(t.windows) if ctx.limit is None else min(int(t.windows), ctx.limit)
    ids = ctx.tokenizer(source_text(t, ctx.data_dir), add_special_tokens=False)["input_ids"]
    batch = make_windows(ids, int(t.context_tokens), int(t.eval_tokens), windows, bos_to_add(ctx.tokenizer))
    return batch.to(ctx.model.device)


def check_logits(logits: torch.Tensor, step: int, what: str) -> None:
    if not torch.isfinite(logits).all():
        raise NonFiniteError(
            f"non-finite logits (NaN/inf) at decode step {step} ({what}); the cache check did not fire, so the "
            "cause is outside the KV cache (weights, activations or dtype overflow)"
        )


# Exact prefills of the current prompts, shared by the runs of one process (a sweep over caches at one length pays
# each prefill once; retrieval, ppl and fidelity all prefill through here): (model, ids) -> (K/V per layer
# [B, H_kv, T, D] each, last-position logits [B, V]). Bounded in bytes (SmolLM2 at 8192 tokens: 377 MB a prompt;
# Gemma-3-270M at 32768: 1.2 GB). When full, a new prompt is computed but not kept: a sweep visits the same prompts
# in the same order, and least-recently-used eviction would then drop each prompt just before its next use and never
# hit once the prompts outgrow the bound; keeping the first ones hits for all of them every run.
_PREFILLS: dict[tuple, tuple[list, torch.Tensor]] = {}
PREFILL_MEMO_BYTES = 4 * 2**30


def _prefill_bytes(entry) -> int:
    return sum(k.numel() * k.element_size() * 2 for k, _ in entry[0])


def exact_prefill(model, ids: torch.Tensor) -> tuple[list, torch.Tensor]:
    """ids [B, T] -> (per-layer (keys, values) of an exact DynamicCache prefill, logits [B, V] of the last position);
    memoized per (model, ids) within the process, up to PREFILL_MEMO_BYTES. Callers must not modify the tensors."""
    key = (id(model), model.name_or_path, tuple(ids.shape), ids.cpu().numpy().tobytes())
    if key in _PREFILLS:
        return _PREFILLS[key]
    dyn = DynamicCache()
    logits = model(input_ids=ids, **{cache_kwarg(): dyn}, use_cache=True, logits_to_keep=1).logits[:, -1].float()
    out = ([(layer.keys, layer.values) for layer in dyn.layers], logits)
    if sum(_prefill_bytes(e) for e in _PREFILLS.values()) + _prefill_bytes(out) <= PREFILL_MEMO_BYTES:
        _PREFILLS[key] = out
    return out


def prefill(model, cache, context: torch.Tensor, exact: bool) -> torch.Tensor:
    """Fill `cache` with the context [B, T0]; -> logits [B, V] of the last context position. `exact`: exact attention
    (the memoized `exact_prefill`), then every layer's K/V handed to the cache, as KIVI's real cache does."""
    # mode=recompute: its prefill attention is exact too; prefill=quantized or policy=fakequant: attention reads the
    # cache's K/V (`CacheConfig.quantizes_prefill`)
    if (
        not exact
        or getattr(cache, "needs_forward", False)
        or getattr(getattr(cache, "cfg", None), "quantizes_prefill", False)
    ):
        out = model(input_ids=context, **{cache_kwarg(): cache}, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()
    kv, logits = exact_prefill(model, context)
    for i, (k, v) in enumerate(kv):
        # post-RoPE K/V [B, H_kv, T0, D] at positions 0..T0-1 (the cache derives cos/sin for rope=pre itself); clones:
        # the memo's tensors must outlive this cache unchanged
        cache.update(k.clone(), v.clone(), i, {})
    return logits


def teacher_forced_logits(model, cache, windows: torch.Tensor, context: int, exact_prefill: bool) -> Iterator:
    """windows [B, T0 + N] -> yields (step, logits [B, V] predicting token T0 + step), step = 0..N-1, each computed
    through `cache` after the true tokens before it were fed. NaN/inf logits raise, naming the step."""
    total = windows.shape[1]
    kw = cache_kwarg()
    logits = prefill(model, cache, windows[:, :context], exact_prefill)
    check_logits(logits, 0, "prefill")
    for step, t in enumerate(range(context, total)):
        yield step, logits
        if t + 1 == total:
            break
        logits = model(input_ids=windows[:, t, None], **{kw: cache}, use_cache=True).logits[:, -1].float()
        check_logits(logits, step + 1, f"after feeding token {t} of each window")


def decode_nll(
    model, cache, windows: torch.Tensor, context: int, exact_prefill: bool = True, progress=None
) -> torch.Tensor:
    """windows [B, T0 + N] token ids -> NLL [B, N] of tokens T0..T0+N-1, each predicted through the cache.
    `progress` (optional, with a `done` attribute) counts the scored tokens per window as they come."""
    B, total = windows.shape
    nll = []
    steps = tqdm(
        teacher_forced_logits(model, cache, windows, context, exact_prefill),
        total=total - context,
        desc=f"decode ppl ({B} windows)",
        mininterval=10,
        leave=False,
    )
    for step, logits in steps:
        nll.append(torch.nn.functional.cross_entropy(logits, windows[:, context + step], reduction="none"))
        if progress is not None:
            progress.done = step + 1
    return torch.stack(nll, dim=1)


def check_options(task_cfg) -> None:
    """Validate `conf/task/ppl.yaml` options before any model loads (raises ValueError with the fix)."""
    for key in ("context_tokens", "eval_tokens", "windows"):
        v = task_cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"task.{key}={v!r} must be an integer >= 1")
    if task_cfg.get("prompt_forward") not in PROMPT_FORWARD:
        got = task_cfg.get("prompt_forward")
        raise ValueError(f"task.prompt_forward={got!r}; choose one of: {', '.join(PROMPT_FORWARD)}")
    check_source(task_cfg)


def run_ppl(ctx) -> dict[str, float]:
    """Task entry point: metrics `ppl/ppl`, `ppl/nll` (mean, nats/token), `ppl/n_tokens`, `ppl/windows`."""
    t = ctx.cfg.task
    context, eval_tokens = int(t.context_tokens), int(t.eval_tokens)
    batch = text_windows(ctx)
    windows = batch.shape[0]
    cache = ctx.make_cache() or DynamicCache()
    ctx.progress.unit, ctx.progress.total = "decode steps", eval_tokens
    nll = decode_nll(
        ctx.model, cache, batch, context, exact_prefill=str(t.prompt_forward) == "exact", progress=ctx.progress
    )
    per_window = nll.mean(dim=1)
    ctx.artifacts["ppl_per_window"] = [round(math.exp(float(x)), 4) for x in per_window]
    mean = float(nll.mean())
    return {"ppl/ppl": math.exp(mean), "ppl/nll": mean, "ppl/n_tokens": int(nll.numel()), "ppl/windows": windows}
