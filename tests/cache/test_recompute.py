"""mode=recompute (kvq_lab/cache/layers/recompute.py): X (or its rank-r projection) cached, K and V rebuilt each step.

Oracles: at 16 bits the cache generates DynamicCache's greedy tokens (X itself and the full-rank projection), paired
with settings that must change them (2 bits; a rank below [W_k; W_v]'s); nbytes() against the packed layout's own
count; bad input fails in one line before the weights load."""

from __future__ import annotations

import pytest
import torch
from helpers_models import compose, tiny_args
from transformers import DynamicCache

from kvq_lab.cache import CacheConfig, QuantizedKVCache
from kvq_lab.cache.layers.recompute import RecomputeError, RecomputeLayer
from kvq_lab.quant.spec import QuantConfigError, QuantSpec

PROMPT = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(1))


def recompute_cfg(bits: int, rank: int | None = None, R: int = 0, axis: str = "channel", S: int = 0, backend="torch"):
    spec = QuantSpec(bits, 32, axis)
    return CacheConfig(
        key=spec, value=spec, mode="recompute", recompute_rank=rank, exact_window=R, sink_tokens=S, backend=backend
    )


def greedy(model, cache, ids=PROMPT, n=20, **kw):
    return model.generate(ids, past_key_values=cache, max_new_tokens=n, do_sample=False, **kw)


@pytest.fixture(scope="module")
def reference(tiny_model):
    return greedy(tiny_model, DynamicCache(config=tiny_model.config))


@pytest.mark.parametrize("rank", [None, 128])  # X itself; the full rank of [W_k; W_v] (hidden size 128)
def test_16_bits_equals_dynamic_cache(tiny_model, reference, rank):
    out = greedy(tiny_model, QuantizedKVCache.for_model(tiny_model, recompute_cfg(16, rank)))
    assert torch.equal(out, reference)


@pytest.mark.parametrize("bits,rank", [(2, None), (16, 16)])
def test_lossy_settings_change_the_tokens(tiny_model, reference, bits, rank):
    """The pair of the oracle above: 2-bit X, or a rank below [W_k; W_v]'s, must change the generation."""
    out = greedy(tiny_model, QuantizedKVCache.for_model(tiny_model, recompute_cfg(bits, rank)))
    assert not torch.equal(out, reference)


def test_16_bits_logits_match_and_decode_reads_rebuilt_kv(tiny_model):
    """Decode logits at 16 bits agree with DynamicCache's (fp32 rounding of the rebuilt K/V only), and the layer
    really serves rebuilt K/V: a perturbed stored X changes them."""
    ids = PROMPT
    dyn = DynamicCache(config=tiny_model.config)
    rec = QuantizedKVCache.for_model(tiny_model, recompute_cfg(16))
    with torch.no_grad():
        tiny_model(ids, past_key_values=dyn)
        tiny_model(ids, past_key_values=rec)
        nxt = torch.tensor([[5]])
        a = tiny_model(nxt, past_key_values=dyn).logits
        b = tiny_model(nxt, past_key_values=rec).logits
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        layer = rec.layers[0]
        k0, _ = layer.rebuild()
        layer.stream.x[:, :, 3] += 1.0
        k1, _ = layer.rebuild()
    assert not torch.equal(k0[:, :, 3], k1[:, :, 3]) and torch.equal(k0[:, :, 4:], k1[:, :, 4:])


@pytest.mark.parametrize("axis,R,S", [("token", 0, 0), ("channel", 32, 0), ("token", 32, 4), ("channel", 0, 3)])
def test_quantized_close_to_exact_and_window_sinks(tiny_model, axis, R, S):
    """8-bit X with any axis, window and sinks: decode logits stay close to DynamicCache's; 2-bit departs more."""
    ids = PROMPT
    errs = {}
    for bits in (8, 2):
        dyn = DynamicCache(config=tiny_model.config)
        rec = QuantizedKVCache.for_model(tiny_model, recompute_cfg(bits, None, R, axis, S))
        with torch.no_grad():
            tiny_model(ids, past_key_values=dyn)
            tiny_model(ids, past_key_values=rec)
            e = 0.0
            for t in range(40):
                nxt = torch.tensor([[3 + t]])
                a, b = tiny_model(nxt, past_key_values=dyn).logits, tiny_model(nxt, past_key_values=rec).logits
                e = max(e, float((a - b).abs().max() / a.abs().max()))
        errs[bits] = e
    assert errs[8] < 0.05 < errs[2], errs


