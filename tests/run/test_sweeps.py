"""Resumable, honest sweeps: a rerun skips rows whose record exists for the same resolved config (config hash),
a killed sweep resumes with the missing rows only, a failing run leaves a record saying why (a failing row of a
sweep: tests/run/test_faults.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_models import REPO, compose, run_py, tiny_args

from kvq_lab.records.record import load_records, write_record
from kvq_lab.run.runner import RunFailed, run

ROWS = ["key_bits=2", "key_bits=3", "key_bits=4"]


def records(results: Path) -> list[dict]:
    return load_records(results)


def test_records_of_one_second_load_in_the_order_they_started(tmp_path):
    """Run folders are named from the second they were made (`new_run_dir`), so two runs of one second sort by name;
    `load_records` puts them in the order they started (a fast failed row, then the next, as a sweep ran them)."""
    for folder, started in [("20261202-100500_b_first", "2026-12-02T10:05:00.100000"),
                            ("20261202-100500_a_second", "2026-12-02T10:05:00.900000"),
                            ("20261202-100459_z_older", "2026-12-02T10:04:59")]:  # fmt: skip
        d = tmp_path / "runs" / folder
        d.mkdir(parents=True)
        (d / "record.json").write_text(json.dumps({"started": started}))
    assert [Path(r["_path"]).name for r in records(tmp_path)] == [
        "20261202-100459_z_older", "20261202-100500_b_first", "20261202-100500_a_second",
    ]  # fmt: skip


@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_rerun_skips_done_rows_and_runs_missing_ones(tiny_model_dir, data_dir, tmp_path):
    base = tiny_args(tiny_model_dir, tmp_path, data_dir)
    first = [run(compose(base + [row])) for row in ROWS]
    recs = records(tmp_path)
    assert [r["status"] for r in recs] == ["ok"] * 3 and len({r["config_hash"] for r in recs}) == 3
    # one row lost (deleted), one killed mid-run (its record still says "running")
    lost = next(r for r in recs if r["config"]["key_bits"] == 3)
    shutil.rmtree(lost["_path"])
    killed = next(r for r in recs if r["config"]["key_bits"] == 4)
    rec = json.loads((Path(killed["_path"]) / "record.json").read_text())  # as a killed run leaves it: sealed
    write_record(Path(killed["_path"]) / "record.json", {**rec, "status": "running", "metrics": {}})

    again = [run(compose(base + [row])) for row in ROWS]
    assert again == first  # same config, same seed, same metrics (the skipped row returns its stored ones)
    after = records(tmp_path)
    by_bits = {b: [r["status"] for r in after if r["config"]["key_bits"] == b] for b in (2, 3, 4)}
    # row 2 not repeated; 3 and 4 ran again; the killed row's stale `running` record now says it died
    assert by_bits == {2: ["ok"], 3: ["ok"], 4: ["died", "ok"]}


def test_resume_false_runs_again(tiny_model_dir, data_dir, tmp_path):
    base = tiny_args(tiny_model_dir, tmp_path, data_dir) + ["key_bits=2"]
    run(compose(base))
    run(compose(base + ["resume=false"]))
    assert [r["status"] for r in records(tmp_path)] == ["ok", "ok"]


@pytest.mark.slow  # subprocess run.py: ~20-45 s on 2 busy cores
def test_killed_sweep_completes_missing_rows_only(tiny_model_dir, data_dir, tmp_path):
    """A real multirun, SIGKILLed while its second row runs; the rerun runs rows 2 and 3 and skips row 1."""
    args = ["-m", *tiny_args(tiny_model_dir, tmp_path, data_dir), "task.eval_tokens=64", "key_bits=2,3,4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "run.py"), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            recs = records(tmp_path) if (tmp_path / "runs").exists() else []
            if len(recs) >= 2:  # row 1 finished, row 2 started (records are written when a run starts)
                break
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    killed = records(tmp_path)
    assert [r["status"] for r in killed][:1] == ["ok"]
    assert sum(r["status"] == "ok" for r in killed) < 3, "the sweep finished before it could be killed"

    out = run_py(args)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("skip:") == 1
    recs = records(tmp_path)
    ok = [r for r in recs if r["status"] == "ok"]
    assert sorted(r["config"]["key_bits"] for r in ok) == [2, 3, 4]  # each row exactly once
    assert len(recs) - len(ok) == len(killed) - sum(r["status"] == "ok" for r in killed)  # only the killed leftovers


@pytest.mark.slow  # subprocess run.py: ~20-45 s on 2 busy cores
def test_single_failed_run_exits_1(tiny_model_dir, data_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not weights")  # valid config: the load itself fails
    args = [*tiny_args(broken, tmp_path / "res", data_dir)]
    out = run_py(args)
    assert out.returncode == 1 and "failed" in out.stderr
    assert [r["status"] for r in records(tmp_path / "res")] == ["failed"]
    with pytest.raises(RunFailed, match="safetensors|header"):
        run(compose(args))
