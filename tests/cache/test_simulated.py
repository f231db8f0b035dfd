"""The simulated cache: the 16-bit oracle, incremental fake quant == reference on the whole history, RoPE order,
sinks, padding, and non-finite detection."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvq_lab.cache import CacheConfig, NonFiniteError, QuantizedKVCache
from kvq_lab.cache.routing.rope import RopeHelper
from kvq_lab.quant import QuantSpec, fake_quant

FP = QuantSpec(16, 32, "token")


def sim(kb=2, vb=2, ka="channel", va="token", g=32, **kw) -> CacheConfig:
    return CacheConfig(key=QuantSpec(kb, g, ka), value=QuantSpec(vb, g, va), **kw)


def generate(model, ids, cache=None, n=24):
    kw = {} if cache is None else {"past_key_values": cache}
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)


@pytest.mark.parametrize("rope", ["post", "pre"])
def test_16bit_cache_reproduces_dynamic_cache(tiny_model, rope):
    ids = torch.randint(3, 256, (1, 45), generator=torch.Generator().manual_seed(1))
    ref = generate(tiny_model, ids, DynamicCache(config=tiny_model.config))
    ours = generate(tiny_model, ids, QuantizedKVCache.for_model(tiny_model, CacheConfig(FP, FP, rope=rope)))
    assert torch.equal(ref, ours)


def test_2bit_cache_changes_generations(tiny_model):
    """The oracle test above would pass for a cache that ignores its quantizer; this one would not."""
    ids = torch.randint(3, 256, (1, 45), generator=torch.Generator().manual_seed(1))
    ref = generate(tiny_model, ids)
    ours = generate(tiny_model, ids, QuantizedKVCache.for_model(tiny_model, sim(2, 2, "token", "channel")))
    assert not torch.equal(ref, ours)


@pytest.mark.parametrize("ka,va", [("channel", "token"), ("token", "channel"), ("channel", "channel")])
@pytest.mark.parametrize("sinks", [0, 5])
def test_incremental_view_equals_reference_on_whole_history(ka, va, sinks):
    """Step by step (prefill of 37, then 40 single tokens), what the layer returns equals fake_quant of the full
    exact history (groups aligned after the sinks, partial group zero-padded): full groups are never recomputed,
    yet nothing drifts."""
    cfg = sim(2, 3, ka, va, g=8, sink_tokens=sinks)
    cache = QuantizedKVCache(cfg, num_layers=1)
    g = torch.Generator().manual_seed(0)
    ks, vs = [], []
    for t in [37] + [1] * 40:
        k, v = torch.randn(2, 3, t, 16, generator=g), torch.randn(2, 3, t, 16, generator=g)
        ks.append(k)
        vs.append(v)
        K, V = cache.update(k, v, 0)
        allk, allv = torch.cat(ks, 2), torch.cat(vs, 2)
        expk = torch.cat([allk[..., :sinks, :], fake_quant(allk[..., sinks:, :], cfg.key)], 2)
        expv = torch.cat([allv[..., :sinks, :], fake_quant(allv[..., sinks:, :], cfg.value)], 2)
        assert torch.equal(K, expk) and torch.equal(V, expv)
    assert cache.get_seq_length() == 77


def test_pre_rope_keys_are_quantized_before_rotation(tiny_model):
    cfg = sim(2, 16, "channel", "token", rope="pre")
    cache = QuantizedKVCache.for_model(tiny_model, cfg)
    rope = RopeHelper(tiny_model.model.rotary_emb)
    g = torch.Generator().manual_seed(0)
    pre = torch.randn(1, 2, 40, 64, generator=g)
    pos = torch.arange(40)[None]
    cos, sin = rope.cos_sin(pre, pos)
    post = rope.rotate(pre, cos, sin)
    K, _ = cache.update(post, torch.randn(1, 2, 40, 64, generator=g), 0, kwargs={"position_ids": pos})
    expected = rope.rotate(fake_quant(rope.unrotate(post, cos, sin), cfg.key), cos, sin)
    assert torch.allclose(K, expected, atol=1e-6)
    # and it differs from quantizing after RoPE, so the knob does something
    assert not torch.allclose(K, fake_quant(post, cfg.key), atol=1e-3)


def test_padding_never_enters_groups():
    """A left-padded row sees the same quantized keys for its real tokens as the same row alone (per-token groups
    here; every axis, sink and RoPE setting: tests/cache/test_simulated_padding.py)."""
    cfg = sim(2, 2, "token", "token", g=8)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 10, 16, generator=g), torch.randn(1, 2, 10, 16, generator=g)
    alone = QuantizedKVCache(cfg, num_layers=1)
    Ka, Va = alone.update(k, v, 0)
    padded = QuantizedKVCache(cfg, num_layers=1)
    padded.set_padding(torch.tensor([[0, 0, 0] + [1] * 10]))
    pk = torch.cat([torch.full((1, 2, 3, 16), 1e3), k], 2)
    Kp, Vp = padded.update(pk, torch.cat([torch.full((1, 2, 3, 16), -1e3), v], 2), 0)
    assert torch.equal(Kp[..., 3:, :], Ka) and torch.equal(Vp[..., 3:, :], Va)


def test_non_finite_names_layer_and_step():
    cache = QuantizedKVCache(sim(), num_layers=3)
    k = torch.randn(1, 1, 4, 32)
    cache.update(k, k, 2)
    k[0, 0, 1, 3] = float("nan")
    with pytest.raises(NonFiniteError, match="layer 2, step 1"):
        cache.update(k, k, 2)


def test_group_size_must_divide_head_dim(tiny_model):
    from kvq_lab.quant import QuantConfigError

    with pytest.raises(QuantConfigError, match="group_size.*does not divide head_dim=64"):
        QuantizedKVCache.for_model(tiny_model, sim(2, 2, "channel", "token", g=48))
    QuantizedKVCache.for_model(tiny_model, sim(2, 2, "channel", "channel", g=48))  # per-channel: any G works


@pytest.mark.slow
def test_smollm2_16bit_equals_dynamic_cache(smol):
    model, tok = smol
    ids = tok("The capital of France is Paris. The capital of Germany is", return_tensors="pt").input_ids
    ref = generate(model, ids, n=20)
    assert torch.equal(ref, generate(model, ids, QuantizedKVCache.for_model(model, CacheConfig(FP, FP)), n=20))