def test_left_padded_batch_equals_dynamic_cache(tiny_model):
    """Two prompts of different lengths, left-padded: at 16 bits the batch generates DynamicCache's tokens."""
    a, b = PROMPT[:, :40], PROMPT[:, 10:40]
    ids = torch.cat([a, torch.cat([torch.zeros(1, 10, dtype=torch.long), b], 1)])
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    ref = greedy(tiny_model, DynamicCache(config=tiny_model.config), ids, attention_mask=mask)
    cache = QuantizedKVCache.for_model(tiny_model, recompute_cfg(16))
    cache.set_padding(mask)
    assert torch.equal(greedy(tiny_model, cache, ids, attention_mask=mask), ref)


def test_chunked_prefill_matches_one_prefill(tiny_model):
    """A prompt given in two pieces leaves the same stored X (16 bits) and the same next logits."""
    ids = PROMPT
    one = QuantizedKVCache.for_model(tiny_model, recompute_cfg(16))
    two = QuantizedKVCache.for_model(tiny_model, recompute_cfg(16))
    with torch.no_grad():
        la = tiny_model(ids, past_key_values=one).logits[:, -1]
        tiny_model(ids[:, :25], past_key_values=two)
        lb = tiny_model(ids[:, 25:], past_key_values=two).logits[:, -1]
    torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(two.layers[1].stream.x, one.layers[1].stream.x, rtol=1e-5, atol=1e-5)


def test_nbytes_counts_what_is_stored(tiny_model):
    """16 bits: N tokens x width x the model's element size per layer; 4-bit per-token groups with R = 0: the packed
    layout's own count of one [1, 1, N, r] tensor (`kvq_lab.quant.formats.tensor_nbytes`) per layer. N = 64, whole
    blocks of 32 tokens: storage grows by blocks, and nbytes() counts what is held."""
    from kvq_lab.quant.formats import tensor_nbytes
    from kvq_lab.quant.reference import code_format

    L = tiny_model.config.num_hidden_layers
    with torch.no_grad():
        for bits, rank in ((16, None), (16, 48), (4, 64), (4, None)):
            cfg = recompute_cfg(bits, rank, axis="token")
            cache = QuantizedKVCache.for_model(tiny_model, cfg)
            tiny_model(torch.randint(3, 256, (1, 63)), past_key_values=cache)
            tiny_model(torch.tensor([[7]]), past_key_values=cache)
            N, r = 64, rank or tiny_model.config.hidden_size
            want = N * r * 4 if bits == 16 else tensor_nbytes(code_format(cfg.key), 32, "token", N, r)
            nb = cache.nbytes()
            assert nb["stored"] == L * want, (bits, rank)
            assert nb["fp16"] == L * 2 * 2 * N * 64 * 2  # 2 KV heads x head_dim 64, K and V, fp16


def test_other_caches_unaffected_by_the_hook(tiny_model, reference):
    """The capture hook stays on the model; a DynamicCache or packed cache built afterwards is untouched by it."""
    QuantizedKVCache.for_model(tiny_model, recompute_cfg(2))
    assert torch.equal(greedy(tiny_model, DynamicCache(config=tiny_model.config)), reference)
    packed = CacheConfig(key=QuantSpec(16), value=QuantSpec(16), mode="packed")
    assert torch.equal(greedy(tiny_model, QuantizedKVCache.for_model(tiny_model, packed)), reference)


def test_layer_without_hook_fails_in_one_line(tiny_model):
    cache = QuantizedKVCache(recompute_cfg(16), tiny_model.config.num_hidden_layers)
    with pytest.raises(RuntimeError, match="for_model"):
        tiny_model(PROMPT, past_key_values=cache)
    assert isinstance(cache.layers[0], RecomputeLayer)


