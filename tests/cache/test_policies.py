"""Cache policies (`kvq_lab.cache.policies`), driven by the registry: a new policy is covered with no edit here.

For every registered policy: its conf file is its defaults; at 16 bits, with the options under which it keeps every
token (`Policy.lossless`), it is DynamicCache in each mode it runs in (`Policy.modes`); simulated and packed mode
store the same where both apply (per-token groups, no window); the packed cache's bytes are the bit accounting's
layout arithmetic; a left-padded batch holds what each prompt holds alone (and, for token policies, generates what
each generates alone). The default policy reproduces the outputs saved before
policies existed, bit for bit, and `fakequant` the Table-1 ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from helpers_models import gen
from policy_reference import CONFIGS, REFERENCE, portable_outputs
from transformers import DynamicCache

from kvq_lab.cache import QuantizedKVCache
from kvq_lab.cache.accounting import Shape
from kvq_lab.cache.knobs import cache_config
from kvq_lab.cache.layers.tiered import TieredLayer
from kvq_lab.cache.policies import POLICIES, TokenPolicy, get_policy
from kvq_lab.cache.policies.scores import received, score
from kvq_lab.common.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
NAMES = sorted(POLICIES)
TIERED = [n for n in NAMES if issubclass(POLICIES[n], TokenPolicy)]  # token policies: the prompt split in tiers
IN_MODE = [(n, m) for n in NAMES for m in POLICIES[n].modes]
IDS = torch.randint(3, 256, (1, 352), generator=torch.Generator().manual_seed(5))  # 32 + 320: whole packing blocks


def _cache(model, name: str, options: dict | None = None, **knobs) -> QuantizedKVCache:
    policy = {"name": name, **(options or {})}
    return QuantizedKVCache.for_model(model, cache_config({"bits": 2, "backend": "torch", **knobs, "policy": policy}))


TABLE1 = sorted(n for n in CONFIGS if n.startswith("table1"))


@pytest.fixture(scope="module")
def reference():
    return torch.load(REFERENCE)


@pytest.fixture(scope="module")
def today():
    """Today's outputs of the reference configs, and of Table 1's through policy=fakequant, computed as the reference
    was (`portable_outputs`: one process, the same bits on any x86 processor)."""
    return portable_outputs({**CONFIGS, **{f"{n}+fakequant": {**CONFIGS[n], "policy": "fakequant"} for n in TABLE1}})


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_default_policy_reproduces_todays_outputs_bit_for_bit(today, reference, name):
    """Outputs saved at f953f50, before policies existed (tests/cache/policy_reference.py): Table 1's fake quant and
    KIVI's streaming, with sinks, a window, a transform and fp8 codes."""
    assert torch.equal(today[name]["logits"], reference[name]["logits"])
    assert torch.equal(today[name]["tokens"], reference[name]["tokens"])


@pytest.mark.parametrize("name", TABLE1)
def test_the_fakequant_policy_reproduces_table_1_bit_for_bit(today, reference, name):
    got = today[f"{name}+fakequant"]
    assert torch.equal(got["logits"], reference[name]["logits"])
    assert torch.equal(got["tokens"], reference[name]["tokens"])


@pytest.mark.parametrize(
    "knobs,match",
    [
        ({"mode": "packed"}, "policy=fakequant is KIVI Table 1's fake quant of every token; mode=packed keeps"),
        ({"mode": "simulated", "prefill": "exact"}, "policy=fakequant quantizes the prompt too"),
    ],
)
def test_fakequant_refuses_what_is_not_table_1(knobs, match):
    with pytest.raises(ConfigError, match=match) as e:
        cache_config({**knobs, "policy": "fakequant"})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("path", sorted((REPO / "conf" / "policy").glob("*.yaml")), ids=lambda p: p.stem)
def test_a_policy_conf_file_is_the_policys_defaults(path):
    conf = yaml.safe_load(path.read_text())
    assert conf == {"name": path.stem, **dict(get_policy(path.stem).options())}


def test_every_built_in_policy_has_a_conf_file():
    import inspect

    built_in = {cls.name for cls in POLICIES.values() if inspect.getmodule(cls).__name__.startswith("kvq_lab.")}
    assert built_in <= {p.stem for p in (REPO / "conf" / "policy").glob("*.yaml")}


