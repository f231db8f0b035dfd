"""`prefill=exact|quantized` (what the prompt's forward attends to) and `skip_layers` (layers left at 16 bits), in
every cache mode that takes them."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from kvq_lab.cache import QuantizedKVCache
from kvq_lab.cache.knobs import cache_config
from kvq_lab.common.errors import ConfigError
from kvq_lab.models.files import _gguf_sliding, facts
from kvq_lab.quant.spec import QuantConfigError
from kvq_lab.tasks.decode import prefill

IDS = torch.randint(3, 256, (1, 70), generator=torch.Generator().manual_seed(3))


def _cache(model, **knobs):
    return QuantizedKVCache.for_model(model, cache_config({"bits": 2, "backend": "torch", **knobs}))


def _logits(model, cache, ids):
    with torch.no_grad():
        return model(ids, past_key_values=cache).logits[0, -1]


@pytest.mark.parametrize("mode", ["simulated", "packed"])
def test_an_exact_prefill_reads_what_the_model_computed_and_a_quantized_one_does_not(tiny, mode):
    exact = _logits(tiny, DynamicCache(config=tiny.config), IDS)
    assert torch.equal(_logits(tiny, _cache(tiny, mode=mode, prefill="exact"), IDS), exact)
    assert not torch.allclose(_logits(tiny, _cache(tiny, mode=mode, prefill="quantized"), IDS), exact, atol=1e-3)


def test_unset_prefill_is_the_modes_own(tiny):
    exact = _logits(tiny, DynamicCache(config=tiny.config), IDS)
    assert torch.equal(_logits(tiny, _cache(tiny, mode="packed"), IDS), exact)  # KIVI's kernels
    assert not torch.allclose(_logits(tiny, _cache(tiny, mode="simulated"), IDS), exact, atol=1e-3)  # Table 1


def test_simulated_exact_prefill_then_decodes_as_an_exact_handoff(tiny):
    """A prompt forwarded through a simulated cache with prefill=exact leaves what handing it the exact K/V leaves
    (task.prompt_forward=exact): the next steps read the same fake-quantized cache, bit for bit."""
    forwarded = _cache(tiny, mode="simulated", prefill="exact")
    _logits(tiny, forwarded, IDS[:, :60])
    handed = _cache(tiny, mode="simulated")
    prefill(tiny, handed, IDS[:, :60], exact=True)
    for t in range(60, 70):
        assert torch.equal(_logits(tiny, forwarded, IDS[:, t : t + 1]), _logits(tiny, handed, IDS[:, t : t + 1]))


def test_a_task_prefilling_exactly_forwards_through_a_cache_that_quantizes_its_prefill(tiny):
    direct = _logits(tiny, _cache(tiny, mode="packed", prefill="quantized"), IDS)
    via_task = prefill(tiny, _cache(tiny, mode="packed", prefill="quantized"), IDS, exact=True)[0]
    handed = prefill(tiny, _cache(tiny, mode="packed"), IDS, exact=True)[0]  # exact K/V handed over
    assert torch.allclose(via_task, direct.float(), atol=1e-5)  # one position through lm_head: last-bit sums
    assert not torch.allclose(via_task, handed, atol=1e-3)


def test_sixteen_bits_quantize_nothing_in_the_prefill_either(tiny):
    exact = _logits(tiny, DynamicCache(config=tiny.config), IDS)
    for mode in ("simulated", "packed"):
        assert torch.equal(_logits(tiny, _cache(tiny, mode=mode, bits=16, prefill="quantized"), IDS), exact)


def test_simulated_exact_prefill_offers_no_prefix_cut(tiny):
    """A prompt cut in two would read its first piece quantized in the second: no reuse boundary but the empty one."""
    c = _cache(tiny, mode="simulated", prefill="exact")
    assert c.prefix_boundary(64) == 0
    assert _cache(tiny, mode="simulated").prefix_boundary(64) == 64


def test_prefill_names_itself_in_the_label_only_when_set():
    assert cache_config({}).label() == "K2b-C32_V2b-T32_sim"
    assert cache_config({"prefill": "exact"}).label().endswith("_Pexact")
    assert cache_config({"mode": "packed", "prefill": "quantized"}).label().endswith("_Pquant")


def test_unset_new_knobs_leave_the_config_hash_as_it_was(data_dir):
    from helpers_models import compose

    from kvq_lab.run.config import config_hash

    base = config_hash(compose([f"data_dir={data_dir}"]))
    assert config_hash(compose([f"data_dir={data_dir}", "prefill=null", "skip_layers=none"])) == base
    assert config_hash(compose([f"data_dir={data_dir}", "prefill=exact"])) != base
    assert config_hash(compose([f"data_dir={data_dir}", "skip_layers=[0]"])) != base


# -- skip_layers ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["simulated", "packed"])
def test_skipping_every_layer_is_dynamic_cache(tiny, mode):
    from helpers_models import gen

    ref = gen(tiny, DynamicCache(config=tiny.config), IDS)
    assert torch.equal(gen(tiny, _cache(tiny, mode=mode, skip_layers=[0, 1]), IDS), ref)
    assert not torch.equal(gen(tiny, _cache(tiny, mode=mode), IDS), ref)


@pytest.mark.parametrize("mode", ["simulated", "packed"])
def test_a_skipped_layer_stores_sixteen_bits_and_the_others_their_quantizer(tiny, mode):
    c = _cache(tiny, mode=mode, skip_layers=[1])
    _logits(tiny, c, IDS)
    assert c.layers[1].cfg.key.is_identity and c.layers[1].cfg.value.is_identity
    assert c.layers[0].cfg.key.bits == 2 and c.layers[0].cfg.value.bits == 2
    if mode == "packed":
        (s0, f0), (s1, f1) = c.layers[0].nbytes(), c.layers[1].nbytes()
        assert s1 == f1 * tiny.dtype.itemsize // 2 and s0 < f0  # as the model made them (fp32 here)


def test_skipped_layers_count_sixteen_bits(tiny):
    base = QuantizedKVCache.stored_bits(cache_config({"bits": 2}), 1024, tiny)["cache/bits_total"]
    half = QuantizedKVCache.stored_bits(cache_config({"bits": 2, "skip_layers": [0]}), 1024, tiny)["cache/bits_total"]
    assert half == pytest.approx((base + 16) / 2)


def test_sliding_window_is_resolved_from_the_model_and_refused_without_sliding_layers(tiny):
    with pytest.raises(QuantConfigError, match="has no sliding-window layers"):
        _cache(tiny, skip_layers="sliding_window")
    cfg = cache_config({"skip_layers": "sliding_window"})
    assert cfg.resolve_layers((0, 1, 3), 4).skip_layers == (0, 1, 3)
    with pytest.raises(ValueError, match="names no layers until resolve_layers"):
        cfg.for_layer(0)


def test_model_files_name_their_sliding_layers(tmp_path):
    types = ["sliding_attention"] * 5 + ["full_attention"]
    config = {"num_attention_heads": 4, "num_hidden_layers": 6, "hidden_size": 256, "layer_types": types}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert facts(str(tmp_path)).sliding_layers == (0, 1, 2, 3, 4)
    (tmp_path / "config.json").write_text(json.dumps({**config, "layer_types": None}))
    assert facts(str(tmp_path)).sliding_layers == ()
    # GGUF: llama.cpp's pattern for Gemma 3 (every 6th layer global), none without a window, unknown otherwise
    assert _gguf_sliding("gemma3", 512, 12) == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)
    assert _gguf_sliding("llama", None, 12) == () and _gguf_sliding("newarch", 256, 12) is None


def test_gemma_skips_its_fifteen_sliding_layers_before_load(data_dir):
    from helpers_models import compose

    from kvq_lab.models.loading import resolve
    from kvq_lab.run.config import build

    try:
        resolve("gemma3-270m")
    except Exception:
        pytest.skip("gemma3-270m is not installed (make setup installs it)")
    run = build(compose([f"data_dir={data_dir}", "model=gemma3-270m", "skip_layers=sliding_window"]))
    assert run.cache.skip_layers == tuple(i for i in range(18) if (i + 1) % 6)
    assert run.cache.label().endswith("_skip15L")
    with pytest.raises(ConfigError, match="has 18 decoder layers"):
        build(compose([f"data_dir={data_dir}", "model=gemma3-270m", "skip_layers=[18]"]))


def test_a_token_policy_on_gemma_needs_its_sliding_layers_skipped(data_dir):
    from helpers_models import compose

    from kvq_lab.models.loading import resolve
    from kvq_lab.run.config import build

    try:
        resolve("gemma3-270m")
    except Exception:
        pytest.skip("gemma3-270m is not installed (make setup installs it)")
    base = [f"data_dir={data_dir}", "model=gemma3-270m", "policy=evict"]
    with pytest.raises(ConfigError, match="add skip_layers=sliding_window"):
        build(compose(base))
    assert build(compose([*base, "skip_layers=sliding_window"])).cache.policy == "evict"