# -- bad input: one line, before the weights load -------------------------------------------------------------------
@pytest.mark.parametrize("rank", [0, -3, True])
def test_rank_below_one_is_one_line(rank):
    with pytest.raises(QuantConfigError, match="recompute.rank") as e:
        recompute_cfg(4, rank)
    assert "\n" not in str(e.value)


def test_config_errors_are_one_line():
    with pytest.raises(QuantConfigError, match="mode=recompute only"):
        CacheConfig(mode="packed", recompute_rank=8)
    with pytest.raises(QuantConfigError, match="value quantizer"):
        CacheConfig(key=QuantSpec(4), value=QuantSpec(2), mode="recompute")
    with pytest.raises(QuantConfigError, match="transforms"):
        CacheConfig(key=QuantSpec(4), value=QuantSpec(4), mode="recompute", rope="pre")


def test_rank_above_kv_dims_fails_before_load(tiny_model_dir, tmp_path, data_dir, monkeypatch):
    from kvq_lab.run.config import ConfigError, validate

    loads = []
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: loads.append(a))
    args = tiny_args(tiny_model_dir, tmp_path, data_dir) + ["mode=recompute", "bits=4"]
    validate(compose(args + ["recompute.rank=128"]))  # the tiny model's limit: min(hidden 128, K+V dims 256)
    with pytest.raises(ConfigError, match=r"recompute.rank=129 is outside \[1, 128\]") as e:
        validate(compose(args + ["recompute.rank=129"]))
    assert "\n" not in str(e.value) and not loads
    with pytest.raises(ConfigError, match="probes"):
        validate(compose(args + ["probe=true"]))


def test_fused_qkv_model_fails_before_load(tmp_path, data_dir, monkeypatch):
    """A model whose attention has no separate k_proj/v_proj (GPT-2's fused c_attn) is refused from its config."""
    from transformers import GPT2Config

    from kvq_lab.run.config import ConfigError, validate

    GPT2Config(n_layer=2, n_embd=64, n_head=2).save_pretrained(tmp_path / "gpt2")
    loads = []
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: loads.append(a))
    args = tiny_args(tmp_path / "gpt2", tmp_path / "results", data_dir) + ["mode=recompute", "bits=4"]
    with pytest.raises(ConfigError, match="k_proj/v_proj") as e:
        validate(compose(args))
    assert "\n" not in str(e.value) and not loads


def test_rank_checked_again_when_the_cache_is_built(tiny_model):
    with pytest.raises(RecomputeError, match="outside"):
        QuantizedKVCache.for_model(tiny_model, recompute_cfg(4, 1000))


def test_run_ppl_end_to_end(tiny_model_dir, tmp_path, data_dir):
    """run(cfg) with mode=recompute: a decode perplexity; 16 bits equals the 16-bit packed cache's (same model)."""
    from kvq_lab.run.runner import run

    base = tiny_args(tiny_model_dir, tmp_path, data_dir)
    rec = run(compose(base + ["mode=recompute", "bits=16"]))
    pac = run(compose(base + ["mode=packed", "bits=16"]))
    low = run(compose(base + ["mode=recompute", "bits=2", "recompute.rank=32"]))
    key = next(k for k in rec if "ppl" in k)
    assert rec[key] == pytest.approx(pac[key], rel=1e-4)
    assert low[key] != pytest.approx(rec[key], rel=1e-3)
    # bytes by nbytes(), not the K/V formulas: the tiny model's X (128 fp32) is as large as its fp16 K/V (2 x 2 x 64)
    assert rec["cache/bits_total"] == 16.0 and "cache/bits_key" not in rec
    assert low["cache/bits_total"] < 8.0


@pytest.mark.slow
def test_smollm2_16_bits_equals_dynamic_cache(smol):
    model, tok = smol
    ids = tok("The history of the printing press begins in the fifteenth century, when", return_tensors="pt").input_ids
    ref = greedy(model, DynamicCache(config=model.config), ids, n=24)
    for rank in (None, 384):  # X itself; the full rank of [W_k; W_v] (3 KV heads x 64 x 2)
        out = greedy(model, QuantizedKVCache.for_model(model, recompute_cfg(16, rank)), ids, n=24)
        assert torch.equal(out, ref), rank
    low = greedy(model, QuantizedKVCache.for_model(model, recompute_cfg(2, 64)), ids, n=24)
    assert not torch.equal(low, ref)


