"""What tests/test_throwaway_plugins.py runs in a fresh process with the throwaway plug-ins loaded
(`pytest -p throwaway_plugins tests/throwaway_checks.py`): each plug-in is found by validation, accounting,
calibration, a real run's record, and the experiment table, with no edit anywhere but its own file."""

import json

import pytest
import throwaway_plugins as tw
import torch
from helpers_models import compose, tiny_args
from omegaconf import open_dict

from kvq_lab.cache.accounting import tensor_bits
from kvq_lab.cache.knobs import cache_config
from kvq_lab.common.errors import ConfigError
from kvq_lab.fit.calibration import fit_layer
from kvq_lab.fit.calibration_settings import needs_calibration, what_is_fitted
from kvq_lab.quant.transforms import get_transform


def test_validation_accepts_them_and_names_them_in_errors():
    cache = cache_config({"format": tw.FORMAT, "key_transform": tw.TRANSFORM})
    assert cache.key.format == cache.value.format == tw.FORMAT and cache.key_transform == (tw.TRANSFORM,)
    with pytest.raises(ConfigError, match=f"{tw.FORMAT} takes 2 bits"):
        cache_config({"format": tw.FORMAT, "bits": 3})
    with pytest.raises(ConfigError, match=tw.TRANSFORM):
        cache_config({"value_transform": "tw_nothing"})


def test_accounting_adds_the_table_and_the_fitted_parameters():
    n, heads, dim = 1024, 2, 64
    plain = tensor_bits(cache_config({"format": "int", "bits": 2}), "key", n, heads, dim)
    table = tensor_bits(cache_config({"format": tw.FORMAT}), "key", n, heads, dim)
    both = tensor_bits(cache_config({"format": tw.FORMAT, "key_transform": tw.TRANSFORM}), "key", n, heads, dim)
    assert table - plain == pytest.approx(8 * 16 / (heads * n * dim))  # 4 fp32 table entries per layer
    assert both - table == pytest.approx(16 / n)  # one fp16 scale per (head, channel)


def test_calibration_asks_for_data_and_fits_the_transform():
    cache = cache_config({"key_transform": tw.TRANSFORM})
    assert needs_calibration(cache) and what_is_fitted(cache) == f"key_transform={tw.TRANSFORM}"
    g = torch.Generator().manual_seed(0)
    cap = {k: torch.randn(1, 2, 64, 64, generator=g) for k in ("key_pre", "g_key_pre", "value", "g_value")}
    (spelling,) = fit_layer(cache, cap, None).key_transform
    assert spelling.startswith(f"{tw.TRANSFORM}@") and get_transform(spelling).scale.shape == (2, 64)


def test_a_run_records_them_and_the_table_shows_them(tiny_model_dir, data_dir, tmp_path, monkeypatch):
    from kvq_lab.report.tables import make_report
    from kvq_lab.run.runner import run

    monkeypatch.setenv("KVQ_CALIBRATION_CACHE", str(tmp_path / "fits"))
    overrides = [
        f"format={tw.FORMAT}",
        f"key_transform={tw.TRANSFORM}",
        "experiment_name=tw_study",
        "calibration.tokens=256",
        "calibration.chunk=128",
        "probe=true",
        "probes.n_prompts=1",
        "probes.max_tokens=64",
        "probes.figures=false",
    ]
    cfg = compose(tiny_args(tiny_model_dir, tmp_path / "results", data_dir) + overrides)
    with open_dict(cfg):
        cfg.task = {"name": tw.TASK}
    metrics = run(cfg)
    assert f"{tw.TASK}/top_logprob" in metrics and f"probe/key/{tw.ERROR}/mean" in metrics
    (path,) = (tmp_path / "results" / "runs").glob("*/record.json")
    rec = json.loads(path.read_text())
    assert rec["status"] == "ok" and rec["cache_config"]["key"]["format"] == tw.FORMAT
    assert rec["metrics"]["cache/bits_total_key"] > rec["metrics"]["cache/bits_total_value"]  # the fitted scales
    md, _ = make_report(tmp_path / "results", "tw_study", tmp_path / "table")
    assert "TW top logprob" in md and "K max err" in md
