"""Trust: no stale result reported as new, interrupted runs that say so, a claim per row, bad input caught before
any model load, and nothing left behind by a rejected config."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from helpers_models import REPO, compose, tiny_args

from kvq_lab.records.claims import Claim
from kvq_lab.records.record import RECORD, load_records, write_record
from kvq_lab.run.config import ConfigError, validate
from kvq_lab.run.runner import run

COQA = "coqa/coqa-validation.first20.lm_eval.jsonl"


def _statuses(results: Path) -> list[str]:
    return [r["status"] for r in load_records(results)] if (results / "runs").exists() else []


@pytest.fixture
def data_copy(data_dir, tmp_path):
    """A private, writable copy of the CoQA data (the only file task=ppl reads)."""
    d = tmp_path / "data"
    (d / "coqa").mkdir(parents=True)
    shutil.copy(data_dir / COQA, d / COQA)
    return d


# --- the resume key: data, model, code, libraries ----------------------------------------------------------------


def test_changed_data_reruns_and_the_record_says_what_it_read(tiny_model_dir, data_copy, tmp_path, capsys):
    res = tmp_path / "res"
    args = tiny_args(tiny_model_dir, res, data_copy)
    first = run(compose(args))
    rec = load_records(res)[0]
    assert rec["inputs"]["data"]["source"] == "local" and COQA in rec["inputs"]["data"]["files"]
    assert rec["inputs"]["model"]["source"] == "folder" and len(rec["inputs"]["code"]) == 16
    assert run(compose(args)) == first and "skip: a completed record" in capsys.readouterr().out

    path = data_copy / COQA
    lines = path.read_text().splitlines()
    row = json.loads(lines[0])
    row["story"] = "A different story. " + row["story"]
    path.write_text("\n".join([json.dumps(row), *lines[1:]]) + "\n")
    run(compose(args))
    assert "skip:" not in capsys.readouterr().out
    recs = load_records(res)
    assert len(recs) == 2 and recs[0]["run_key"] != recs[1]["run_key"]
    assert recs[0]["inputs"]["data"]["files"][COQA] != recs[1]["inputs"]["data"]["files"][COQA]


def test_changed_code_reruns(tiny_model_dir, data_dir, tmp_path, monkeypatch, capsys):
    import kvq_lab.records.provenance as prov

    args = tiny_args(tiny_model_dir, tmp_path, data_dir)
    run(compose(args))
    monkeypatch.setattr(prov, "code_version", lambda root=prov.PACKAGE: "0123456789abcdef")
    run(compose(args))
    assert "skip:" not in capsys.readouterr().out and len(load_records(tmp_path)) == 2


def test_code_version_hashes_the_sources_not_git(tmp_path):
    from kvq_lab.records.provenance import PACKAGE, code_version

    copy = tmp_path / "pkg"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert code_version(copy) == code_version(PACKAGE)
    (copy / "quant" / "reference.py").write_text((copy / "quant" / "reference.py").read_text() + "\n# changed\n")
    assert code_version(copy) != code_version(PACKAGE)
    (copy / "notes.txt").write_text("not code")  # only .py/.c/.yaml count
    (copy / "quant" / "reference.py").write_text((PACKAGE / "quant" / "reference.py").read_text())
    assert code_version(copy) == code_version(PACKAGE)


def test_model_identity_follows_the_weights(tiny_model_dir, tmp_path):
    from kvq_lab.records.provenance import model_identity

    copy = tmp_path / "m"
    shutil.copytree(tiny_model_dir, copy)
    assert model_identity(str(copy))["sha256"] == model_identity(str(tiny_model_dir))["sha256"]
    (copy / "config.json").write_text((copy / "config.json").read_text().replace("10000.0", "20000.0"))
    assert model_identity(str(copy))["sha256"] != model_identity(str(tiny_model_dir))["sha256"]
    assert model_identity("org/some-model", "v1") == {"source": "hub", "id": "org/some-model", "revision": "v1"}


def test_dirty_tree_records_are_not_reused_unless_asked(tiny_model_dir, data_dir, tmp_path, monkeypatch, capsys):
    import kvq_lab.records.environment as results

    args = [a for a in tiny_args(tiny_model_dir, tmp_path, data_dir) if not a.startswith("resume_dirty")]
    monkeypatch.setattr(results, "git_hash", lambda: "abc123-dirty")
    run(compose(args))
    monkeypatch.setattr(results, "git_hash", lambda: "abc123")
    run(compose(args))  # the dirty record is passed over, with a note
    out = capsys.readouterr().out
    assert "skip:" not in out and "uncommitted changes" in out and len(load_records(tmp_path)) == 2
    run(compose(args))  # the clean one is reused
    assert "skip: a completed record" in capsys.readouterr().out
    shutil.rmtree(load_records(tmp_path)[1]["_path"])
    run(compose([*args, "resume_dirty=true"]))  # asked: the dirty one is reused
    assert "skip: a completed record" in capsys.readouterr().out and len(load_records(tmp_path)) == 1


# --- claims ---------------------------------------------------------------------------------------------------------


def test_claim_is_exclusive_released_and_a_leftover_file_is_taken_over(tmp_path):
    a = Claim.acquire(tmp_path, "k1")
    assert a is not None and Claim.acquire(tmp_path, "k1") is None  # a second holder is refused (even in-process)
    assert f"pid {os.getpid()}" in Claim.holder(tmp_path, "k1")
    assert Claim.acquire(tmp_path, "k2") is not None  # other rows are free
    a.release()
    assert not (tmp_path / "claims" / "k1.lock").exists()
    (tmp_path / "claims" / "k1.lock").write_text('{"host": "gone", "pid": 1}')  # left by a killed process
    b = Claim.acquire(tmp_path, "k1")
    assert b is not None and f"pid {os.getpid()}" in Claim.holder(tmp_path, "k1")
    b.release()


def test_a_claimed_row_is_skipped_and_a_stale_running_record_is_marked_died(tiny_model_dir, data_dir, tmp_path, capsys):
    args = tiny_args(tiny_model_dir, tmp_path, data_dir)
    plan = validate(compose(args))
    held = Claim.acquire(tmp_path, plan.row_key)
    assert run(compose(args)) == {} and "being run now by pid" in capsys.readouterr().out
    assert _statuses(tmp_path) == []
    held.release()
    # a record left 'running' by a process that died (its claim is free now)
    d = tmp_path / "runs" / "old"
    d.mkdir(parents=True)
    write_record(d / RECORD, {"status": "running", "run_key": plan.run_key, "row_key": plan.row_key, "metrics": {}})
    run(compose(args))
    assert sorted(_statuses(tmp_path)) == ["died", "ok"]


@pytest.mark.slow  # two real run.py sweeps at once: ~1 min on 2 cores
def test_two_concurrent_sweeps_never_run_a_row_twice(tiny_model_dir, data_dir, tmp_path):
    args = ["-m", *tiny_args(tiny_model_dir, tmp_path, data_dir), "task.eval_tokens=48", "key_bits=2,3,4,8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    procs = [
        subprocess.Popen([sys.executable, str(REPO / "run.py"), *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]  # fmt: skip
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    recs = load_records(tmp_path)
    bits = sorted(r["config"]["key_bits"] for r in recs)
    assert bits == [2, 3, 4, 8] and all(r["status"] == "ok" for r in recs)  # each row once, none twice
    skips = sum(o[0].count("skip:") for o in outs)
    assert skips == 4  # every row: run by one sweep, skipped by the other (claimed, or already done)


# --- signals ----------------------------------------------------------------------------------------------------


class _Run:
    """run.py in a subprocess, its stderr read as it comes (a thread), so a test can wait for a line of progress."""

    def __init__(self, args: list[str]):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
        cmd = [sys.executable, str(REPO / "run.py"), *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.err = b""
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while chunk := os.read(self.proc.stderr.fileno(), 65536):
            self.err += chunk

    def wait_for(self, text: str, timeout: float = 300) -> None:
        """Until stderr shows `text` (a progress bar's unit: the process is inside that stage)."""
        deadline = time.time() + timeout
        while text.encode() not in self.err:
            if self.proc.poll() is not None or time.time() > deadline:
                raise AssertionError(f"no {text!r} on stderr: {self.proc.poll()} {self.err[-2000:].decode()}")
            time.sleep(0.1)

    def finish(self, timeout: float = 300) -> str:
        self.proc.wait(timeout=timeout)
        self.reader.join(timeout=30)
        return self.err.decode()


@pytest.mark.slow  # real subprocesses: ~40 s
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_marks_the_record_interrupted_and_stops_the_sweep(tiny_model_dir, data_dir, tmp_path, sig, code):
    args = ["-m", *tiny_args(tiny_model_dir, tmp_path, data_dir), "task.eval_tokens=4000", "task.context_tokens=16",
            "task.windows=1", "key_bits=2,3"]  # fmt: skip
    run_ = _Run(args)
    run_.wait_for("decode ppl")  # the first row's decode has started (a fixed wait was too short on a busy machine)
    time.sleep(1)  # a few steps done
    run_.proc.send_signal(sig)
    err = run_.finish()
    proc = run_.proc
    assert proc.returncode == code, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.strip() and "it/s]" not in ln and "decode ppl" not in ln]
    stop = next(i for i, ln in enumerate(lines) if ln.startswith(f"interrupted: {sig.name} after "))
    assert "decode steps" in lines[stop] and "Traceback" not in err
    assert lines[stop + 1 :][:1] == ["sweep: 0 of 2 rows ok or skipped"]  # then a line per row
    assert lines[stop + 2].startswith(f"  row 1 (key_bits=2): interrupted: {sig.name} after ")
    assert lines[stop + 3] == "  row 2 (key_bits=3): not run"
    (rec,) = load_records(tmp_path)  # the sweep stopped at its first row
    assert rec["status"] == "interrupted" and rec["signal"] == sig.name and rec["interrupted"]
    assert rec["progress"]["unit"] == "decode steps" and 0 < rec["progress"]["done"] < 4000
    assert not list((tmp_path / "claims").glob("*.lock"))  # the claim was released


