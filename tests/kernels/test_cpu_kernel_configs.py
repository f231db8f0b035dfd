"""The CPU kernel for every configuration: rope=pre keys rotated in the kernel, against the PyTorch path
(which re-rotates a dequantized history) on awkward shapes, and the same greedy tokens in generation."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import left_padded_prompts, padded_packed_cache, spy_cpu_kernel, tiny_llama
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kvq_lab.cache import CacheConfig, QuantizedKVCache
from kvq_lab.cache.layers.base import PaddingState
from kvq_lab.cache.layers.packed import PackedLayer
from kvq_lab.cache.routing.rope import RopeHelper
from kvq_lab.kernels import cpu_kernel
from kvq_lab.kernels.torch_path import decode_attention_torch
from kvq_lab.quant.spec import QuantSpec

pytestmark = pytest.mark.skipif(cpu_kernel.build_error() is not None, reason="no C compiler: no CPU kernel")

ROPE = frozenset({"rope"})
PLAIN: frozenset[str] = frozenset()


def rotary(D: int, theta: float = 10000.0) -> RopeHelper:
    cfg = LlamaConfig(hidden_size=4 * D, num_attention_heads=4, head_dim=D, max_position_embeddings=2048)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    return RopeHelper(LlamaRotaryEmbedding(cfg))


def layer_of(key, value, R, S, D, backend="cpu", rope="pre"):
    cfg = CacheConfig(key=QuantSpec(*key), value=QuantSpec(*value), mode="packed", exact_window=R, sink_tokens=S,
                      backend=backend, rope=rope)  # fmt: skip
    return PackedLayer(cfg, rotary(D), PaddingState())


def exact_angles(K, view, inv_freq):
    """K (materialized: rope=pre history rows rotated with the model's fp32 cos/sin table) with its history rows
    rotated at exact angles instead, in fp64: the RoPE both paths approximate. The table's angles are fp32 products
    (inv_freq * id, ~1e-5 rad off at ids near 400); the kernel composes each row's rotation from two table rows (a
    segment's base and the row's offset), whose angles round differently: about as far from exact RoPE as the table,
    not equal to it. So the oracle is exact RoPE, not either path's rounding."""
    first, n, half = view.sink_tokens, view.keys.n, K.shape[-1] // 2
    ids = view.rope.pos[:, first : first + n].long()  # [B, n]: no padding here
    table = view.rope.cos[ids].double()[:, None], view.rope.sin[ids].double()[:, None]  # [B, 1, n, D/2]
    angle = ids.double()[:, None, :, None] * inv_freq.double()
    h = K[:, :, first : first + n].double()
    x, y = h[..., :half], h[..., half:]
    x, y = x * table[0] + y * table[1], y * table[0] - x * table[1]  # the table's rotation undone (orthogonal)
    out = K.double().clone()
    out[:, :, first : first + n] = torch.cat([x * angle.cos() - y * angle.sin(), y * angle.cos() + x * angle.sin()], -1)
    return out


def fp64_attention(q, K, V, mask, scale):
    m = mask if mask is None or mask.dtype == torch.bool else mask.double()
    out = torch.nn.functional.scaled_dot_product_attention(
        q.double(), K.double(), V.double(), attn_mask=m, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)


# (key spec, value spec, R, sinks, D, query heads per kv head, batch, prompt, tokens)
ROPE_CASES = [
    ((2, 32, "channel"), (2, 32, "token"), 128, 0, 64, 3, 1, 150, 420),  # the benchmark's setting, two chunks
    ((3, 32, "channel"), (4, 32, "token"), 32, 3, 128, 3, 2, 101, 300),  # 3-bit words, D=128, sinks, odd lengths
    ((2, 16, "token"), (2, 64, "channel"), 0, 2, 64, 1, 1, 37, 290),  # R=0, per-token keys, no GQA
    ((4, 32, "channel"), (2, 32, "token"), 64, 5, 64, 2, 2, 3, 110),  # a prompt shorter than the sinks
]


