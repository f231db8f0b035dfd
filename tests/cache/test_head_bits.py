"""Per-head bits (`CacheConfig.head_bits`, `kvq_lab.cache.layers.heads.HeadsLayer`): each head stored as a layer of its
width stores it, in both modes (sinks, window, prefill and decode steps); heads all at the cache's bits are the mode's
layer bit for bit; bytes are the accounting's arithmetic; a left-padded batch holds what each prompt holds alone;
bad values fail in one line."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers_models import gen

from kvq_lab.cache import CacheConfig, QuantizedKVCache
from kvq_lab.cache.accounting import Shape
from kvq_lab.cache.layers.heads import HeadsLayer
from kvq_lab.common.errors import QuantConfigError
from kvq_lab.quant.spec import QuantSpec

MODES = [("simulated", 0, 0), ("simulated", 0, 4), ("packed", 0, 0), ("packed", 32, 4)]
H, D = 3, 64


def config(mode, R, S, head_bits=(), **kw) -> CacheConfig:
    return CacheConfig(
        key=QuantSpec(2, 32, "channel"), value=QuantSpec(2, 32, "token"), mode=mode, exact_window=R,
        sink_tokens=S, backend="torch", head_bits=head_bits, **kw,
    )  # fmt: skip


def fill(cfg, k, v, steps: int = 5, mask=None):
    """A one-layer cache given a prompt k, v [B, H, T, D] then `steps` decode tokens -> what attention read after
    each call (copies: a simulated layer's returned K/V are its buffers, re-quantized in place as groups fill), and
    the cache."""
    cache = QuantizedKVCache(cfg, 1)
    if mask is not None:
        cache.set_padding(mask)
    T = k.shape[2] - steps
    outs = [tuple(x.clone() for x in cache.update(k[:, :, :T], v[:, :, :T], 0))]
    for t in range(T, k.shape[2]):
        outs.append(tuple(x.clone() for x in cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], 0)))
    return outs, cache


def kv(B=1, T=77, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, T, D, generator=g) * torch.linspace(0.2, 4, D)  # outlier channels
    return k, torch.randn(B, H, T, D, generator=g)


@pytest.mark.parametrize("mode,R,S", MODES)
def test_each_head_is_stored_as_a_layer_of_its_width(mode, R, S):
    bits = ((2, 4), (8, 2), (2, 4))
    k, v = kv()
    outs, cache = fill(config(mode, R, S, bits), k, v)
    assert isinstance(cache.layers[0], HeadsLayer)
    for h, (kb, vb) in enumerate(bits):
        one = replace(config(mode, R, S), key=QuantSpec(kb, 32, "channel"), value=QuantSpec(vb, 32, "token"))
        ref, ref_cache = fill(one, k[:, h : h + 1], v[:, h : h + 1])
        for (ok, ov), (rk, rv) in zip(outs, ref, strict=True):
            assert torch.equal(ok[:, h : h + 1], rk) and torch.equal(ov[:, h : h + 1], rv)
    assert cache.get_seq_length() == k.shape[2]


@pytest.mark.parametrize("mode,R,S", MODES)
def test_heads_at_the_cache_bits_are_the_modes_layer(tiny, mode, R, S):
    ids = torch.randint(3, 256, (1, 70), generator=torch.Generator().manual_seed(3))
    plain = config(mode, R, S)
    same = replace(plain, head_bits=((2, 2),) * tiny.config.num_key_value_heads)
    ref = gen(tiny, QuantizedKVCache.for_model(tiny, plain), ids)
    assert torch.equal(gen(tiny, QuantizedKVCache.for_model(tiny, same), ids), ref)


def test_sixteen_bit_heads_are_dynamic_cache(tiny):
    from transformers import DynamicCache

    ids = torch.randint(3, 256, (1, 50), generator=torch.Generator().manual_seed(4))
    ref = gen(tiny, DynamicCache(config=tiny.config), ids)
    for mode, R in (("simulated", 0), ("packed", 32)):
        cfg = config(mode, R, 0, ((16, 16),) * tiny.config.num_key_value_heads)
        assert torch.equal(gen(tiny, QuantizedKVCache.for_model(tiny, cfg), ids), ref)


@pytest.mark.parametrize("R,S", [(0, 0), (32, 4)])
@pytest.mark.parametrize("T", [40, 77, 128])
def test_bytes_are_each_heads_as_a_layer_of_its_width(R, S, T):
    cfg = config("packed", R, S, ((2, 4), (8, 2), (4, 4)))
    k, v = kv(T=T)
    cache = QuantizedKVCache(cfg, 1)
    cache.update(k, v, 0)
    stored, fp16 = cache.layers[0].nbytes()
    assert fp16 == 2 * H * T * D * 2
    alone = 0
    for h in range(H):
        one = QuantizedKVCache(cfg.for_head(h), 1)
        one.update(k[:, h : h + 1], v[:, h : h + 1], 0)
        alone += one.layers[0].nbytes()[0]
    assert stored == alone


@pytest.mark.parametrize("T", [64, 160])
def test_bytes_are_the_layout_arithmetic(T):
    """Per-token groups, whole packing blocks, no exact tokens (an fp32 model's window and sinks are kept in fp32,
    the arithmetic counts 16 bits): what the layer's `stored_bits` counts, exactly (per-channel streams also keep
    a flush buffer, which `nbytes()` counts and the arithmetic does not: tests/cache/test_policies.py)."""
    cfg = replace(config("packed", 0, 0, ((2, 4), (8, 2), (4, 4))), key=QuantSpec(2, 32, "token"))
    k, v = kv(T=T)
    cache = QuantizedKVCache(cfg, 1)
    cache.update(k, v, 0)
    want = sum(type(cache.layers[0]).stored_bits(cfg, T, Shape(heads=H, head_dim=D))) * H * T * D / 8
    assert cache.layers[0].nbytes()[0] == want


@pytest.mark.parametrize("mode,R,S", MODES)
def test_a_left_padded_batch_holds_what_each_prompt_holds_alone(mode, R, S):
    cfg = config(mode, R, S, ((2, 4), (4, 2), (2, 4)))
    lengths, steps = (70, 45), 4
    T = max(lengths)
    k, v = kv(B=2, T=T + steps, seed=5)
    mask = torch.stack([torch.arange(T) >= T - n for n in lengths]).long()
    outs, _ = fill(cfg, k, v, steps, mask)
    for b, n in enumerate(lengths):
        p = T - n
        ref, _ = fill(cfg, k[b : b + 1, :, p:], v[b : b + 1, :, p:], steps)
        for (ok, ov), (rk, rv) in zip(outs, ref, strict=True):
            assert torch.equal(ok[b : b + 1, :, p:], rk) and torch.equal(ov[b : b + 1, :, p:], rv)


def test_stacked_rows_decode_as_alone():
    """Single-prompt caches stacked into one batch (simulated layers stack; packed ones do not, nor their heads)."""
    assert not QuantizedKVCache(config("packed", 32, 4, ((2, 4), (4, 2), (2, 4))), 1).stackable
    cfg = config("simulated", 0, 4, ((2, 4), (4, 2), (2, 4)))
    rows, refs = [], []
    for n, seed in ((70, 6), (45, 7)):
        k, v = kv(T=n + 3, seed=seed)
        c = QuantizedKVCache(cfg, 1)
        c.update(k[:, :, :n], v[:, :, :n], 0)
        rows.append(c)
        refs.append(fill(cfg, k, v, 3)[0][-1])
        rows[-1].tail = (k[:, :, n:], v[:, :, n:])
    tails = [r.tail for r in rows]
    batch = QuantizedKVCache.stack(rows)
    assert isinstance(batch.layers[0], HeadsLayer) and batch.layers[0].keys.shape[0] == 2
    for t in range(3):
        out = batch.update(
            torch.cat([a[0][:, :, t : t + 1] for a in tails]), torch.cat([a[1][:, :, t : t + 1] for a in tails]), 0
        )
    for b, (rk, rv) in enumerate(refs):
        n = rk.shape[2]
        assert torch.equal(out[0][b : b + 1, :, -n:], rk) and torch.equal(out[1][b : b + 1, :, -n:], rv)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"head_bits": ((2, 9),)}, r"head_bits=.* must list \(key bits, value bits\) per KV head"),
        ({"head_bits": ((2, 5),)}, r"head_bits: head 0 at \(2, 5\): value_format=int takes"),
        ({"head_bits": ((2,),)}, r"head_bits=.* must list"),
        ({"head_bits": ((2, 2),), "mode": "recompute"}, "per-head bits with mode=recompute"),
        ({"head_bits": ((2, 2),), "policy": "evict"}, "per-head bits with policy=evict"),
        (
            {"head_bits": ((2, 4),), "key": QuantSpec(8, 32, "channel", format="fp8_e4m3")},
            r"head_bits: head 0 at \(2, 4\): key_format=fp8_e4m3",
        ),
    ],
)
def test_bad_head_bits_fail_in_one_line(kw, match):
    base = {"mode": "packed", "exact_window": 32, **kw}
    with pytest.raises(QuantConfigError, match=match) as e:
        CacheConfig(**base)
    assert "\n" not in str(e.value)


def test_a_head_count_the_model_lacks_fails_in_one_line(tiny):
    cfg = config("packed", 32, 0, ((2, 2),) * 3)
    with pytest.raises(QuantConfigError, match="3 heads but LlamaForCausalLM has 2 KV heads") as e:
        QuantizedKVCache.for_model(tiny, cfg)
    assert "\n" not in str(e.value)
