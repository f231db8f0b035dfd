"""Packed cache: DynamicCache oracle at 16 bits, KIVI streaming step by step, agreement with simulated mode,
fused decode attention vs SDPA, pre-RoPE keys, left-padded batches == each prompt alone, byte accounting."""

import itertools

import pytest
import torch
from helpers_models import gen
from transformers import DynamicCache

from kvq_lab.cache import CacheConfig, QuantizedKVCache
from kvq_lab.cache.layers.base import PaddingState
from kvq_lab.cache.layers.packed import PackedLayer
from kvq_lab.cache.layers.simulated import SimulatedLayer
from kvq_lab.cache.routing.attention import ATTN_NAME
from kvq_lab.cache.storage.streams import spare_rows
from kvq_lab.kernels.torch_path import decode_attention_torch, quantize_whole_groups
from kvq_lab.quant.reference import dequantize, quantize
from kvq_lab.quant.spec import QuantSpec

AXES = list(itertools.product(["channel", "token"], repeat=2))


def packed(k=(2, 32, "channel"), v=(2, 32, "token"), **kw):
    return CacheConfig(key=QuantSpec(*k), value=QuantSpec(*v), mode="packed", backend="torch", **kw)


# ---------------------------------------------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------------------------------------------


def test_16bit_equals_dynamic_cache(tiny):
    ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(1))
    ref = gen(tiny, DynamicCache(config=tiny.config), ids)
    for rope in ("post", "pre"):
        cfg = packed((16,), (16,), rope=rope, exact_window=0)
        assert torch.equal(gen(tiny, QuantizedKVCache.for_model(tiny, cfg), ids), ref)
    # logits too, bit for bit
    cache = QuantizedKVCache.for_model(tiny, packed((16,), (16,)))
    dyn = DynamicCache(config=tiny.config)
    with torch.no_grad():
        a, b = tiny(ids, past_key_values=cache).logits, tiny(ids, past_key_values=dyn).logits
        assert torch.equal(a, b)
        nxt = a[:, -1:].argmax(-1)
        assert torch.equal(tiny(nxt, past_key_values=cache).logits, tiny(nxt, past_key_values=dyn).logits)


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "kax,vax",
    [("channel", "token"), ("token", "channel"), pytest.param("channel", "channel", marks=SLOW),
     pytest.param("token", "token", marks=SLOW)],
)  # fmt: skip
def test_fused_decode_matches_materialized(tiny, kax, vax):
    """The kvq_sdpa decode path and plain SDPA over dequantized K/V generate the same tokens."""
    ids = torch.randint(0, 256, (1, 75), generator=torch.Generator().manual_seed(2))
    cfg = packed((2, 32, kax), (3, 32, vax), exact_window=32, sink_tokens=2)
    fused = QuantizedKVCache.for_model(tiny, cfg)
    assert tiny.config._attn_implementation == ATTN_NAME and fused.layers[0].fused
    plain = QuantizedKVCache(cfg, 2, tiny.model.rotary_emb)  # not routed: update returns dequantized tensors
    assert torch.equal(gen(tiny, fused, ids, 40), gen(tiny, plain, ids, 40))


def test_routing_leaves_other_caches_alone(tiny):
    QuantizedKVCache.for_model(tiny, packed(exact_window=32))
    assert tiny.config._attn_implementation == ATTN_NAME
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        routed = tiny(ids, past_key_values=DynamicCache(config=tiny.config)).logits
        tiny.set_attn_implementation("sdpa")
        try:
            plain = tiny(ids, past_key_values=DynamicCache(config=tiny.config)).logits
        finally:
            tiny.set_attn_implementation(ATTN_NAME)
    assert torch.equal(routed, plain)


# ---------------------------------------------------------------------------------------------------------------
# streaming, layer level (synthetic K/V)
# ---------------------------------------------------------------------------------------------------------------


def layer_for(cfg, B=None, mask=None):
    pad = PaddingState()
    pad.prompt_mask = mask
    return PackedLayer(cfg, None, pad)


