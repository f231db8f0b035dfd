"""Rounding-only reruns: `noise=permute:<seed>` computes the same model with other float rounding
(kvq_lab/models/noise.py), is recorded as such (config, run name, its own run key) and leaves every other run's hash
alone; `model.dtype=float64` is allowed as the CPU reference and refused, in one line before load, where a kernel
cannot take it."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_llama
from helpers_models import compose, tiny_args

from kvq_lab.cache import CacheConfig
from kvq_lab.cache.checks import check_dtype
from kvq_lab.common.errors import ConfigError
from kvq_lab.models.noise import apply_noise, parse_noise, permute_hidden
from kvq_lab.quant import QuantSpec
from kvq_lab.run.config import config_hash, validate


@pytest.mark.parametrize(
    "value,canonical",
    [(None, "none"), ("none", "none"), (False, "none"), ("permute", "permute:0"), ("permute:7", "permute:7")],
)
def test_noise_values_have_one_spelling(value, canonical):
    assert parse_noise(value) == canonical


@pytest.mark.parametrize("value", ["float32", "permute:-1", "permute:x", "true", "shuffle"])
def test_a_bad_noise_value_is_one_line(value):
    with pytest.raises(ConfigError, match=r"noise=.* choose none or permute:<seed>") as e:
        parse_noise(value)
    assert "\n" not in str(e.value)


def logits_of(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("tied", [False, True])
def test_permuted_model_computes_the_same_function_with_other_rounding(tied):
    model = tiny_llama(seed=1)
    if tied:  # the output head is the embedding: permuted once
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    before = logits_of(model, ids)
    permute_hidden(model, seed=3)
    after = logits_of(model, ids)
    assert torch.allclose(before, after, rtol=1e-4, atol=1e-4)
    assert not torch.equal(before, after)  # the sums ran in another order: some last bits differ
    # the same seed, the same permutation: a noise rerun is reproducible
    again = tiny_llama(seed=1)
    if tied:
        again.config.tie_word_embeddings = True
        again.lm_head.weight = again.model.embed_tokens.weight
    assert torch.equal(logits_of(apply_noise(again, "permute:3"), ids), after)


def test_a_wrong_permutation_changes_the_function():
    """The check above is not vacuous: permuting only the embedding (a reader left out) changes the logits."""
    model = tiny_llama(seed=1)
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    before = logits_of(model, ids)
    p = torch.randperm(model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight[:, p])
    assert not torch.allclose(before, logits_of(model, ids), rtol=1e-2, atol=1e-2)


def test_an_unknown_layout_is_refused_naming_the_parameter():
    model = tiny_llama(seed=1)
    model.model.layers[0].extra = torch.nn.Linear(model.config.hidden_size, 8)  # reads the stream, unknown here
    with pytest.raises(
        ConfigError, match=r"noise=permute: model.layers.0.extra.weight has the residual stream's width"
    ):
        permute_hidden(model, seed=0)


def test_noise_is_hashed_only_when_set(tiny_model_dir, tmp_path, data_dir):
    args = tiny_args(tiny_model_dir, tmp_path, data_dir)
    plain = config_hash(compose(args))
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(compose(args), resolve=True)
    del cfg["noise"]  # a record made before the knob existed hashes as before
    assert config_hash(cfg) == plain
    assert config_hash(compose([*args, "noise=none"])) == plain
    permuted = config_hash(compose([*args, "noise=permute:1"]))
    assert permuted != plain and permuted != config_hash(compose([*args, "noise=permute:2"]))
    assert config_hash(compose([*args, "noise=permute"])) == config_hash(compose([*args, "noise=permute:0"]))


def test_a_noise_rerun_is_recorded_as_such(tiny_model_dir, tmp_path, data_dir):
    from kvq_lab.run.runner import run

    args = [*tiny_args(tiny_model_dir, tmp_path, data_dir), "bits=2"]
    base = run(compose(args))
    rerun = run(compose([*args, "noise=permute:1"]))
    records = sorted(tmp_path.glob("runs/*/record.json"))
    assert len(records) == 2  # its own run key: not resumed from the baseline
    rec = json.loads(next(p for p in records if "noise-permute1" in p.parent.name).read_text())
    assert rec["config"]["noise"] == "permute:1" and rec["status"] == "ok"
    assert base["ppl/ppl"] != rerun["ppl/ppl"]  # 2-bit codes flip under other rounding
    assert abs(base["ppl/ppl"] / rerun["ppl/ppl"] - 1) < 0.2


def cache(mode="simulated", backend="auto") -> CacheConfig:
    return CacheConfig(key=QuantSpec(2, 32, "channel"), value=QuantSpec(2, 32, "token"), mode=mode, backend=backend)


def test_float64_runs_on_the_cpu_on_the_pytorch_path():
    assert check_dtype("float64", "cpu", cache("packed")).backend == "torch"
    assert check_dtype("float64", "cpu", cache("packed", "torch")).backend == "torch"
    assert check_dtype("float32", "cpu", cache("packed")).backend == "auto"  # others resolve as before


@pytest.mark.parametrize(
    "device,mode,backend,message",
    [
        ("cuda", "simulated", "auto", r"model.dtype=float64 is the CPU reference for checking; use device=cpu"),
        ("cpu", "packed", "cpu", r"model.dtype=float64: backend=cpu reads fp32, fp16 or bf16 models only"),
        ("cpu", "packed", "triton", r"model.dtype=float64: backend=triton reads fp32, fp16 or bf16 models only"),
    ],
)
def test_float64_where_it_cannot_run_is_one_line(device, mode, backend, message):
    with pytest.raises(ConfigError, match=message):
        check_dtype("float64", device, cache(mode, backend))


def test_float64_is_a_valid_model_dtype(data_dir):
    plan = validate(compose([f"data_dir={data_dir}", "model.dtype=float64", "mode=packed", "logger=none"]))
    assert plan.cfg.dtype == "float64" and plan.cache.backend == "torch"
    with pytest.raises(ConfigError, match=r"model.dtype='float8'; choose one of: float32, float16, bfloat16, float64"):
        validate(compose([f"data_dir={data_dir}", "model.dtype=float8"]))