def test_fitted_methods_refused_before_load(tiny_model_dir, tmp_path, data_dir, monkeypatch):
    from kvq_lab.run.config import ConfigError, validate

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    args = tiny_args(tiny_model_dir, tmp_path, data_dir) + ["mode=recompute", "format=nuq", "bits=4"]
    with pytest.raises(ConfigError, match="fitted on K/V"):
        validate(compose(args))


def test_per_layer_configs_refused():
    spec = QuantSpec(4)
    with pytest.raises(QuantConfigError, match="per-layer"):
        CacheConfig(key=spec, value=spec, mode="recompute", layers=(CacheConfig(key=spec, value=spec),))


def test_triton_takes_power_of_two_widths_only(tiny_model, monkeypatch):
    """backend=triton with a width of X its kernels cannot tile fails when the cache is built; backend=auto (here
    made to pick Triton) stores such an X on the PyTorch path and generates what backend=torch generates."""
    import kvq_lab.cache.layers.recompute as rc

    real = rc.get_backend

    def fake(name, specs=()):  # Triton's name without importing it (the interpreter is slow and not needed here)
        b = real("torch")
        return type("FakeTriton", (), {"name": "triton", **{k: getattr(b, k) for k in ("write", "dequantize")}})

    monkeypatch.setattr(rc, "get_backend", lambda name, specs=(): fake(name) if name != "torch" else real("torch"))
    with pytest.raises(RecomputeError, match="power-of-two"):
        QuantizedKVCache.for_model(tiny_model, recompute_cfg(4, 48, backend="triton"))
    auto = QuantizedKVCache.for_model(tiny_model, recompute_cfg(4, 48, backend="auto"))
    assert all(layer.backend.name == "torch" for layer in auto.layers)
    kept = QuantizedKVCache.for_model(tiny_model, recompute_cfg(4, 64, backend="auto"))
    assert all(layer.backend.name == "triton" for layer in kept.layers)
    ref = greedy(tiny_model, QuantizedKVCache.for_model(tiny_model, recompute_cfg(4, 48)))
    assert torch.equal(greedy(tiny_model, auto), ref)


def test_rank_is_an_lm_eval_model_arg(tiny_model_dir, monkeypatch):
    """`--model kvq --model_args ...,mode=recompute,recompute.rank=r` (kvq_lab/lmeval/cli.py) builds run.py's recompute
    cache: at 16 bits and full rank it generates DynamicCache's tokens, at rank 16 it does not; no rank caches X; a
    rank beyond [W_k; W_v]'s, or a rank without mode=recompute, fails in one line before the weights load."""
    from lm_eval.api.registry import get_model

    import kvq_lab.lmeval.cli as kl
    from kvq_lab.run.config import ConfigError

    args = f"pretrained={tiny_model_dir},mode=recompute,bits=16,exact_window=0,backend=torch"
    full = get_model("kvq").create_from_arg_string(args + ",recompute.rank=128")
    low = get_model("kvq").create_from_arg_string(args + ",recompute.rank=16")
    assert (full.cache_config.mode, full.cache_config.recompute_rank, low.cache_config.recompute_rank) == (
        "recompute",
        128,
        16,
    )
    assert kl.cache_from_args({"mode": "recompute", "bits": 4}).recompute_rank is None  # X itself
    ref = greedy(full.model, DynamicCache(config=full.model.config))
    assert torch.equal(greedy(full.model, full.make_cache()), ref)
    assert not torch.equal(greedy(low.model, low.make_cache()), ref)
    loads = []
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: loads.append(a))
    with pytest.raises(ConfigError, match=r"recompute.rank=129 is outside \[1, 128\]") as e:
        get_model("kvq").create_from_arg_string(args + ",recompute.rank=129")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="recompute.rank=64 applies to mode=recompute only"):
        get_model("kvq").create_from_arg_string(f"pretrained={tiny_model_dir},mode=packed,recompute.rank=64")
    with pytest.raises(ConfigError, match="model arg 'recompute_rank' is not a kvq setting.*recompute.rank"):
        get_model("kvq").create_from_arg_string(f"pretrained={tiny_model_dir},recompute_rank=64")
    assert not loads
