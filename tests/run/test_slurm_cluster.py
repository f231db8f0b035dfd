"""Sweeps on a real single-node SLURM (scripts/slurm_local.sh): every way SLURM ends a row ends in a truthful record
and a summary line, never a traceback, a `running` record or a `failed` one for a row stopped from outside.

Marker `slurm`: `make test-slurm` runs these (minutes: each requeue waits for SLURM's begin time); elsewhere they
are skipped with the reason. They start the local cluster themselves (and skip, saying why, where it cannot start).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_models import REPO, tiny_args

from kvq_lab.records.record import load_records

pytestmark = pytest.mark.slurm

SCRIPT = REPO / "scripts" / "slurm_local.sh"


@pytest.fixture(scope="module")
def cluster():
    """SLURM_CONF of the local cluster, started (idempotent) for these tests."""
    out = subprocess.run(["bash", str(SCRIPT), "start"], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        pytest.skip(f"the local SLURM cluster did not start: {(out.stderr or out.stdout).strip()[-300:]}")
    conf = re.search(r"export SLURM_CONF=(\S+)", out.stdout)
    assert conf, out.stdout
    return conf.group(1)


def _env(conf: str) -> dict:
    return {**os.environ, "SLURM_CONF": conf, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}


def _launcher(tmp: Path, *extra: str) -> list[str]:
    return [
        "-m",
        "hydra/launcher=slurm",
        "hydra.launcher.cpus_per_task=1",  # the two rows of a sweep side by side on two cores
        "hydra.launcher.mem_gb=4",
        f"hydra.launcher.submitit_folder={tmp}/submitit/%j",
        *extra,
    ]


def _sweep(conf: str, args: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "run.py"), *args],
        cwd=REPO,
        env=_env(conf),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _start(conf: str, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "run.py"), *args],
        cwd=REPO,
        env=_env(conf),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _jobs(conf: str) -> list[str]:
    """Job ids SLURM knows (sacct, all states), oldest first."""
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-o", "JobID", "-S", "now-1days"],
        env=_env(conf),
        capture_output=True,
        text=True,
        check=True,
    )
    return [j for j in out.stdout.split() if j]


def _running_job(conf: str, results: Path, timeout: float = 300) -> str:
    """The SLURM job id of the row running now, once its record says `running` and its task has started."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        recs = [r for r in load_records(results) if r.get("status") == "running"]
        if recs:
            time.sleep(8)  # into the task
            q = subprocess.run(
                ["squeue", "-h", "-t", "R", "-o", "%i"], env=_env(conf), capture_output=True, text=True, check=True
            )
            ids = q.stdout.split()
            assert ids, "a record says running but SLURM runs no job"
            return ids[0]
        time.sleep(1)
    raise AssertionError("no row started")


def _summary(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith(("sweep:", "  row "))]


def _statuses(results: Path) -> list[tuple[str, str]]:
    recs = sorted(load_records(results), key=lambda r: r["started"])
    return [(r["status"], r.get("reason", "")) for r in recs]


LONG = ["task=ppl", "logger=none", "resume_dirty=true"]  # the embedded model, 4 windows: minutes on one core


def test_two_rows_run_ok_and_a_rerun_submits_nothing(cluster, tiny_model_dir, data_dir, tmp_path):
    args = [*_launcher(tmp_path), *tiny_args(tiny_model_dir, tmp_path, data_dir), "key_bits=2,3"]
    out = _sweep(cluster, args)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted((r["config"]["key_bits"], r["status"]) for r in load_records(tmp_path)) == [(2, "ok"), (3, "ok")]
    assert _summary(out.stderr)[0] == "sweep: 2 of 2 rows ok or skipped"
    before = _jobs(cluster)
    again = _sweep(cluster, args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "all 2 rows have completed records; nothing submitted" in again.stderr
    assert _jobs(cluster) == before and len(load_records(tmp_path)) == 2  # no allocation, no record
    assert "Traceback" not in out.stderr + again.stderr


def test_a_setting_the_partition_cannot_satisfy_fails_before_submission(cluster, tiny_model_dir, data_dir, tmp_path):
    before = _jobs(cluster)
    for bad, words in [
        ("hydra.launcher.timeout_min=100000", "exceeds partition"),
        ("hydra.launcher.cpus_per_task=64", "cpus_per_task=64"),
        ("hydra.launcher.gpus_per_node=1", "has no GPUs"),
    ]:
        out = _sweep(cluster, [*_launcher(tmp_path, bad), *tiny_args(tiny_model_dir, tmp_path, data_dir)])
        lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
        assert out.returncode == 2 and len(lines) == 1 and words in lines[0], out.stderr[-2000:]
        assert "Traceback" not in out.stderr
    assert _jobs(cluster) == before and not load_records(tmp_path)


@pytest.mark.slow
def test_a_row_at_its_time_limit_is_interrupted_not_failed(cluster, data_dir, tmp_path):
    """timeout_min=1 with the warning 40 s ahead: the row is recorded `interrupted` (time limit) with its progress;
    max_num_timeout=0: not requeued, the sweep ends with the row's line and exit status 1."""
    args = _launcher(tmp_path, "hydra.launcher.timeout_min=1", "hydra.launcher.signal_delay_s=40",
                     "hydra.launcher.max_num_timeout=0")  # fmt: skip
    out = _sweep(cluster, [*args, *LONG, f"results_dir={tmp_path}", f"data_dir={data_dir}"])
    assert out.returncode == 1, out.stderr[-3000:]
    assert _statuses(tmp_path) == [("interrupted", "time limit")]
    (rec,) = load_records(tmp_path)
    assert rec["signal"] == "SIGUSR2" and rec["progress"]["unit"]
    (row,) = _summary(out.stderr)[1:]
    assert re.match(r"  row 1 \(.*\): interrupted: SIGUSR2 \(time limit\) after \d+ ", row), row
    assert "Traceback" not in out.stderr


STOPS = [  # how a running row is stopped from outside -> its records, oldest first, and the sweep's exit status
    (["scancel", "--signal=USR2"], [("interrupted", "preempted"), ("ok", "")], 0),  # submitit requeues, rerun ends
    (["scontrol", "requeue"], [("interrupted", "preempted"), ("ok", "")], 0),  # SIGTERM; SLURM requeues; the host waits
    (["scancel"], [("interrupted", "cancelled")], 1),  # SIGTERM; the job ends with a result; the summary says so
]


@pytest.mark.slow
@pytest.mark.parametrize("command, statuses, code", STOPS, ids=["sigusr2-preemption", "requeue", "scancel"])
def test_a_row_stopped_from_outside_ends_truthfully(cluster, data_dir, tmp_path, command, statuses, code):
    proc = _start(cluster, [*_launcher(tmp_path), *LONG, f"results_dir={tmp_path}", f"data_dir={data_dir}"])
    job = _running_job(cluster, tmp_path)
    subprocess.run([*command, job], env=_env(cluster), check=True)
    out, err = proc.communicate(timeout=1200)
    assert proc.returncode == code, err[-3000:]
    assert _statuses(tmp_path) == statuses and "Traceback" not in err
    summary = _summary(err)
    if code == 0:
        assert summary[0] == "sweep: 1 of 1 rows ok or skipped"
    else:
        assert re.match(r"  row 1 \(.*\): interrupted: SIGTERM \(cancelled\) after \d+ ", summary[1]), summary