@pytest.mark.parametrize("name,mode", IN_MODE)
def test_sixteen_bits_keeping_every_token_is_dynamic_cache(tiny, name, mode):
    ref = gen(tiny, DynamicCache(config=tiny.config), IDS)
    assert torch.equal(gen(tiny, _cache(tiny, name, POLICIES[name].lossless, bits=16, mode=mode), IDS), ref)


@pytest.mark.parametrize("name", TIERED)
def test_simulated_and_packed_store_the_same_where_both_apply(tiny, name):
    """Per-token groups and no window: each tier's tokens are quantized the same way in both modes."""
    knobs = {"key_axis": "token", "value_axis": "token"}
    sim = gen(tiny, _cache(tiny, name, mode="simulated", prefill="exact", **knobs), IDS, n=12)
    assert torch.equal(gen(tiny, _cache(tiny, name, mode="packed", **knobs), IDS, n=12), sim)


@pytest.mark.parametrize("name", [n for n in NAMES if "packed" in POLICIES[n].modes])
def test_packed_bytes_are_the_layout_arithmetic(tiny, name):
    """Every tier holds whole packing blocks here (320 middle tokens in shares of fifths and halves), so the stored
    bytes after the prompt are what the layer's `stored_bits` counts, exactly. Per-token groups: per-channel ones
    also keep a flush buffer of one group per stream (`FillStream`), which `nbytes()` counts and the arithmetic does
    not."""
    cache = _cache(tiny, name, key_axis="token", value_axis="token", mode="packed")
    with torch.no_grad():
        tiny(IDS, past_key_values=cache)
    H, D, T = tiny.config.num_key_value_heads, tiny.config.head_dim, IDS.shape[1]
    layer = cache.layers[0]
    want = sum(type(layer).stored_bits(layer.cfg, T, Shape(heads=H, head_dim=D))) * H * T * D / 8
    assert cache.layers[0].nbytes()[0] == want


def _fill(cache, k, v, steps: int, query=None):
    """What attention reads after a prompt k, v [B, H, T, D] then `steps` one-token updates, per call and row: the
    columns row b holds ([1, H, n_b, D] K and V copies; a left-padded batch's padding and a token policy's unheld
    columns left out). `query` [B, Hq, T, D]: handed to a layer that ranks by queries after the prompt, as the routed
    attention hands it."""
    from kvq_lab.cache.routing.attention import MaskedKV

    B, T = k.shape[0], k.shape[2] - steps
    valid = cache.padding.valid(B, k.shape[2])

    def rows(out):
        if isinstance(out[0], MaskedKV):
            keys, values, keep = out[0].keys, out[0].values, list(out[0].valid)
        else:
            keys, values, n = out[0], out[1], out[0].shape[2]
            keep = [slice(None) if valid is None else valid[b, :n] for b in range(B)]
        return [(keys[b : b + 1, :, keep[b]].clone(), values[b : b + 1, :, keep[b]].clone()) for b in range(B)]

    outs = [rows(cache.update(k[:, :, :T], v[:, :, :T], 0))]
    layer = cache.layers[0]
    if query is not None and getattr(layer, "pending", False) and layer.wants_queries(query):
        layer.observe(query, k[:, :, :T], 0.125)
    for t in range(T, k.shape[2]):
        outs.append(rows(cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], 0)))
    return outs


@pytest.mark.parametrize("name,mode", IN_MODE)
def test_a_left_padded_batch_holds_what_each_prompt_holds_alone(name, mode):
    """At the cache level: row b of a left-padded batch reads what its prompt alone reads, at every step (a token
    policy ranks each row by its own queries and keeps its own tokens)."""
    knobs = {"bits": 2, "backend": "torch", "mode": mode, "sink_tokens": 4, "policy": name}
    cfg = cache_config({**knobs, "exact_window": 32} if mode == "packed" else knobs)
    lengths, steps = (150, 101), 4
    T = max(lengths)
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(2, 2, T + steps, 64, generator=g), torch.randn(2, 2, T + steps, 64, generator=g)
    q = torch.randn(2, 4, T, 64, generator=g)
    batch = QuantizedKVCache(cfg, 1)
    batch.layers[0].routed = True  # as QuantizedKVCache.for_model sets it on an sdpa model
    batch.set_padding(torch.stack([torch.arange(T) >= T - n for n in lengths]).long())
    outs = _fill(batch, k, v, steps, q)
    for b, n in enumerate(lengths):
        p = T - n
        alone = QuantizedKVCache(cfg, 1)
        one = _fill(alone, k[b : b + 1, :, p:], v[b : b + 1, :, p:], steps, q[b : b + 1, :, p:])
        for got, want in zip(outs, one, strict=True):
            assert torch.equal(got[b][0], want[0][0]) and torch.equal(got[b][1], want[0][1])
        if name in TIERED:
            assert batch.layers[0].rows[b].split_sizes == alone.layers[0].split_sizes


