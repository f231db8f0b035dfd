"""Calibration (`kvq_lab.fit.calibration`, `calibration_settings`, `capture`, `fit_cache`): what it captures, where
it caches, what it refuses, and that fitted configs run in both cache modes and through run.py."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers_models import compose, tiny_args
from omegaconf import OmegaConf
from transformers import DynamicCache

from kvq_lab.cache import CacheConfig
from kvq_lab.cache.layers.base import PaddingState
from kvq_lab.cache.layers.packed import PackedLayer
from kvq_lab.cache.layers.simulated import SimulatedLayer
from kvq_lab.cache.routing.rope import RopeHelper
from kvq_lab.fit import calibration as C
from kvq_lab.fit.calibration_settings import DEFAULTS, token_ids
from kvq_lab.fit.capture import capture
from kvq_lab.quant.spec import QuantSpec
from kvq_lab.quant.transforms.rope_pre import rotate
from kvq_lab.run.config import ConfigError, config_hash, validate


class ByteTokenizer:
    """Bytes as token ids (the tiny model's vocabulary is 256)."""

    def __call__(self, text, return_tensors=None, add_special_tokens=False):
        return SimpleNamespace(input_ids=torch.tensor([list(text.encode()[:20000])]))


def settings(**kw):
    """A run's calibration section: short texts for the tiny model."""
    return {"tokens": 128, "chunk": 64, **kw}


METHOD = CacheConfig(
    QuantSpec(3, 32, "channel", "nuq"),
    QuantSpec(2, 32, "token", "nuq"),
    key_transform=["rope_pre", "rotatekv:16"],
)


def test_capture_is_what_the_model_hands_the_cache(tiny_model):
    """Pre-RoPE keys rotated at their positions and values equal what DynamicCache receives, chunk by chunk (each
    chunk is its own sequence: positions restart); gradients exist where keys and values are consumed."""
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(0))
    caps = capture(tiny_model, ids, chunk=40)
    rope = RopeHelper(tiny_model.model.rotary_emb)
    for c0 in (0, 40):
        dc = DynamicCache(config=tiny_model.config)
        with torch.no_grad():
            tiny_model(ids[:, c0 : c0 + 40], past_key_values=dc)
        for i, cap in enumerate(caps):
            part = slice(c0, c0 + 40)
            pos = rope.positions(cap["key_pre"], cap["positions"][:, part])
            k = rotate(cap["key_pre"][:, :, part], pos.cos, pos.sin)
            torch.testing.assert_close(k, dc.layers[i].keys, rtol=0, atol=1e-5)
            assert torch.equal(cap["value"][:, :, part], dc.layers[i].values)
    for cap in caps:
        for g in ("g_key_pre", "g_value"):
            assert torch.isfinite(cap[g]).all() and cap[g].abs().sum() > 0
    assert all(not p.requires_grad for p in tiny_model.parameters()) or all(
        p.requires_grad for p in tiny_model.parameters()
    )  # parameters' flags restored as they were