@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: f"K{c[0][0]}{c[0][2][0]}-R{c[2]}-S{c[3]}-D{c[4]}-r{c[5]}")
def test_rope_pre_in_the_kernel_matches_the_pytorch_path(case):
    """rope=pre keys rotated in the kernel (view.rope) give the PyTorch path's output (history dequantized and
    re-rotated in Python) within fp32 rounding (of the operations and of the table's angles), with every mask kind;
    the kernel within twice the PyTorch path's error of fp64 attention with exact RoPE over the materialized cache.
    The same view without its rotation must differ (the oracle can fail)."""
    key, value, R, S, D, r, B, L, T = case
    layer = layer_of(key, value, R, S, D)
    g = torch.Generator().manual_seed(T + D)
    k, v = torch.randn(B, 2, T, D, generator=g), torch.randn(B, 2, T, D, generator=g)
    k[..., 5] *= 10  # an outlier channel
    layer.update(k[:, :, :L], v[:, :, :L])
    checked, err_kernel, err_torch = 0, 0.0, 0.0
    for N in range(L, T):
        layer.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
        if (N - L) % 61 and N != T - 1:
            continue
        view = layer.view_for(ROPE)
        assert view.rope is not None and view.keys.history is None  # the kernel reads the codes
        q = torch.randn(B, 2 * r, 1, D, generator=g) * 2
        scale = D**-0.5
        K, V = layer.materialize()
        K = exact_angles(K, view, layer.rope.rotary_emb.inv_freq)
        for mask in (None, torch.rand(B, 1, 1, N + 1, generator=g) > 0.3, torch.randn(B, 1, 1, N + 1, generator=g)):
            got = cpu_kernel.decode_attention(view, q, mask, scale)
            ours = decode_attention_torch(layer.view_for(PLAIN), q, mask, scale)
            torch.testing.assert_close(got, ours, rtol=1e-4, atol=1e-4)
            exact = fp64_attention(q, K, V, mask, scale)
            err_kernel = max(err_kernel, (got.double() - exact).abs().max().item())
            err_torch = max(err_torch, (ours.double() - exact).abs().max().item())
            checked += 1
        if view.keys.n:  # history present (the window is post-RoPE already): unrotated keys give another answer
            unrotated = cpu_kernel.decode_attention(view._replace(rope=None), q, None, scale)
            assert (unrotated - decode_attention_torch(layer.view_for(PLAIN), q, None, scale)).abs().max() > 1e-2
    assert checked >= 9
    # fp32 rounding in another order (16 partial sums, a polynomial exp): ~1e-6 at these score sizes
    assert err_kernel <= 2 * err_torch + 5e-6, (err_kernel, err_torch)


