"""Sweeps on Hydra's launcher plugins write the same records as the basic launcher, and resume across them."""

from __future__ import annotations

import pytest
from helpers_models import run_py, tiny_args

from kvq_lab.records.record import load_records


@pytest.mark.slow  # real processes per row: ~1 min each on 2 cores
@pytest.mark.parametrize(
    "launcher", [["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"], ["hydra/launcher=submitit_local"]]
)
def test_two_row_sweep_on_a_launcher_plugin(launcher, tiny_model_dir, data_dir, tmp_path):
    args = ["-m", *launcher, *tiny_args(tiny_model_dir, tmp_path, data_dir), "key_bits=2,3"]
    out = run_py(args)
    assert out.returncode == 0, out.stderr[-3000:]
    recs = load_records(tmp_path)
    assert sorted((r["config"]["key_bits"], r["status"]) for r in recs) == [(2, "ok"), (3, "ok")]
    again = run_py(args)  # a rerun on the same launcher writes nothing
    assert again.returncode == 0 and len(load_records(tmp_path)) == 2
    basic = run_py(["-m", *tiny_args(tiny_model_dir, tmp_path, data_dir), "key_bits=2,3"])  # nor on another
    assert basic.returncode == 0 and basic.stdout.count("skip: a completed record") == 2
    assert len(load_records(tmp_path)) == 2