def _tiny_gemma3():
    """Gemma 3's layout at toy size: keys normalised per head (k_norm) before RoPE, one RoPE base on the sliding
    layer and another on the global one, one KV head."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    types = ["sliding_attention", "full_attention"]
    cfg = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=64,
                           layer_types=types, max_position_embeddings=256)  # fmt: skip
    return Gemma3ForCausalLM(cfg).eval()


def test_capture_on_a_model_with_key_norms_and_rope_by_layer_type():
    """Gemma 3: what RoPE rotates is k_norm's output, at the base frequency of the layer's type; the captured keys
    rotated by each layer's own RoPE (`layer_ropes`) are what DynamicCache receives. Before, calibration read k_proj
    and asked the rotary module without a layer type: every fitted method failed on Gemma after the model load."""
    model = _tiny_gemma3()
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    caps = capture(model, ids, chunk=40)
    ropes = C.layer_ropes(model)
    assert [r.layer_type for r in ropes] == ["sliding_attention", "full_attention"]
    dc = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=dc)
    for i, (cap, rope) in enumerate(zip(caps, ropes, strict=True)):
        pos = rope.positions(cap["key_pre"], cap["positions"])
        torch.testing.assert_close(rotate(cap["key_pre"], pos.cos, pos.sin), dc.layers[i].keys, rtol=0, atol=1e-5)
        assert torch.equal(cap["value"], dc.layers[i].values)
        assert torch.isfinite(cap["g_key_pre"]).all() and cap["g_key_pre"].abs().sum() > 0
    cos = [r.positions(caps[0]["key_pre"], caps[0]["positions"]).cos for r in ropes]
    assert not torch.allclose(cos[0], cos[1])  # two bases: one helper for both layers would rotate one wrongly


def test_calibration_is_fitted_once_and_cached(tiny_model, tmp_path, monkeypatch, data_dir):
    monkeypatch.setenv("KVQ_CALIBRATION_CACHE", str(tmp_path))
    tok = ByteTokenizer()
    f = C.calibrate(tiny_model, tok, METHOD, settings(), data_dir, "tiny")
    assert len(f.layers) == tiny_model.config.num_hidden_layers
    lc = f.for_layer(1)
    assert lc.key.format == lc.value.format == "lut" and lc.key.codebook is not None
    assert lc.key_transform[0] == "rope_pre" and lc.key_transform[1].startswith("rotatekv:16@")
    assert f.for_layer(0).key.codebook != lc.key.codebook  # a codebook per layer
    (saved,) = tmp_path.glob("*.pt")

    def no_capture(*a, **k):
        raise AssertionError("captured again")

    monkeypatch.setattr(C, "capture", no_capture)  # the capture that calibrate calls
    assert C.calibrate(tiny_model, tok, METHOD, settings(), data_dir, "tiny") == f  # from the disk cache
    with pytest.raises(AssertionError, match="captured again"):  # other settings: another fit
        C.calibrate(tiny_model, tok, METHOD, settings(tokens=192), data_dir, "tiny")
    assert C.calibrate(tiny_model, tok, CacheConfig(), settings(), data_dir, "tiny") == CacheConfig()  # nothing fitted


def test_fitted_config_simulated_equals_packed(tiny_model, tmp_path, monkeypatch, data_dir):
    """Where both modes quantize the same tokens with the same groups (R = 0) they hold the same values, bit for bit,
    with the fitted codebooks and transforms of a layer; and the fitted layers differ from the unfitted ones."""
    monkeypatch.setenv("KVQ_CALIBRATION_CACHE", str(tmp_path))
    f = C.calibrate(tiny_model, ByteTokenizer(), METHOD, settings(), data_dir, "tiny")
    rope = RopeHelper(tiny_model.model.rotary_emb)
    lc = f.for_layer(1)
    sim = SimulatedLayer(lc, rope, PaddingState())
    pk = PackedLayer(CacheConfig(**{**lc.__dict__, "mode": "packed", "backend": "torch"}), rope, PaddingState())
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 2, 100, 64, generator=g), torch.randn(1, 2, 100, 64, generator=g)
    sim.update(k[:, :, :64], v[:, :, :64])
    pk.update(k[:, :, :64], v[:, :, :64])
    for N in range(64, 100):
        ks, vs = sim.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
        pk.update(k[:, :, N : N + 1], v[:, :, N : N + 1])
    K, V = pk.materialize()
    assert torch.equal(K[:, :, :96], ks[:, :, :96]) and torch.equal(V, vs)
    nf = SimulatedLayer(CacheConfig(QuantSpec(3, 32, "channel", "nuq"), QuantSpec(2, 32, "token", "nuq")), rope)
    nf.update(k, v)
    assert not torch.equal(nf.update(k[:, :, :1], v[:, :, :1])[1][:, :, :100], vs)


def test_coqa_tail_must_not_overlap_the_ppl_windows():
    task = {"name": "ppl", "source": "coqa_stories", "windows": 4, "context_tokens": 512, "eval_tokens": 512}
    s = {**DEFAULTS, "source": "coqa_stories", "tokens": 2048}
    with pytest.raises(ValueError, match="overlap the 4096 that task=ppl scores") as e:
        token_ids(ByteTokenizer(), "x" * 5000, s, task)
    assert "\n" not in str(e.value)
    assert token_ids(ByteTokenizer(), "x" * 7000, s, task).shape == (1, 2048)  # the tail, after the windows


BAD = [
    (["key_format=nuq", "calibration.source=null"], r"^key_format=nuq is fitted on calibration data: set calibration"),
    (["key_transform=innerq", "calibration=file"], r"^calibration.source=file needs calibration.path="),
    (["key_outliers=0.01", "calibration=coqa_stories"], r"would fit key_outliers=0.01 on the stories task=coqa_turns"),
    (["key_format=nuq", "calibration.tokens=3"], r"^calibration.tokens=3 must be an integer >= 64$"),
    (["key_format=nuq", "+calibration.bogus=1"], r"^calibration.bogus is not a calibration setting"),
    (["key_format=nuq", "key_bits=16"], r"^key_format=nuq takes 1, 2, 3, 4 bits; key_bits=16 conflicts"),
    (["value_format=nuq", "value_bits=8"], r"^value_format=nuq takes 1, 2, 3, 4 bits; value_bits=8 conflicts"),
    (["key_outliers=0.5"], r"^key_outliers=0.5 must be a fraction in \[0, 0.5\)"),
    (["value_outliers=-0.1"], r"^value_outliers=-0.1 must be a fraction"),
    (["value_transform=innerq"], r"innerq transforms keys only"),
    (["key_transform=rotatekv:12"], r"rotatekv:12 has a block that is not a power of two"),
    (["key_transform=rotatekv:128", "model.head_dim=64"], r"rotatekv needs Hadamard blocks .* use rotatekv:64"),
    (["key_transform=innerq@0123456789ab"], r"names a fitted transform this process has not fitted"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_method_settings_fail_in_one_line_before_load(overrides, message, data_dir):
    with pytest.raises(ConfigError, match=message) as e:
        validate(compose([*overrides, f"data_dir={data_dir}"]))
    assert "\n" not in str(e.value)


def test_calibration_settings_hash_only_where_used(data_dir):
    h = lambda *o: config_hash(compose([*o, f"data_dir={data_dir}"]))  # noqa: E731
    assert h() == h("calibration.tokens=4096")  # no fitted method: calibration is not part of the run
    assert h("key_format=nuq") != h("key_format=nuq", "calibration.tokens=4096")
    assert h("key_outliers=0.0") == h()


@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_methods_run_end_to_end(tiny_model_dir, data_dir, tmp_path, monkeypatch):
    """run.py with fitted methods: calibration once (the second run reads the disk cache), every stored bit counted."""
    from kvq_lab.run.runner import run

    monkeypatch.setenv("KVQ_CALIBRATION_CACHE", str(tmp_path / "cal"))
    cal = ["calibration.tokens=128", "calibration.chunk=64"]
    args = tiny_args(tiny_model_dir, tmp_path, data_dir) + cal
    m = run(compose(args + ["key_format=nuq", "key_bits=3", "rope=pre", "key_outliers=0.01", "value_outliers=0.01"]))
    assert math.isfinite(m["ppl/ppl"])
    assert m["cache/bits_total_key"] > m["cache/bits_key"] + 0.48  # outliers (48 bits x 1%) and the codebooks
    assert len(list((tmp_path / "cal").glob("*.pt"))) == 1
    packed = ["mode=packed", "exact_window=32", "value_outliers=0.01"]  # sparse outliers in the packed store
    m2 = run(compose(args + ["key_transform=innerq", "key_axis=token", *packed]))
    assert math.isfinite(m2["ppl/ppl"]) and len(list((tmp_path / "cal").glob("*.pt"))) == 2
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert any("_Kinnerq" in r for r in runs) and any("Kout0.01" in r for r in runs)
    assert Path(tmp_path / "runs").is_dir()


@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_methods_experiment_rows_validate(data_dir):
    """Every row of conf/experiment/methods.yaml validates for both of its tasks, and the rows are distinct caches."""
    from kvq_lab.run.config import validate

    exp = OmegaConf.load(Path(__file__).resolve().parents[2] / "conf" / "experiment" / "methods.yaml")
    rows = str(exp.hydra.sweeper.params.quant).split(",")
    labels = set()
    for row in rows:
        for task in ("ppl", "coqa_turns"):
            plan = validate(compose(["experiment=methods", f"quant={row}", f"task={task}", f"data_dir={data_dir}"]))
            assert plan.cache.mode == "packed" and plan.cache.exact_window == 128
        labels.add(plan.cache.label())
    assert len(labels) == len(rows) >= 11  # the rows the issue asks for, and the ones added since (innerq:alpha)


@pytest.mark.slow
def test_calibration_on_smollm2(smol, tmp_path, monkeypatch, data_dir):
    """The real model: GSM8K-train calibration fits a valid lut codebook per layer and tensor, each its own (neither
    int's even grid nor NormalFloat), and the fitted cache decodes finite logits that pick the 16-bit token."""
    model, tok = smol
    monkeypatch.setenv("KVQ_CALIBRATION_CACHE", str(tmp_path))
    method = CacheConfig(QuantSpec(3, 32, "channel", "nuq"), QuantSpec(3, 32, "token", "nuq"), rope="pre")
    f = C.calibrate(model, tok, method, settings(tokens=256, chunk=256), data_dir, "smol")
    books = {lc.key.codebook for lc in f.layers} | {lc.value.codebook for lc in f.layers}
    assert len(books) == 2 * model.config.num_hidden_layers
    even = torch.arange(8) / 7
    for cb in books:
        assert cb[0] == 0 and cb[-1] == 1 and (torch.tensor(cb) - even).abs().max() > 0.01
    ids = tok("Question: what is two plus two? Answer:", return_tensors="pt").input_ids
    from kvq_lab.cache import QuantizedKVCache

    with torch.no_grad():
        a = model(ids, past_key_values=QuantizedKVCache.for_model(model, f)).logits[0, -1]
        b = model(ids).logits[0, -1]
    assert torch.isfinite(a).all() and a.argmax() == b.argmax()


@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_lm_eval_kvq_model_calibrates_fitted_methods(tiny_model_dir, tmp_path, monkeypatch, data_dir):
    """lm-eval's `--model kvq` fits what run.py fits (calibration's defaults, GSM8K train from $KVQ_DATA_DIR): a
    fitted method never runs with unfitted parameters there either."""
    from lm_eval.api.registry import get_model

    monkeypatch.setenv("KVQ_CALIBRATION_CACHE", str(tmp_path))
    monkeypatch.setenv("KVQ_DATA_DIR", str(data_dir))
    lm = get_model("kvq").create_from_arg_string(f"pretrained={tiny_model_dir},key_transform=innerq,key_axis=token")
    assert len(lm.cache_config.layers) == 2 and lm.cache_config.for_layer(0).key_transform[0].startswith("innerq@")
    plain = get_model("kvq").create_from_arg_string(f"pretrained={tiny_model_dir}")
    assert plain.cache_config.layers == ()