def kv(B, H, T, D, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, T, D, generator=g)
    k[..., 5] *= 20  # an outlier channel
    return k, torch.randn(B, H, T, D, generator=g)


def expected(x, spec, S, q):
    """Sinks exact, history [S, S + q) reference-dequantized, the rest exact."""
    if q == 0:
        return x
    hist = dequantize(quantize(x[:, :, S : S + q], spec)).to(x.dtype)
    return torch.cat([x[:, :, :S], hist, x[:, :, S + q :]], 2)


@pytest.mark.parametrize("S", [0, 3])
@pytest.mark.parametrize("R", [0, 64])
def test_streaming_step_by_step(S, R):
    """KIVI's schedule: per-channel keys flush R (or G) at once, per-token values slide; history never changes."""
    G = 32
    cfg = packed((2, G, "channel"), (2, G, "token"), exact_window=R, sink_tokens=S)
    k, v = kv(1, 2, 200, 64, 0)
    L = 100
    layer = layer_for(cfg)
    layer.update(k[:, :, :L], v[:, :, :L])
    Rp = R or G
    snapshot = None
    for N in range(L, 200):
        kq = (N - S) // Rp * Rp
        vq = max(0, N - S - R)
        assert layer.k_stream.q == [kq] and layer.k_stream.w == [N - S - kq]
        assert layer.v_stream.n_quantized(N) == vq
        K, V = layer.materialize()
        assert torch.equal(K, expected(k[:, :, :N], cfg.key, S, kq)), N
        assert torch.equal(V, expected(v[:, :, :N], cfg.value, S, vq)), N
        if snapshot is not None:  # older codes and params are untouched by later steps
            c, s_ = snapshot
            assert torch.equal(layer.k_stream.store.codes[:, :, : c.shape[2]], c)
            assert torch.equal(layer.v_stream.store.scale[:, :, : s_.shape[2]], s_)
        snapshot = (layer.k_stream.store.codes.clone(), layer.v_stream.store.scale[:, :, :vq].clone())
        layer.update(k[:, :, N : N + 1], v[:, :, N : N + 1])


@pytest.mark.parametrize("kax,vax", AXES)
@pytest.mark.parametrize("bits", [1, 3, 4, 8])
def test_any_axis_any_bits(kax, vax, bits):
    G, R, S = 16, 32, 1
    cfg = packed((bits, G, kax), (bits, G, vax), exact_window=R, sink_tokens=S)
    k, v = kv(2, 2, 90, 64, bits)
    layer = layer_for(cfg)
    layer.update(k[:, :, :70], v[:, :, :70])
    for N in range(70, 90):
        layer.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
    N = 90
    for x, spec, got in ((k, cfg.key, layer.materialize()[0]), (v, cfg.value, layer.materialize()[1])):
        q = (N - S) // R * R if spec.axis == "channel" else N - S - R
        assert torch.equal(got, expected(x, spec, S, q))


@pytest.mark.parametrize("S", [0, 2])
def test_packed_agrees_with_simulated(S):
    """Where both quantize the same tokens with the same groups, they store the same values, bit for bit.

    Simulated mode quantizes every token (partial per-channel groups zero-padded and recomputed); packed mode
    with R = 0 quantizes per-token values on arrival and per-channel keys once a group of G is whole. So at
    every step: all values after the sinks agree, and keys agree on the whole groups. (Packed prefill attention
    is exact while simulated prefill attention is not, so the comparison is on cache contents, step by step.)
    """
    G = 32
    spec_k, spec_v = QuantSpec(2, G, "channel"), QuantSpec(2, G, "token")
    sim = SimulatedLayer(CacheConfig(key=spec_k, value=spec_v, mode="simulated", sink_tokens=S), None, PaddingState())
    pk = layer_for(packed((2, G, "channel"), (2, G, "token"), exact_window=0, sink_tokens=S))
    k, v = kv(1, 2, 160, 64, 5)
    L = 64 + S
    ks, vs = sim.update(k[:, :, :L], v[:, :, :L])
    pk.update(k[:, :, :L], v[:, :, :L])
    for N in range(L, 160):
        ks, vs = sim.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
        pk.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
        K, V = pk.materialize()
        whole = S + (N + 1 - S) // G * G
        assert torch.equal(K[:, :, :whole], ks[:, :, :whole]), N
        assert torch.equal(V, vs), N
        assert torch.equal(K[:, :, whole:], k[:, :, whole : N + 1])  # packed: the partial group stays exact


