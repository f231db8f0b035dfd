"""lm-eval-harness model wrapper: every `generate` call gets a fresh quantized KV cache.

Prefix reuse: CoQA's turns of one story share the story and the turns before, so most of each prompt's prefill
recomputes what the previous turn's computed. `QuantCacheLM` runs the requests in the order of their text (a turn's
prompt is a prefix of the next turn's, so a story's turns come one after another), keeps a checkpoint: a cache filled
with the longest shared token prefix, cut where the cache says cutting changes nothing (`prefix_boundary`: e.g. a whole
number of per-channel groups), extends it with each new prompt, and hands every `generate` a copy of it. The cache
then holds what a prefill of the whole prompt gives (the cache layers guarantee it, tested bit for bit); what the model
computes in two passes instead of one can differ in the last float bits (GEMMs of another shape), as batching does.
Caches that cannot be cut (the packed cache) run as before.

Batches (`batch_size` > 1) of consecutive requests in that order (greedy decoding): each row is prefilled alone from
the checkpoint through its last prompt token, which gives its first answer token; the rows' caches are stacked into
one left-padded batch cache (`QuantizedKVCache.stack`: each row keeps its own quantization state, as in any
left-padded batch), and a greedy loop decodes the batch from there: the decode, which reads all the weights at every
step, is shared by the rows, and a row leaves the batch when its answer ends. Caches that cannot be stacked run
lm-eval's own batching (one left-padded prefill of the whole prompts, each row stopping at its own stop string).
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
        self.prefix_reuse = prefix_reuse and make_cache is not None
        self.prefix_tokens = 0  # prompt tokens served from a checkpoint instead of a prefill (reported by tasks)
        self._checkpoint: tuple[list[int], object] | None = None  # (token ids it holds, cache)

    def generate_until(self, requests, disable_tqdm: bool = False):
        if not self.prefix_reuse or len(requests) < 2:
            return super().generate_until(requests, disable_tqdm=disable_tqdm)
        from tqdm import tqdm

        # text order puts a prompt right before the prompts it is a prefix of; results go back in request order
        order = sorted(range(len(requests)), key=lambda i: requests[i].args[0])
        bs = int(self.batch_size)
        out: list = [None] * len(requests)
        with tqdm(total=len(order), desc="generate (prefix reuse)", disable=disable_tqdm or self.rank != 0) as bar:
            for start in range(0, len(order), bs):
                chunk = order[start : start + bs]
                answers = super().generate_until([requests[i] for i in chunk], disable_tqdm=True)
                for i, answer in zip(chunk, answers, strict=True):
                    out[i] = answer
                bar.update(len(chunk))
        self._checkpoint = None
        return out

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        if self.make_cache is not None:
            mask = generation_kwargs.get("attention_mask")
            stacked = None
            if self.prefix_reuse and context.shape[0] > 1 and not generation_kwargs.get("do_sample"):
                stacked = self._stacked(context, mask)
            if stacked is not None:
                self.generate_calls += 1
                return self._decode(*stacked, context, mask, max_length, stop)
            else:
                cache = self.make_cache()
                cache.set_padding(mask)
                if self.prefix_reuse and context.shape[0] == 1:
                    cache = self._from_checkpoint(context, cache)
            generation_kwargs[self.cache_kwarg] = cache
        if context.shape[0] > 1:
            # lm-eval's stop criteria end a batch only when every row has met the same stop string, so finished rows
            # run on to max_gen_toks (costly, and the text after a first "\n\n" can hold "\nQ:", which then cuts
            # the answer elsewhere); transformers' stop strings finish each row at its own
            generation_kwargs["stop_strings"] = [s for s in stop if s]
            generation_kwargs["tokenizer"] = self.tokenizer
        self.generate_calls += 1
        return super()._model_generate(context, max_length, stop, **generation_kwargs)

    @torch.no_grad()
    def _decode(self, cache, first, context, mask, max_length: int, stop: list[str]) -> torch.Tensor:
        """Greedy decoding of a stacked batch (`_stacked`): cache holding every row's prompt, first [B] each row's first
        token, context [B, T] the left-padded prompts -> [B, <= max_length] prompts and continuations (finished rows
        padded). A row leaves the batch (`select_rows`) as soon as its continuation holds a stop string or ends with
        EOS, as it would stop alone: the batch shares each step's weight reads among the rows still generating."""
        B, T = context.shape
        stops = [s for s in stop if s]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
        out = torch.full((B, max_length), pad, dtype=context.dtype, device=context.device)
        out[:, :T], out[:, T] = context, first
        n = T + 1

        def finished(b: int) -> bool:
            cont = out[b, T:n]
            return int(cont[-1]) == self.eot_token_id or any(s in self.tokenizer.decode(cont) for s in stops)

        seen = (torch.ones_like(context) if mask is None else mask).long()  # [B, T] 1 = real token
        seen = torch.cat([seen, seen.new_ones(B, 1)], dim=1)
        active = list(range(B))
        while True:
            keep = [i for i, b in enumerate(active) if not finished(b)]
            if len(keep) < len(active):
                active = [active[i] for i in keep]
                if active:
                    cache.select_rows(keep)
                    seen = seen[keep]
            if not active or n >= max_length:
                return out[:, :n]
            kwargs = {self.cache_kwarg: cache, "use_cache": True, "logits_to_keep": 1}
            positions = seen.sum(1, keepdim=True) - 1  # each row's position of the token it is fed
            logits = self.model(input_ids=out[active, n - 1 : n], attention_mask=seen, position_ids=positions, **kwargs)
            out[active, n] = logits.logits[:, -1].argmax(-1)
            n += 1
            seen = torch.cat([seen, seen.new_ones(len(active), 1)], dim=1)

    @torch.no_grad()
    def _stacked(self, context: torch.Tensor, mask: torch.Tensor | None):
        """context [B, T] left-padded token ids, mask [B, T] (1 = token) -> (a batch cache holding every row's whole
        prompt, each row filled alone from the checkpoint; [B] the greedy first token of each row), or None where the
        cache cannot be stacked. The whole prompt, not all but its last token: a cut before the last token could
        split a per-channel group (`prefix_boundary`), so the first token comes from each row's own prefill."""
        B, T = context.shape
        lengths = [T] * B if mask is None else mask.sum(1).tolist()
        if not self.make_cache().stackable:
            return None
        rows: list = [None] * B
        first = torch.empty(B, dtype=context.dtype, device=context.device)
        # text order within the batch too: each row extends the checkpoint its predecessor left
        for b in sorted(range(B), key=lambda b: context[b, T - lengths[b] :].tolist()):
            ids = context[b : b + 1, T - lengths[b] :]
            cache = self._from_checkpoint(ids, self.make_cache())
            logits = self._fill(cache, ids[:, cache.get_seq_length() :])
            first[b] = logits[0, -1].argmax()
            rows[b] = cache
        return type(rows[0]).stack(rows), first

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
            self._fill(cache, context[:, len(held) : cut])
            held = ids[:cut]
        if not held:  # nothing to reuse: `fresh` goes to generate and must not stay the checkpoint
            self._checkpoint = None
            return fresh
        self._checkpoint = (held, cache)
        self.prefix_tokens += len(held)
        return copy.deepcopy(cache)

    def _fill(self, cache, ids: torch.Tensor) -> torch.Tensor:
        """Run the model over ids [1, n] after what `cache` holds, filling it -> logits of the last token [1, 1, V]."""
        return self.model(input_ids=ids, **{self.cache_kwarg: cache, "use_cache": True, "logits_to_keep": 1}).logits

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