def test_rope_pre_with_position_ids_of_the_callers_own():
    """Position ids that are not consecutive (per row: consecutive from 5, strided, falling, repeated) give the PyTorch
    path's output, and are as close to exact RoPE: the kernel rotates a segment's rows at their offsets from its base
    only where the segment's ids allow it (consecutive enough, in the table), the others at their own ids."""
    layer = layer_of((2, 32, "channel"), (2, 32, "token"), 32, 0, 64)
    B, L = 4, 300
    t = torch.arange(L + 1)
    ids = torch.stack([t + 5, t * 3, (L - t) + 40, t // 2])
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(B, 2, L + 1, 64, generator=g), torch.randn(B, 2, L + 1, 64, generator=g)
    k[..., 5] *= 10
    layer.update(k[:, :, :L], v[:, :, :L], kwargs={"position_ids": ids[:, :L]})
    layer.update(k[:, :, L:], v[:, :, L:], kwargs={"position_ids": ids[:, L:]})
    view = layer.view_for(ROPE)
    assert view.keys.n > 250 and torch.equal(view.rope.pos[:, : L + 1], ids.to(torch.int32))
    q = torch.randn(B, 6, 1, 64, generator=g) * 2
    got = cpu_kernel.decode_attention(view, q, None, 0.125)
    ours = decode_attention_torch(layer.view_for(PLAIN), q, None, 0.125)
    torch.testing.assert_close(got, ours, rtol=1e-4, atol=1e-4)
    K, V = layer.materialize()
    exact = fp64_attention(q, exact_angles(K, view, layer.rope.rotary_emb.inv_freq), V, None, 0.125)
    err_kernel, err_torch = (got.double() - exact).abs().max().item(), (ours.double() - exact).abs().max().item()
    assert err_kernel <= 2 * err_torch + 5e-6, (err_kernel, err_torch)


def test_rope_table_is_the_models_rope():
    """The kernel's table is the rotary module's own cos/sin (one half of its duplicated layout), grown on demand;
    a RoPE whose frequencies depend on the length gets no table (the PyTorch path re-rotates instead)."""
    from kvq_lab.cache.layers.packed_decode import rope_table

    rope = rotary(64, theta=500000.0)
    cos, sin = rope_table(rope.rotary_emb, 10, torch.empty(0))
    ref_cos, ref_sin = rope.cos_sin(torch.empty(0), torch.arange(cos.shape[0])[None])
    assert torch.equal(cos, ref_cos[0, 0, :, :32]) and torch.equal(sin, ref_sin[0, 0, :, :32])
    assert rope_table(rope.rotary_emb, 3000, torch.empty(0))[0].shape[0] >= 3000
    rope.rotary_emb.rope_type = "dynamic"
    assert rope_table(rope.rotary_emb, 10, torch.empty(0)) is None


def test_position_ids_outside_the_table_fail():
    layer = layer_of((2, 32, "channel"), (2, 32, "token"), 32, 0, 64)
    layer.update(torch.randn(1, 2, 100, 64), torch.randn(1, 2, 100, 64))
    view = layer.view_for(ROPE)
    bad = view._replace(rope=view.rope._replace(pos=view.rope.pos + view.rope.cos.shape[0]))
    with pytest.raises(ValueError, match="position ids outside the RopeView table"):
        cpu_kernel.decode_attention(bad, torch.randn(1, 4, 1, 64), None, 0.125)


def test_position_ids_are_kept_as_given():
    """The position-id buffer (what rope=pre rotates with, in the kernel and the PyTorch path alike) holds
    each update's ids at its cache positions: a prefill, then decode steps one column each, across the
    buffer's growth (POS_CHUNK), with ids of the caller's own (per row, not consecutive)."""
    from kvq_lab.cache.routing.rope import POS_CHUNK

    layer = layer_of((2, 32, "channel"), (2, 32, "token"), 32, 0, 64)
    B, L = 2, POS_CHUNK - 3
    first = torch.arange(L)[None].expand(B, L) + torch.tensor([[0], [7]])
    layer.update(torch.randn(B, 2, L, 64), torch.randn(B, 2, L, 64), kwargs={"position_ids": first})
    want = [first]
    for t in range(8):  # past the first POS_CHUNK columns: the buffer grows, its first columns kept
        ids = torch.tensor([[L + t], [L + 7 + 3 * t]])  # row 1's ids are not consecutive
        layer.update(torch.randn(B, 2, 1, 64), torch.randn(B, 2, 1, 64), kwargs={"position_ids": ids})
        want.append(ids)
    want = torch.cat(want, 1).to(torch.int32)
    log = layer._log
    assert layer.N == L + 8 and log.ids.shape[1] >= 2 * POS_CHUNK
    assert torch.equal(log.ids[:, : layer.N], want) and log.top == int(want.max())
    assert layer.view_for(ROPE).rope.pos is log.ids  # the kernel reads this very buffer


def test_a_caches_layers_share_one_position_buffer(tiny_model):
    """rope=pre: the layers of a cache keep their position ids in one buffer (written once per step, by the first
    layer), which `nbytes` counts once; another cache has its own. Greedy tokens are those of the PyTorch path (where
    every layer reads the buffer to re-rotate its history) and of a cache whose layers each wrote their own."""
    from kvq_lab.cache.routing.rope import PositionLog

    cfg = CacheConfig(key=QuantSpec(2, 32, "channel"), value=QuantSpec(2, 32, "token"), mode="packed",
                      exact_window=32, backend="cpu", rope="pre")  # fmt: skip
    prompt = torch.randint(3, tiny_model.config.vocab_size, (1, 70), generator=torch.Generator().manual_seed(2))
    out, caches = {}, {}
    for name, backend in (("cpu", "cpu"), ("torch", "torch"), ("own", "cpu")):
        cache = QuantizedKVCache.for_model(tiny_model, dataclasses.replace(cfg, backend=backend))
        if name == "own":  # each layer its own log: what every layer writing its own buffer gave
            for layer in cache.layers:
                layer._log = PositionLog()
        out[name] = tiny_model.generate(prompt, past_key_values=cache, max_new_tokens=40, do_sample=False)
        caches[name] = cache
    assert torch.equal(out["cpu"], out["torch"]) and torch.equal(out["cpu"], out["own"])
    shared = {id(layer._log) for layer in caches["cpu"].layers}
    assert len(shared) == 1 and not shared & {id(layer._log) for layer in caches["torch"].layers}
    log = caches["cpu"].layers[0]._log
    N = caches["cpu"].get_seq_length()
    assert torch.equal(log.ids[0, :N], torch.arange(N, dtype=torch.int32))
    ids_bytes = log.ids.numel() * 4
    counted = [layer._log.nbytes_for(layer) for layer in caches["cpu"].layers]
    assert sorted(counted) == [0] * (len(counted) - 1) + [ids_bytes]
    own = caches["own"]
    assert own.nbytes()["stored"] - caches["cpu"].nbytes()["stored"] == (len(own.layers) - 1) * ids_bytes


def gen(model, cache, ids, n, mask=None):
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, past_key_values=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[:, ids.shape[1] :]


@pytest.fixture(scope="module")
def gqa3():
    """A tiny random Llama with 3 query heads per kv head and D=128 (the awkward GQA ratio and head size)."""
    return tiny_llama(seed=3, heads=6, kv_heads=2, head_dim=128, hidden=192)


@pytest.mark.parametrize("model_name", ["tiny_model", "gqa3"])
def test_rope_pre_generation_goes_through_the_kernel(model_name, request, monkeypatch):
    """Greedy tokens with rope=pre: backend=cpu (keys rotated in the kernel) == backend=torch, and every decode step
    of every layer reaches the kernel with a rope view."""
    model = request.getfixturevalue(model_name)
    calls = spy_cpu_kernel(monkeypatch, lambda view: view.rope)
    ids = torch.randint(3, 256, (1, 83), generator=torch.Generator().manual_seed(9))
    out = {}
    for backend in ("cpu", "torch"):
        cfg = CacheConfig(key=QuantSpec(2, 32, "channel"), value=QuantSpec(2, 32, "token"), mode="packed",
                          exact_window=32, sink_tokens=2, rope="pre", backend=backend)  # fmt: skip
        out[backend] = gen(model, QuantizedKVCache.for_model(model, cfg), ids, 30)
    assert torch.equal(out["cpu"], out["torch"])
    layers = model.config.num_hidden_layers
    assert len(calls) == 29 * layers and all(r is not None for r in calls)


# --- fp16 and bf16 models ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rope", ["post", "pre"])
def test_half_models_in_the_kernel_match_the_pytorch_path(dtype, rope):
    """Sinks, window and query in the model's dtype: the kernel converts them (exactly) and accumulates in fp32, so
    its result is the PyTorch path's up to fp32 rounding, in the model's dtype, and bit for bit its own result on fp32
    copies of the same tensors (rope=pre window keys are post-RoPE as the model made them: nothing to round).
    Converting with the wrong format must differ (the oracle can fail)."""
    D, r, B = 64, 3, 2
    layer = layer_of((2, 32, "channel"), (3, 32, "token"), 32, 3, D, rope=rope)
    g = torch.Generator().manual_seed(11)
    k, v = torch.randn(B, 2, 230, D, generator=g).to(dtype), torch.randn(B, 2, 230, D, generator=g).to(dtype)
    layer.update(k[:, :, :161], v[:, :, :161])
    for N in range(161, 230):
        layer.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
    q = torch.randn(B, 2 * r, 1, D, generator=g).to(dtype)
    mask = torch.rand(B, 1, 1, 230, generator=g) > 0.2
    view = layer.view_for(ROPE)
    assert cpu_kernel.supports(view, q, mask) and (view.rope is not None) == (rope == "pre")
    got = cpu_kernel.decode_attention(view, q, mask, D**-0.5)
    assert got.dtype == dtype
    ours = decode_attention_torch(layer.view_for(PLAIN), q, mask, D**-0.5)
    tol = 1e-3 if dtype == torch.float16 else 1e-2  # one ulp of the output's dtype
    torch.testing.assert_close(got.float(), ours.float(), rtol=tol, atol=tol)
    f32 = lambda sv: sv._replace(sink=sv.sink.float(), window=sv.window.float())  # noqa: E731
    full = cpu_kernel.decode_attention(view._replace(keys=f32(view.keys), values=f32(view.values)), q.float(),
                                       mask, D**-0.5)  # fmt: skip
    assert torch.equal(got, full.to(dtype))  # fp32 inside: the kernel's own result on fp32 copies
    other = torch.bfloat16 if dtype == torch.float16 else torch.float16  # the bits read as the other format
    wrong = lambda sv: sv._replace(sink=sv.sink.view(other), window=sv.window.view(other))  # noqa: E731
    bad = cpu_kernel.decode_attention(view._replace(keys=wrong(view.keys), values=wrong(view.values)), q.view(other),
                                      mask, D**-0.5)  # fmt: skip
    assert not torch.allclose(bad.float(), got.float(), rtol=0.1, atol=0.1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_model_generation_goes_through_the_kernel(tiny_model, dtype, monkeypatch):
    """fp16 / bf16 tiny Llama: the same greedy tokens with backend=cpu and backend=torch (rope=post and pre), every
    decode step of every layer through the kernel."""
    model = tiny_llama().to(dtype)
    calls = spy_cpu_kernel(monkeypatch)
    ids = torch.randint(3, 256, (1, 70), generator=torch.Generator().manual_seed(12))
    for rope in ("post", "pre"):
        out = {}
        for backend in ("cpu", "torch"):
            cfg = CacheConfig(key=QuantSpec(2, 32, "channel"), value=QuantSpec(2, 32, "token"), mode="packed",
                              exact_window=32, sink_tokens=2, rope=rope, backend=backend)  # fmt: skip
            out[backend] = gen(model, QuantizedKVCache.for_model(model, cfg), ids, 20)
        assert torch.equal(out["cpu"], out["torch"]), rope
    assert len(calls) == 2 * 19 * model.config.num_hidden_layers


# --- left-padded batches ----------------------------------------------------------------------------------------

# (key spec, value spec, R, sinks, rope, pads per row, prompt length, tokens)
PAD_CASES = [
    ((2, 32, "channel"), (2, 32, "token"), 32, 2, "post", [0, 5, 40, 77], 120, 330),  # batch 4, chunk boundary
    ((3, 32, "token"), (2, 16, "channel"), 0, 3, "pre", [9, 0, 70], 75, 200),  # a row shorter than R's groups
    ((2, 32, "channel"), (4, 32, "token"), 64, 4, "pre", [0, 110, 2], 113, 260),  # a row of 3 tokens < sinks
]


@pytest.mark.parametrize("case", PAD_CASES, ids=lambda c: f"K{c[0][0]}{c[0][2][0]}-R{c[2]}-S{c[3]}-{c[4]}-B{len(c[5])}")
def test_padded_batch_in_the_kernel_matches_attention_over_the_padded_cache(case):
    """A left-padded batch: each row read with its own padding, sinks, history and window (per-row starts and
    counts), rope=pre keys at each row's own position ids, against SDPA over the materialized cache (what decode
    attention over a padded batch is without the kernel) with the padding mask: within fp32 rounding, and within
    twice its error of fp64. Reading the same view as if unpadded must differ (the oracle can fail)."""
    key, value, R, S, rope, pads, L, T = case
    B, D, r = len(pads), 64, 3
    cfg = CacheConfig(key=QuantSpec(*key), value=QuantSpec(*value), mode="packed", exact_window=R, sink_tokens=S,
                      backend="cpu", rope=rope)  # fmt: skip
    padding = PaddingState()
    real = torch.arange(L)[None] >= torch.tensor(pads)[:, None]  # [B, L] 0...0 1...1
    padding.prompt_mask = real.long()
    layer = PackedLayer(cfg, rotary(D), padding)
    ids = (real.cumsum(1) - 1).clamp(min=0)  # the position ids generate gives a left-padded prompt
    g = torch.Generator().manual_seed(L + T)
    k, v = torch.randn(B, 2, T, D, generator=g), torch.randn(B, 2, T, D, generator=g)
    k[..., 7] *= 8
    layer.update(k[:, :, :L], v[:, :, :L], position_ids=ids)
    checked, err_kernel, err_torch = 0, 0.0, 0.0
    for N in range(L, T):
        layer.update(k[:, :, N : N + 1], v[:, :, N : N + 1], position_ids=ids[:, -1:] + 1 + N - L)
        if (N - L) % 53 and N != T - 1:
            continue
        view = layer.decode_view()
        assert view.pads is not None and (view.rope is not None) == (rope == "pre")
        q = torch.randn(B, 2 * r, 1, D, generator=g) * 2
        scale = D**-0.5
        K, V = layer.materialize()
        valid = torch.cat([real, torch.ones(B, N + 1 - L, dtype=torch.bool)], 1)[:, None, None, :]  # [B, 1, 1, N]
        for mask in (valid, torch.where(valid, torch.randn(B, 1, 1, N + 1, generator=g), float("-inf"))):
            got = cpu_kernel.decode_attention(view, q, mask, scale)
            ref = torch.nn.functional.scaled_dot_product_attention(q, K, V, attn_mask=mask, scale=scale,
                                                                   enable_gqa=True).transpose(1, 2)  # fmt: skip
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
            exact = fp64_attention(q, K, V, mask, scale)
            err_kernel = max(err_kernel, (got.double() - exact).abs().max().item())
            err_torch = max(err_torch, (ref.double() - exact).abs().max().item())
            checked += 1
        unpadded = view._replace(pads=torch.zeros_like(view.pads))
        assert (cpu_kernel.decode_attention(unpadded, q, valid, scale) - got).abs().max() > 1e-2
    assert checked >= 6
    assert err_kernel <= 2 * err_torch + 5e-6, (err_kernel, err_torch)


@pytest.mark.parametrize("rope", ["post", "pre"])
def test_padded_generation_goes_through_the_kernel(tiny_model, rope, monkeypatch):
    """A left-padded batch of 4 prompts generates with backend=cpu what it generates with backend=torch (which
    materializes the padded cache for the model's SDPA), and what changed is measured: every decode step of every
    layer reaches the kernel with a padded view, and the mask the model hands it is one row per batch row
    ([B, 1, 1, N], no per-head mask: nothing falls back)."""
    calls = spy_cpu_kernel(monkeypatch, lambda view: view.pads is not None)  # built views and kept calls alike
    masks = set()
    real = cpu_kernel._additive_mask

    def spy(mask, B, N):
        masks.add(None if mask is None else tuple(mask.shape[:3]))
        return real(mask, B, N)

    monkeypatch.setattr(cpu_kernel, "_additive_mask", spy)
    ids, mask = left_padded_prompts([70, 41, 66, 12])
    out = {}
    for backend in ("cpu", "torch"):
        out[backend] = gen(tiny_model, padded_packed_cache(tiny_model, mask, rope, backend), ids, 24, mask=mask)
    assert torch.equal(out["cpu"], out["torch"])
    assert len(calls) == 23 * tiny_model.config.num_hidden_layers and all(calls)
    assert masks <= {(4, 1, 1)}, masks


# --- the benchmark's JSON ---------------------------------------------------------------------------------------

BENCH_KEYS = {"kind", "label", "backend", "rope", "dtype", "batch", "format", "length", "tok_s", "ratio", "prefill_s",
              "peak_bytes", "measured_over_arith", "transform", "paired_ratio", "pre_over_post",
              "paired_pre_over_post"}  # fmt: skip


def bench_module(monkeypatch):
    """scripts/bench_cache.py as a module (it is a script, not part of the package)"""
    from helpers_models import script_module

    return script_module("bench_cache", monkeypatch)


@pytest.mark.parametrize("n", range(1, 12))
def test_bench_step_orders_are_balanced(monkeypatch, n):
    """The benchmark's rounds of steps (`step_orders`): each round every cache once; over the orders every cache at
    every place equally often and right after every other cache equally often within rounds, and, the orders taken
    in a cycle, no cache right after itself (a cache's second step in a row would find its own data in the CPU
    caches). Two caches simply alternate: each is always right after the other, whichever starts a round."""
    from collections import Counter

    orders = bench_module(monkeypatch).step_orders(n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    places = Counter((c, i) for order in orders for i, c in enumerate(order))
    after = Counter((order[i - 1], order[i]) for order in orders for i in range(1, n))
    if n > 2:
        assert len(places) == n * n and len(set(places.values())) == 1
        assert len(after) == n * (n - 1) and len(set(after.values())) == 1
    stream = [c for order in orders for c in order] * 2
    assert n == 1 or all(a != b for a, b in zip(stream, stream[1:], strict=False))


@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_bench_cache_json_schema(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """`scripts/bench_cache.py --json` on a tiny model: {"rows": [...]} with the code version and the arguments, the
    issue's keys exactly, every setting's DynamicCache at ratio 1, the default rows present (rope=pre, bf16, a
    left-padded batch of 4, fp8, lut, hadamard), and the storage arithmetic within a few percent of what our packed
    caches hold."""
    import json

    bench = bench_module(monkeypatch)
    out = tmp_path / "speed.json"
    args = ["--model", str(tiny_model_dir), "--lengths", "72", "--new-tokens", "3", "--warmup", "1", "--repeats", "1",
            "--recompute-rank", "64", "--json", str(out)]  # fmt: skip
    returned = bench.main(args)
    data = json.loads(out.read_text())
    assert set(data) == {"rows", "code", "argv"} and data["rows"] == returned and data["argv"] == args
    from kvq_lab.records.provenance import code_version

    assert data["code"] == code_version()
    rows = data["rows"]
    assert all(set(r) == BENCH_KEYS for r in rows)
    kinds = {r["kind"] for r in rows}
    hqq = {"hqq"} if bench.HQQ else set()  # opt-in (pyproject's hqq extra)
    assert kinds == {"dynamic", "ours_packed", "ours_simulated", "ours_recompute", "quanto"} | hqq
    for r in rows:
        assert r["length"] == 72 and r["tok_s"] > 0 and r["prefill_s"] > 0 and r["peak_bytes"] > 0
        assert r["rope"] in ("post", "pre") and r["dtype"] in ("float32", "bfloat16") and r["batch"] in (1, 4)
        if r["kind"] == "dynamic":
            assert r["ratio"] == 1.0 and r["paired_ratio"] == 1.0 and r["format"] is None
        assert r["paired_ratio"] > 0
        # rope=pre rows of ours carry their distance to the same cache with rope=post, the others none
        assert (r["pre_over_post"] is None) == (r["paired_pre_over_post"] is None) == (r["rope"] != "pre"), r
        if r["kind"] == "ours_packed":
            assert 0.95 < r["measured_over_arith"] < 1.1, r
        else:
            assert r["measured_over_arith"] is None
    settings = {(r["dtype"], r["batch"]) for r in rows}
    assert settings == {("float32", 1), ("bfloat16", 1), ("float32", 4)}
    packed = [r for r in rows if r["kind"] == "ours_packed"]
    for dtype, batch in settings:  # rope=pre and rope=post on the default backend in every setting
        assert {r["rope"] for r in packed if (r["dtype"], r["batch"]) == (dtype, batch)} == {"post", "pre"}
    assert {"fp8_e4m3", "lut"} <= {r["format"] for r in packed} and any(r["transform"] == "hadamard" for r in packed)
    assert "same greedy tokens as DynamicCache" in capsys.readouterr().out