# --- bad input: one line, before load, nothing left behind --------------------------------------------------------


def _bad_inputs(tmp: Path, data_dir: Path) -> list[tuple[list[str], str]]:
    notmodel = tmp / "notes.txt"
    notmodel.write_text("hello")
    empty = tmp / "empty" / "coqa"
    empty.mkdir(parents=True)
    (empty / "coqa-validation.first20.lm_eval.jsonl").write_text("")
    corrupt = tmp / "corrupt" / "coqa"
    corrupt.mkdir(parents=True)
    (corrupt / "coqa-validation.first20.lm_eval.jsonl").write_text('{"story": "x", "questions": {}, "answers": {}}\n{')
    afile = tmp / "afile"
    afile.write_text("")
    return [
        (["device=cuda:7"], "device=cuda:7"),
        (["mode=packed", "backend=triton"], "backend=triton"),
        ([f"model.path={notmodel}"], "not a GGUF model"),
        (["model=hub", f"model.path={tmp}"], "without config.json"),
        (["model=hub"], "model.path=<hub id"),
        (["model=hub", "model.path=not/a/hub/id"], "neither an existing local path"),
        (["limit=5000"], "limit=5000 but task=coqa_turns has 297 documents"),
        (["task=coqa", "limit=21"], "has 20 documents"),
        (["task=ppl", "task.windows=50"], "has 7282 tokens; 50 windows of 512+512 need 51200"),
        ([f"data_dir={empty.parent}"], "is empty"),
        ([f"data_dir={corrupt.parent}"], "line 2 is not valid JSON"),
        (["+unknown_knob=1"], "unknown_knob is not a kvq_lab setting"),
        (["+task.windws=2", "task=ppl"], "task.windws is not an option of task=ppl"),
        (["+model.revison=x"], "model.revison is not a setting of model"),
        (["probe=yes"], "probe='yes' must be true or false"),
        (["resume=1"], "resume=1 must be true or false"),
        (["probe=true", "probes.figures=maybe"], "figures='maybe' must be true or false"),
        (["results_dir="], "results_dir='' must be a folder path"),
        ([f"results_dir={afile}"], "exists and is not a folder"),
        (["run_name=a/b"], "cannot be a folder name"),
        (["experiment_name=../x"], "must be a plain name"),
        (["logger=wandb", "logger.mode=sometimes"], "logger.mode='sometimes'"),
    ]


