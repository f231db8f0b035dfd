"""lm-eval-harness model wrapper: every `generate` call gets a fresh quantized KV cache."""

from __future__ import annotations

from collections.abc import Callable

from lm_eval.models.huggingface import HFLM

from kvq_lab.models import cache_kwarg


class QuantCacheLM(HFLM):
    """HFLM over an already loaded model; `make_cache()` builds the cache handed to each `model.generate`.

    The prompt's attention mask is declared to the cache (`set_padding`) so that, in a left-padded batch,
    padding never enters a quantization group's min/max. `make_cache=None` runs with transformers' default cache.
    """

    def __init__(self, model, tokenizer, make_cache: Callable | None, batch_size: int = 1, max_length: int = 2048):
        super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
        self.make_cache = make_cache
        self.generate_calls = 0
        self.cache_kwarg = cache_kwarg()

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        if self.make_cache is not None:
            cache = self.make_cache()
            cache.set_padding(generation_kwargs.get("attention_mask"))
            generation_kwargs[self.cache_kwarg] = cache
        self.generate_calls += 1
        return super()._model_generate(context, max_length, stop, **generation_kwargs)
