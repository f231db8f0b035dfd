"""Sweeps on Hydra's launcher plugins write the same records as the basic launcher, and resume across them."""

from __future__ import annotations

import pytest
from helpers_models import run_py, tiny_args

from kvq_lab.records.record import load_records


@pytest.mark.slow  # real processes per row: ~1 min a sweep on 2 cores
def test_a_sweep_on_a_launcher_plugin_resumes_on_the_others(tiny_model_dir, data_dir, tmp_path):
    """joblib's records are those of the basic launcher: a rerun on submitit_local, then on the basic launcher, runs
    nothing (each launcher's own run is its plugin's business; what is ours is that they share records)."""
    args = [*tiny_args(tiny_model_dir, tmp_path, data_dir), "key_bits=2,3"]
    out = run_py(["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *args])
    assert out.returncode == 0, out.stderr[-3000:]
    recs = load_records(tmp_path)
    assert sorted((r["config"]["key_bits"], r["status"]) for r in recs) == [(2, "ok"), (3, "ok")]
    again = run_py(["-m", "hydra/launcher=submitit_local", *args])  # a rerun on another plugin writes nothing
    assert again.returncode == 0 and len(load_records(tmp_path)) == 2, again.stderr[-3000:]
    basic = run_py(["-m", *args])  # nor on the basic launcher
    assert basic.returncode == 0 and basic.stdout.count("skip: a completed record") == 2
    assert len(load_records(tmp_path)) == 2