@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_every_bad_input_fails_before_load_with_one_line(data_dir, tmp_path, monkeypatch):
    import kvq_lab.models.loading as models

    def no_load(*a, **k):
        raise AssertionError("a model was loaded for a bad input")

    monkeypatch.setattr(models, "load_model", no_load)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    res = tmp_path / "res"
    for args, message in _bad_inputs(tmp_path, data_dir):
        cfg = compose([f"data_dir={data_dir}", f"results_dir={res}", *args])
        with pytest.raises(ConfigError) as e:
            run(cfg)
        assert message in str(e.value) and "\n" not in str(e.value), (args, str(e.value))
    assert not res.exists()  # nothing was created for any of them


@pytest.mark.slow  # a subprocess: ~10 s
def test_rejected_config_leaves_no_folder_behind(data_dir, tmp_path):
    env = {**os.environ, "KVQ_DATA_DIR": str(data_dir)}
    out = subprocess.run(
        [sys.executable, str(REPO / "run.py"), "value_axis=head", f"results_dir={tmp_path / 'res'}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: value_axis='head' is not allowed; choose one of: token, channel"
    ]
    assert list(tmp_path.iterdir()) == []  # no results_dir, no hydra/ or outputs/ folder anywhere here


# --- transformers' FutureWarning ---------------------------------------------------------------------------------


def test_generate_gets_the_cache_under_the_installed_name(tiny_model):
    from kvq_lab.cache import CacheConfig, QuantizedKVCache
    from kvq_lab.models.loading import cache_kwarg

    ids = torch.randint(3, 200, (1, 12))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the pytest filter for the old name does not apply here
        cache = QuantizedKVCache.for_model(tiny_model, CacheConfig())
        out = tiny_model.generate(ids, max_new_tokens=4, do_sample=False, **{cache_kwarg(): cache})
        tiny_model(out[:, -1:], **{cache_kwarg(): cache})  # a plain forward step takes the same name
    assert cache.get_seq_length() == out.shape[1]  # the cache really was the one used
