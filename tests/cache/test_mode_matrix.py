"""Every registered cache mode (`kvq_lab.cache.LAYERS`), driven by the registry: a new mode is covered with no edit.
At 16 bits each is exact (DynamicCache's greedy tokens); at 2 bits each changes what attention sees."""

import pytest
import torch
from helpers_models import gen
from transformers import DynamicCache

from kvq_lab.cache import LAYERS, CacheConfig, QuantizedKVCache
from kvq_lab.cache.config import MODES
from kvq_lab.quant.spec import QuantSpec


def test_every_mode_the_config_accepts_has_a_layer():
    assert set(MODES) == set(LAYERS)


def _cache(model, mode: str, bits: int) -> QuantizedKVCache:
    cfg = CacheConfig(
        key=QuantSpec(bits, 32, "channel"), value=QuantSpec(bits, 32, "token"), mode=mode, backend="torch"
    )
    return QuantizedKVCache.for_model(model, cfg)


@pytest.mark.parametrize("mode", sorted(LAYERS))
def test_16_bits_is_exact_and_2_bits_is_not(tiny, mode):
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    ref = gen(tiny, DynamicCache(config=tiny.config), ids)
    assert torch.equal(gen(tiny, _cache(tiny, mode, 16), ids), ref)
    with torch.no_grad():
        exact = tiny(ids, past_key_values=DynamicCache(config=tiny.config)).logits[0, -1]
        step = tiny(ids[:, :-1], past_key_values=(c := _cache(tiny, mode, 2))).logits
        last = tiny(ids[:, -1:], past_key_values=c).logits[0, -1]
    assert step.isfinite().all() and not torch.allclose(last, exact, atol=1e-4)
