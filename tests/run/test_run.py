"""The whole path through run.py: records, W&B offline runs, multirun sweeps, and the real model on real CoQA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args, timeout=600):
    env = {**os.environ, "WANDB_MODE": "offline"}
    p = subprocess.run(
        [sys.executable, "run.py", *args], cwd=REPO, capture_output=True, text=True, env=env, timeout=timeout
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def records(results: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(results.glob("runs/*/record.json"))]


def test_multirun_of_two_configs_writes_two_records(tiny_model_dir, data_dir, tmp_path):
    sweep = ["-m", "key_axis=channel,token", f"model.path={tiny_model_dir}", "model.head_dim=64", "limit=2",
             f"data_dir={data_dir}", f"results_dir={tmp_path}", "resume_dirty=true"]  # fmt: skip
    run_cli(*sweep, "logger=wandb")
    recs = records(tmp_path)
    assert len(recs) == 2
    assert {r["cache"] for r in recs} == {"K2b-C32_V2b-T32_sim", "K2b-T32_V2b-T32_sim"}
    for r in recs:
        assert r["status"] == "ok"
        assert r["metrics"]["coqa_turns/n"] == 2
        assert 0 <= r["metrics"]["coqa_turns/f1"] <= 100 and "coqa_turns/em" in r["metrics"]
        assert r["config"]["model"]["path"] == str(tiny_model_dir)
        assert r["env"]["versions"]["transformers"] and r["env"]["git"]
        assert r["timings"]["task_s"] > 0
        # the offline W&B mirror sits next to the record
        wdir = Path(r["wandb_dir"])
        assert wdir.name.startswith("offline-run-") and list(wdir.glob("*.wandb")), wdir
    # a rerun of the same sweep finds both rows done and adds nothing
    p = run_cli(*sweep, "logger=none")
    assert p.stdout.count("skip: a completed record") == 2
    assert p.stdout.count("coqa_turns/f1=") == 2  # the skip reports the score it reuses
    assert len(records(tmp_path)) == 2


def test_runs_never_overwrite_each_other(tiny_model_dir, data_dir, tmp_path):
    for _ in range(2):
        run_cli(
            f"model.path={tiny_model_dir}",
            "model.head_dim=64",
            "limit=1",
            "resume=false",
            "logger=none",
            f"data_dir={data_dir}",
            f"results_dir={tmp_path}",
            "run_name=same",
        )
    recs = records(tmp_path)
    assert len(recs) == 2 and len({r["name"] for r in recs}) == 1


@pytest.mark.slow
def test_smollm2_on_real_coqa(data_dir, tmp_path):
    """The README's command on the real model and data, shortened: accuracy lands in the record."""
    p = run_cli("key_axis=channel", "value_axis=token", "limit=4", f"data_dir={data_dir}", f"results_dir={tmp_path}")
    (rec,) = records(tmp_path)
    assert rec["metrics"]["coqa_turns/n"] == 4
    assert "coqa_turns/f1" in p.stdout