@pytest.mark.parametrize("kax,vax", AXES)
@pytest.mark.parametrize("S", [0, 3])
def test_decode_attention_matches_sdpa(kax, vax, S):
    """Fused decode attention over codes == SDPA on the dequantized cache, within fp32 rounding (GQA 3:1)."""
    cfg = packed((2, 32, kax), (2, 32, vax), exact_window=64, sink_tokens=S)
    k, v = kv(2, 2, 160, 64, 7)
    layer = layer_for(cfg)
    layer.update(k[:, :, :130], v[:, :, :130])
    for N in range(130, 160):
        layer.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
        if N % 4 and N != 159:  # every few steps (with S=3 a block of keys is flushed at N=131)
            continue
        q = torch.randn(2, 6, 1, 64, generator=torch.Generator().manual_seed(N))
        K, V = layer.materialize()
        ref = torch.nn.functional.scaled_dot_product_attention(q, K, V, enable_gqa=True).transpose(1, 2)
        got = decode_attention_torch(layer.decode_view(), q, None, 64**-0.5)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_whole_group_quantizer_is_the_reference():
    g = torch.Generator().manual_seed(0)
    cases = [torch.randn(2, 2, 64, 64, generator=g) * 3, torch.zeros(1, 1, 32, 64), torch.randn(1, 1, 32, 64) * 1e-6]
    cases.append(torch.full((1, 1, 32, 64), 7.25))
    for x, axis, bits in itertools.product(cases, ["token", "channel"], [1, 2, 3, 4, 8]):
        spec = QuantSpec(bits, 32, axis)
        c, s, z = quantize_whole_groups(x, spec)
        q = quantize(x, spec)
        assert torch.equal(c, q.codes) and torch.equal(s, q.scale) and torch.equal(z, q.zero)


# ---------------------------------------------------------------------------------------------------------------
# pre-RoPE keys
# ---------------------------------------------------------------------------------------------------------------


