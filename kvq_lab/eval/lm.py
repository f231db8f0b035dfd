"""lm-eval-harness model wrapper: every `generate` call gets a fresh quantized KV cache."""

from __future__ import annotations

import logging
from collections.abc import Callable

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

    def __init__(
        self, model, tokenizer, make_cache: Callable | None, batch_size: int = 1, max_length: int | None = 2048
    ):
        super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
        self.make_cache = make_cache
        self.generate_calls = 0
        self.loglikelihood_requests = 0
        self.cache_kwarg = cache_kwarg()

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        if self.make_cache is not None:
            cache = self.make_cache()
            cache.set_padding(generation_kwargs.get("attention_mask"))
            generation_kwargs[self.cache_kwarg] = cache
        self.generate_calls += 1
        return super()._model_generate(context, max_length, stop, **generation_kwargs)

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