@pytest.mark.parametrize("name", TIERED)
def test_a_batch_generates_what_each_prompt_generates_alone(tiny, name):
    """Through the model: a left-padded batch of two prompts of different lengths (the routed sdpa attention masks
    each row's own columns) greedily generates what each prompt generates alone, up to the batched arithmetic of
    the model (agreement of the logits to 1e-4, and the same tokens)."""
    lengths = (150, 101)
    T = max(lengths)
    ids = torch.randint(3, 256, (2, T), generator=torch.Generator().manual_seed(3))
    mask = torch.stack([torch.arange(T) >= T - n for n in lengths]).long()
    ids = ids * mask
    cache = _cache(tiny, name)
    cache.set_padding(mask)
    with torch.no_grad():
        out = tiny.generate(
            ids, attention_mask=mask, past_key_values=cache, max_new_tokens=8, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
        for b, n in enumerate(lengths):
            alone = tiny.generate(
                ids[b : b + 1, T - n :], past_key_values=_cache(tiny, name), max_new_tokens=8, do_sample=False,
                output_logits=True, return_dict_in_generate=True, pad_token_id=0,
            )  # fmt: skip
            assert torch.equal(out.sequences[b, T:], alone.sequences[0, n:])
            for got, want in zip(out.logits, alone.logits, strict=True):
                assert torch.allclose(got[b], want[0], atol=1e-4)


def test_a_batch_needs_the_routed_attention():
    cache = QuantizedKVCache(cache_config({"bits": 2, "policy": {"name": "evict", "score": "knorm"}}), 1)
    cache.set_padding(torch.tensor([[0, 1, 1], [1, 1, 1]]))
    k = torch.randn(2, 2, 3, 64)
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match="decodes a batch through the routed sdpa attention") as e:
        cache.update(k[:, :, :1], k[:, :, :1], 0)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("precision", ["search", "file"])
@pytest.mark.parametrize("name", TIERED)
def test_per_layer_precision_with_a_token_policy_is_refused_before_load(name, precision, tmp_path, monkeypatch):
    """Per-layer (or per-head) bits price and store the mode's own layers; a token policy's tiers give tokens bits of
    their own. Refused in one line before the load (it crashed after: 'TieredLayer' object has no attribute
    'k_stream')."""
    from helpers_models import compose
    from omegaconf import open_dict

    from kvq_lab.fit.precision_settings import write_file
    from kvq_lab.run.config import validate

    loads = []
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: loads.append(a))
    path = tmp_path / "precision.yaml"
    write_file(path, [2] * 30, [4] * 30, {})
    chosen = ["precision.budget=4"] if precision == "search" else [f"precision.path={path}"]
    cfg = compose([f"precision={precision}", *chosen, "logger=none", f"results_dir={tmp_path}"])
    with open_dict(cfg):  # the policy by its registry name: a contributor's policy may have no conf file yet
        cfg.policy = {"name": name}
    with pytest.raises(ConfigError, match=f"^precision={precision} with policy={name}: the policy's tiers") as e:
        validate(cfg)
    assert "\n" not in str(e.value) and not loads


@pytest.mark.parametrize("name", TIERED)
def test_bad_options_fail_in_one_line_naming_the_option(name):
    with pytest.raises(ConfigError, match=f"policy.colour is not an option of policy={name}; its options: score"):
        cache_config({"policy": {"name": name, "colour": 1}})
    with pytest.raises(ConfigError, match="policy.score='loudness'; choose one of: knorm, attention, snapkv"):
        cache_config({"policy": {"name": name, "score": "loudness"}})
    with pytest.raises(ConfigError, match="keys must carry their positions: use rope=post"):
        cache_config({"policy": name, "rope": "pre"})