def test_pre_rope_stores_unrotated_keys(tiny):
    """rope=pre: the history holds quantized pre-RoPE keys; dequantized keys are rotated back at their positions."""
    cfg = packed((8, 32, "channel"), (8, 32, "token"), exact_window=32, rope="pre")
    cache = QuantizedKVCache.for_model(tiny, cfg)
    ids = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(4))
    captured = {}

    def hook(mod, args, kwargs, out):
        captured["k"] = kwargs["hidden_states"]

    h = tiny.model.layers[0].self_attn.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        tiny(ids, past_key_values=cache)
    h.remove()
    attn = tiny.model.layers[0].self_attn
    hs = captured["k"]
    k = attn.k_proj(hs).view(1, 100, -1, 64).transpose(1, 2)  # pre-RoPE keys, as the model makes them
    layer = cache.layers[0]
    q = layer.k_stream.q[0]
    stored = layer.k_stream.store.dequantize(q)
    ref = dequantize(quantize(k[:, :, :q].float(), cfg.key))
    torch.testing.assert_close(stored, ref, rtol=0, atol=1e-4)  # unrotate(rotate(k)) == k up to fp32 rounding
    pos = torch.arange(100)[None]
    cos, sin = tiny.model.rotary_emb(k, pos)
    post = k * cos[:, None] + torch.cat([-k[..., 32:], k[..., :32]], -1) * sin[:, None]
    K, _ = layer.materialize()
    step = layer.k_stream.store.scale[:, :, : q // 32].float().repeat_interleave(32, 2)
    assert ((K[:, :, :q] - post[:, :, :q]).abs() <= 2 * step.max() + 1e-4).all()  # |R (k - k')| <= |k - k'|


def test_pre_and_post_rope_generate_alike_at_16_bits(tiny):
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(6))
    a = gen(tiny, QuantizedKVCache.for_model(tiny, packed((16,), (16,), rope="pre")), ids)
    b = gen(tiny, QuantizedKVCache.for_model(tiny, packed((16,), (16,), rope="post")), ids)
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------------
# left-padded batches
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kax,vax", AXES)
def test_padded_batch_rows_store_what_single_rows_store(kax, vax):
    """Layer level: each row of a left-padded batch holds exactly what it holds alone (any axes, sinks)."""
    G, R, S = 16, 32, 2
    cfg = packed((2, G, kax), (2, G, vax), exact_window=R, sink_tokens=S)
    lengths = [70, 41, 5]  # 5 < S + R: a short row whose sinks and window fill during decode
    T0, steps = max(lengths), 50
    k, v = kv(3, 2, T0 + steps, 64, 9)
    mask = torch.zeros(3, T0, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, T0 - n :] = 1
    batch = layer_for(cfg, mask=mask)
    batch.update(k[:, :, :T0], v[:, :, :T0])
    singles = []
    for b, n in enumerate(lengths):
        layer = layer_for(cfg)
        layer.update(k[b : b + 1, :, T0 - n : T0], v[b : b + 1, :, T0 - n : T0])
        singles.append(layer)
    for t in range(steps):
        sl = slice(T0 + t, T0 + t + 1)
        batch.update(k[:, :, sl], v[:, :, sl])
        KB, VB = batch.materialize()
        for b, (n, layer) in enumerate(zip(lengths, singles, strict=True)):
            layer.update(k[b : b + 1, :, sl], v[b : b + 1, :, sl])
            K1, V1 = layer.materialize()
            assert torch.equal(KB[b : b + 1, :, T0 - n :], K1), (b, t)
            assert torch.equal(VB[b : b + 1, :, T0 - n :], V1), (b, t)


@pytest.mark.parametrize("kax,vax", [("channel", "token"), pytest.param("token", "channel", marks=SLOW)])
def test_padded_batch_generates_what_each_prompt_generates_alone(tiny, kax, vax):
    cfg = packed((2, 32, kax), (2, 32, vax), exact_window=32, sink_tokens=2)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in (75, 50, 33)]
    T0 = 75
    ids = torch.zeros(3, T0, dtype=torch.long)
    mask = torch.zeros(3, T0, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T0 - len(p) :] = p
        mask[b, T0 - len(p) :] = 1
    cache = QuantizedKVCache.for_model(tiny, cfg)
    cache.set_padding(mask)
    out = gen(tiny, cache, ids, 40, mask)
    for b, p in enumerate(prompts):
        alone = gen(tiny, QuantizedKVCache.for_model(tiny, cfg), p[None], 40)
        assert torch.equal(out[b : b + 1], alone), b


# ---------------------------------------------------------------------------------------------------------------
# bytes
# ---------------------------------------------------------------------------------------------------------------


def test_nbytes_is_the_storage_arithmetic():
    G, R, D, H = 32, 128, 64, 2
    cfg = packed((2, G, "channel"), (2, G, "token"), exact_window=R)
    k, v = kv(1, H, 700, D, 10)
    layer = layer_for(cfg)
    layer.update(k[:, :, :640], v[:, :, :640])  # keys: 640 quantized (5 windows), values: 512 quantized
    stored, fp16 = layer.nbytes()
    hist = (640 + 512) * H * D * 3 // 8  # 2-bit codes + fp16 scale and zero per 32 elements = 3 bits
    windows = 2 * (R + spare_rows(R)) * H * D * 4  # two fp32 window buffers of R tokens and the rows to move in
    assert stored == hist + windows
    assert fp16 == 2 * 640 * H * D * 2
    # a partial packing block of values is allocated whole: 20 more tokens -> values 532 quantized, blocks of 32
    for N in range(640, 660):
        layer.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
    stored, _ = layer.nbytes()
    assert stored == (640 + 544) * H * D * 3 // 8 + windows
