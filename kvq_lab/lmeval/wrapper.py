"""lm-eval-harness model wrapper: every `generate` call gets a fresh quantized KV cache.

Prefix reuse: CoQA's turns of one story share the story and the turns before, so most of each prompt's prefill
recomputes what the previous turn's computed. `QuantCacheLM` runs the requests in the order of their text (a turn's
prompt is a prefix of the next turn's, so a story's turns come one after another), keeps a checkpoint: a cache filled
with the longest shared token prefix, cut where the cache says cutting changes nothing (`prefix_boundary`: e.g. a whole
number of per-channel groups), extends it with each new prompt, and hands every `generate` a copy of it. The cache
then holds what a prefill of the whole prompt gives (the cache layers guarantee it, tested bit for bit); what the model
computes in two passes instead of one can differ in the last float bits (GEMMs of another shape), as batching does.
Caches that cannot be cut (the packed cache) run as before.

Batches (`batch_size` > 1, greedy decoding, caches that can be stacked): continuous batching over the requests in
that order. Each request is prefilled alone from the checkpoint through its last prompt token, which gives its first
answer token; the first `batch_size` are stacked into one left-padded batch cache (`QuantizedKVCache.stack`: each row
keeps its own quantization state, as in any left-padded batch) and a greedy loop decodes them together: the decode,
which reads all the weights at every step, is shared by the rows. A row leaves as soon as its answer ends, and the
next request takes its place in the running batch (`QuantizedKVCache.admit`), so the batch stays full until the
requests run out, instead of running each fixed batch down to its longest answer. Every row still decodes what it
would alone (tested bit for bit at the cache; end to end up to the model's batched arithmetic). Caches that cannot be
stacked run lm-eval's own batching (one left-padded prefill of the whole prompts, each row stopping at its own stop
string).
"""

from __future__ import annotations

import copy
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from kvq_lab.models.loading import cache_kwarg

log = logging.getLogger("kvq_lab")

LOGLIKELIHOOD_WARNING = (
    "lm-eval %s requests (task(s): %s) score a whole context + continuation in one forward pass and never read a "
    "generation cache: the KV-cache quantization does not reach these scores (they equal the 16-bit model's). "
    "Use generation tasks (generate_until), task=ppl or task=fidelity to measure the cache."
)


@dataclass
class _Row:
    """One request in the continuous batch: its index, prompt and lm-eval's stop strings and token budget."""

    index: int
    context: str
    gen_kwargs: dict
    until: list[str]
    max_gen_toks: int
    tokens: list[int] = field(default_factory=list)  # the answer so far


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
        if int(self.batch_size) > 1 and self.make_cache().stackable and all(self._greedy(r) for r in requests):
            return self._generate_batched(requests, disable_tqdm)
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

    def _greedy(self, request) -> bool:
        return not normalize_gen_kwargs(request.args[1], self.max_gen_toks).get("do_sample")

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        if self.make_cache is not None:
            cache = self.make_cache()
            cache.set_padding(generation_kwargs.get("attention_mask"))
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
    def _generate_batched(self, requests, disable_tqdm: bool) -> list[str]:
        """Continuous batching with prefix reuse (the module docstring): every request of `requests` (greedy) ->
        its answer, as lm-eval's `generate_until` would give it for that request alone."""
        from tqdm import tqdm

        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        pending = deque(sorted(range(len(requests)), key=lambda i: requests[i].args[0]))
        out: list = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="generate (continuous batch)", disable=disable_tqdm or self.rank != 0)

        def start():
            """The next pending request prefilled alone from the checkpoint -> (its cache, its row), or None when
            its first token already ends it (it is answered then and there)."""
            i = pending.popleft()
            context, gen_kwargs = requests[i].args
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.get("until"), eos=eos)
            row = _Row(i, context, gen_kwargs, until, kwargs["max_gen_toks"])
            ids, _ = self.tok_batch_encode(
                [context], left_truncate_len=self.max_length - row.max_gen_toks, truncation=self.truncation
            )
            ids = ids.to(self.device)
            cache = self._from_checkpoint(ids, self.make_cache())
            row.tokens.append(int(self._fill(cache, ids[:, cache.get_seq_length() :])[0, -1].argmax()))
            self.generate_calls += 1
            if self._finished(row):
                finish(row)
                return None
            return cache, row

        def finish(row: _Row) -> None:  # as lm-eval's generate_until turns a row's tokens into its answer
            tokens, think = row.tokens, self.think_end_token
            if isinstance(think, int) and think in tokens:
                tokens = tokens[len(tokens) - tokens[::-1].index(think) :]
            s = self.tok_decode(tokens)
            s = s.lstrip() if isinstance(think, int) else s
            think = think if isinstance(think, str) else None
            out[row.index] = postprocess_generated_text(generation=s, stop=row.until, think_end_token=think)
            self.cache_hook.add_partial("generate_until", (row.context, row.gen_kwargs), out[row.index])
            bar.update(1)

        first: list = []
        while pending and len(first) < int(self.batch_size):
            if (started := start()) is not None:
                first.append(started)
        rows = [r for _, r in first]
        cache = type(first[0][0]).stack([c for c, _ in first]) if first else None
        while rows:
            mask = torch.nn.functional.pad(cache.batch_mask(), (0, 1), value=1)  # the token fed now is real
            positions = mask.sum(1, keepdim=True) - 1
            fed = torch.tensor([[r.tokens[-1]] for r in rows], device=self.device)
            kwargs = {self.cache_kwarg: cache, "use_cache": True, "logits_to_keep": 1}
            logits = self.model(input_ids=fed, attention_mask=mask, position_ids=positions, **kwargs).logits
            for r, t in zip(rows, logits[:, -1].argmax(-1).tolist(), strict=True):
                r.tokens.append(t)
            keep = []
            for b, r in enumerate(rows):
                if not self._finished(r):
                    keep.append(b)
                    continue
                finish(r)
                while pending:  # the next request takes the finished row's place in the batch
                    if (started := start()) is not None:
                        cache.admit(b, started[0])
                        rows[b] = started[1]
                        keep.append(b)
                        break
            if len(keep) < len(rows):
                if not keep:
                    break
                cache.select_rows(keep)
                rows = [rows[b] for b in keep]
            cache.trim_padding()
        bar.close()
        self._checkpoint = None
        return out

    def _finished(self, row: _Row) -> bool:
        """The row's answer ends: its last token is EOS, it holds a stop string, or it has max_gen_toks tokens."""
        if row.tokens[-1] == self.eot_token_id or len(row.tokens) >= row.max_gen_toks:
            return True
        stops = [s for s in row.until if s]
        return bool(stops) and any(s in self.tokenizer.decode(row.tokens) for s in stops)

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