# -- what the tiered layer does --------------------------------------------------------------------------------
def test_eviction_keeps_sinks_window_and_the_top_share(tiny):
    cache = _cache(tiny, "evict", {"score": "knorm", "keep": 0.25}, sink_tokens=4)
    with torch.no_grad():
        tiny(IDS, past_key_values=cache)
    layer = cache.layers[0]
    mid = IDS.shape[1] - 4 - 32
    assert layer.split_sizes == [mid // 4, mid - mid // 4]
    assert layer.held() == 4 + 32 + mid // 4 and cache.get_seq_length() == IDS.shape[1]


def test_a_chunk_after_the_split_keeps_its_causal_order(tiny):
    """Positions go on where the prompt ended and the new tokens see each other causally (16 bits, every token
    kept: the logits of a 6-token chunk are DynamicCache's)."""
    exact, kept = DynamicCache(config=tiny.config), _cache(tiny, "evict", {"score": "knorm", "keep": 1.0}, bits=16)
    chunk = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        tiny(IDS, past_key_values=exact), tiny(IDS, past_key_values=kept)
        want, got = tiny(chunk, past_key_values=exact).logits, tiny(chunk, past_key_values=kept).logits
    assert torch.allclose(got, want, atol=1e-5)


def test_attention_scores_are_the_attention_the_model_computes(tiny):
    """`received` against the model's own attention weights (eager attention, output_attentions)."""
    ids = IDS[:, :80]
    seen = {}

    def hook(module, args, kwargs, out):
        seen[module.layer_idx] = out[1]

    tiny.config._attn_implementation = "eager"
    attn = tiny.model.layers[0].self_attn
    handle = attn.register_forward_hook(hook, with_kwargs=True)
    q_seen = {}
    orig = attn.q_proj.forward
    attn.q_proj.forward = lambda x: q_seen.setdefault("q", orig(x))
    try:
        with torch.no_grad():
            out = tiny(ids, past_key_values=DynamicCache(config=tiny.config), output_attentions=True)
    finally:
        handle.remove()
        attn.q_proj.forward = orig
        tiny.config._attn_implementation = "sdpa"
    weights = out.attentions[0]  # [1, Hq, T, T]
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    B, T = ids.shape
    D = tiny.config.head_dim
    q = q_seen["q"].view(B, T, -1, D).transpose(1, 2)
    cache = DynamicCache(config=tiny.config)
    with torch.no_grad():
        tiny(ids, past_key_values=cache)
        cos, sin = tiny.model.rotary_emb(q, torch.arange(T)[None])
    q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    k = cache.layers[0].keys
    assert torch.allclose(received(q, k, D**-0.5), weights.sum((1, 2)), atol=1e-4)
    window = received(q, k, D**-0.5, first=T - 16)
    assert torch.allclose(window, weights[:, :, T - 16 :].sum((1, 2)), atol=1e-4)
    assert torch.equal(score("knorm", k, None, None, 32), -k.norm(dim=-1).sum(1))


def test_a_query_score_without_the_prompts_queries_says_what_to_do(tiny):
    cache = _cache(tiny, "evict", {"score": "snapkv"})
    with torch.no_grad():
        for layer in cache.layers:  # K/V handed over without a forward: no queries come
            k = torch.randn(1, 2, 100, 64)
            layer.update(k, k)
        with pytest.raises(RuntimeError, match="score=snapkv ranks the prompt by the attention its queries pay"):
            cache.layers[0].update(k[:, :, :1], k[:, :, :1])


def test_only_token_policies_build_tiered_layers(tiny):
    assert not any(isinstance(layer, TieredLayer) for layer in _cache(tiny, "kivi").layers)
    assert not any(isinstance(layer, TieredLayer) for layer in _cache(tiny, "fakequant").layers)
    assert all(isinstance(layer, TieredLayer) for layer in _cache(tiny, "evict").layers)
    mixed = _cache(tiny, "evict", skip_layers=[1])  # a skipped layer is plain 16 bits
    assert isinstance(mixed.layers[0], TieredLayer) and not isinstance(mixed.layers[1], TieredLayer)
