"""lm-eval-harness model wrapper: every `generate` call gets a fresh quantized KV cache.

Prefix reuse (batch size 1): CoQA's turns of one story share the story and the turns before, so most of each prompt's
prefill recomputes what the previous turn's computed. `QuantCacheLM` runs the requests in the order of their text
(a turn's prompt is a prefix of the next turn's, so a story's turns come one after another), keeps a checkpoint: a
cache filled with the longest shared token prefix, cut where the cache says cutting changes nothing
(`prefix_boundary`: e.g. a whole number of per-channel groups), extends it with each new prompt, and hands every
`generate` a copy of it. The cache then holds what a prefill of the whole prompt gives (the cache layers guarantee
it, tested bit for bit); what the model computes in two passes instead of one can differ in the last float bits
(GEMMs of another shape), as batching does. Caches that cannot be cut (the packed cache) run as before.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import torch
from lm_eval.models.huggingface import HFLM

from kvq_lab.models import cache_kwarg

log = logging.getLogger("kvq_lab")

LOGLIKELIHOOD_WARNING = (
    "lm-eval %s requests (task(s): %s) score a whole context + continuation in one forward pass and never read a "
    "generation cache: the KV-cache quantization does not reach these scores (they equal the 16-bit model's). "
    "Use generation tasks (generate_until), task=ppl or task=fidelity to measure the cache."
)


class QuantCacheLM(HFLM):
    """HFLM over an already loaded model; `make_cache()` builds the cache handed to each `model.generate`.

    The prompt's attention mask is declared to the cache (`set_padding`) so that, in a left-padded batch,
    padding never enters a quantization group's min/max. `make_cache=None` runs with transformers' default cache.
    Loglikelihood requests run as lm-eval runs them (no generation cache); the first one logs one warning saying so.
    """

    # prompt tokens never checkpointed: the next prompt may tokenize a prompt's last tokens differently (`A:` then
    # `A: white`); a mismatch inside the checkpoint would restart it from nothing
    MARGIN = 8

    def __init__(
        self,
        model,
        tokenizer,
        make_cache: Callable | None,
        batch_size: int = 1,
        max_length: int | None = 2048,
        prefix_reuse: bool = True,
    ):
        super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
        self.make_cache = make_cache
        self.generate_calls = 0
        self.loglikelihood_requests = 0
        self.cache_kwarg = cache_kwarg()
        self.prefix_reuse = prefix_reuse and make_cache is not None and batch_size == 1
        self.prefix_tokens = 0  # prompt tokens served from a checkpoint instead of a prefill (reported by tasks)
        self._checkpoint: tuple[list[int], object] | None = None  # (token ids it holds, cache)

    def generate_until(self, requests, disable_tqdm: bool = False):
        if not self.prefix_reuse or len(requests) < 2:
            return super().generate_until(requests, disable_tqdm=disable_tqdm)
        from tqdm import tqdm

        # text order puts a prompt right before the prompts it is a prefix of; results go back in request order
        order = sorted(range(len(requests)), key=lambda i: requests[i].args[0])
        out: list = [None] * len(requests)
        for i in tqdm(order, desc="generate (prefix reuse)", disable=disable_tqdm or self.rank != 0):
            out[i] = super().generate_until([requests[i]], disable_tqdm=True)[0]
        self._checkpoint = None
        return out

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        if self.make_cache is not None:
            cache = self.make_cache()
            cache.set_padding(generation_kwargs.get("attention_mask"))
            if self.prefix_reuse and context.shape[0] == 1:
                cache = self._from_checkpoint(context, cache)
            generation_kwargs[self.cache_kwarg] = cache
        self.generate_calls += 1
        return super()._model_generate(context, max_length, stop, **generation_kwargs)

    @torch.no_grad()
    def _from_checkpoint(self, context: torch.Tensor, fresh):
        """context [1, T] token ids -> a cache holding the longest prefix of them that the checkpoint can give (cut
        at `fresh.prefix_boundary`, `MARGIN` tokens or more before the end), or `fresh` itself.
        The checkpoint follows the prompt: restarted from `fresh` when the prompt does not extend it, else filled
        up to the new cut."""
        ids = context[0].tolist()
        cut_of = getattr(fresh, "prefix_boundary", None)
        cut = 0 if cut_of is None else cut_of(len(ids) - self.MARGIN)
        if cut <= 0:
            return fresh
        held, cache = self._checkpoint or ([], None)
        if cache is None or len(held) >= len(ids) or ids[: len(held)] != held:
            held, cache = [], fresh
        if cut > len(held):
            kwargs = {self.cache_kwarg: cache, "use_cache": True, "logits_to_keep": 1}
            self.model(input_ids=context[:, len(held) : cut], **kwargs)
            held = ids[:cut]
        if not held:  # nothing to reuse: `fresh` goes to generate and must not stay the checkpoint
            self._checkpoint = None
            return fresh
        self._checkpoint = (held, cache)
        self.prefix_tokens += len(held)
        return copy.deepcopy(cache)

    def _warn_no_cache(self, kind: str, requests) -> None:
        if self.loglikelihood_requests == 0 and requests:
            names = sorted({getattr(r, "task_name", None) or "?" for r in requests})
            log.warning(LOGLIKELIHOOD_WARNING, kind, ", ".join(names))
        self.loglikelihood_requests += len(requests)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        self._warn_no_cache("loglikelihood", requests)
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        self._warn_no_cache("loglikelihood_rolling", requests)
        return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
