"""Faults a shared workstation really sees, each ending in a truthful result, never a silently wrong one: a changed
or truncated cache entry (calibration fit, compiled kernel, converted model, sensitivities, hash memo) is named in
one line and rebuilt; an edited record is refused by resume and the report tools; a full disk leaves no record
`running`; a corrupt or full index is rebuilt or bypassed; a sweep validates every row before the first runs and
its exit status says how its rows ended; errors only a model could once tell come before the load in one line;
records name the backend that ran."""

from __future__ import annotations

import io
import json
import os
import resource
import shutil
import sqlite3
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers_models import REPO, compose, run_py, tiny_args

from kvq_lab.common import integrity
from kvq_lab.records.record import RECORD, load_records
from kvq_lab.run.config import ConfigError, validate
from kvq_lab.run.runner import RecordNotWritten, run

NUQ = ["key_format=nuq", "calibration.tokens=256", "calibration.chunk=128"]


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """Private calibration, kernel and sensitivity caches for the test. The kernel is built at -O0: these tests
    check how a library is verified and rebuilt, not its speed, and -O0 builds in ~1/7 of -O3's time."""
    for var, sub in (("KVQ_CALIBRATION_CACHE", "cal"), ("KVQ_KERNEL_CACHE", "kern"), ("KVQ_PRECISION_CACHE", "sens")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("KVQ_KERNEL_CFLAGS", "-O0")  # after -O3 on the compiler's line: the last -O wins
    return tmp_path


# --- cache entries: verified on read, named and rebuilt -------------------------------------------------------------


def _fit_file(root: Path) -> Path:
    (path,) = (root / "cal").glob("*.pt")
    return path


def _change_a_codebook(path: Path, reseal: bool) -> None:
    saved = torch.load(io.BytesIO(path.read_bytes()), weights_only=False)
    layer = saved["layers"][0]
    book = list(layer.key.codebook)
    book[1] = (book[0] + book[1]) / 2  # one value of layer 0's key codebook moves
    saved["layers"] = (replace(layer, key=replace(layer.key, codebook=tuple(book))), *saved["layers"][1:])
    buf = io.BytesIO()
    torch.save(saved, buf)
    if reseal:  # a consistent file of another fit (its digest rewritten too)
        integrity.write_verified(path, buf.getvalue())
    else:  # changed on disk behind kvq_lab's back
        path.write_bytes(buf.getvalue())


def test_a_changed_calibration_fit_is_named_and_fitted_again(tiny_model_dir, data_dir, caches, capsys):
    res = caches / "res"
    args = tiny_args(tiny_model_dir, res, data_dir) + NUQ
    first = run(compose(args))
    (rec1,) = load_records(res)
    assert rec1["inputs"]["fitted"] and rec1["run_key"] != rec1["row_key"]  # the fit is part of the run key
    assert validate(compose(args)).run_key == rec1["run_key"]  # known before any load: a rerun skips at once
    path = _fit_file(caches)

    _change_a_codebook(path, reseal=False)
    capsys.readouterr()
    assert run(compose(args + ["resume=false"])) == first  # fitted again: the same numbers, not the changed ones
    err = capsys.readouterr().err
    assert f"{path} does not match its digest" in err and "fitting again" in err
    rec2 = load_records(res)[-1]
    assert rec2["inputs"]["fitted"] == rec1["inputs"]["fitted"] and rec2["run_key"] == rec1["run_key"]

    path.write_bytes(path.read_bytes()[:10])  # truncated
    assert run(compose(args + ["resume=false"])) == first
    assert f"{path} does not match its digest (truncated or changed: 10 bytes)" in capsys.readouterr().err

    _change_a_codebook(path, reseal=True)  # another fit, consistently stored: another run, never the old record
    changed = run(compose(args))
    out = capsys.readouterr().out
    assert "skip:" not in out and changed != first
    rec3 = load_records(res)[-1]
    assert rec3["inputs"]["fitted"] != rec1["inputs"]["fitted"] and rec3["run_key"] != rec1["run_key"]
    assert rec3["row_key"] == rec1["row_key"]  # the same row of a sweep


def test_a_changed_kernel_library_is_named_and_rebuilt(caches, capsys):
    from kvq_lab.kernels import cpu_build

    so = cpu_build._built()
    digest = integrity.verify_file(so)
    so.write_bytes(so.read_bytes()[: so.stat().st_size // 2])
    assert cpu_build._built() == so and integrity.verify_file(so) == digest  # rebuilt whole, not loaded half
    assert f"{so} does not match its digest" in capsys.readouterr().err
    integrity.sidecar(so).unlink()  # a library from before digests: rebuilt too
    assert cpu_build._built() == so and "has no digest beside it" in capsys.readouterr().err


@pytest.mark.slow  # two subprocesses: ~20 s
def test_a_truncated_kernel_library_never_crashes_a_run(tiny_model_dir, data_dir, caches):
    """A truncated .so used to be loaded and kill every packed run with SIGBUS, printing nothing."""
    env = {**os.environ, "KVQ_KERNEL_CACHE": str(caches / "kern")}
    subprocess.run([sys.executable, "-c", "from kvq_lab.kernels import cpu_kernel; cpu_kernel.load()"], env=env,
                   check=True, cwd=REPO)  # fmt: skip
    (so,) = (caches / "kern").glob("*.so")
    so.write_bytes(so.read_bytes()[:4096])
    args = [*tiny_args(tiny_model_dir, caches / "res", data_dir), "mode=packed", "backend=auto"]
    out = subprocess.run([sys.executable, str(REPO / "run.py"), *args], env={**env, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, cwd=REPO, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"{so} does not match its digest" in out.stderr
    (rec,) = load_records(caches / "res")
    assert rec["status"] == "ok" and rec["backend"] == "cpu"


def test_changed_sensitivities_are_named_and_measured_again(tiny_model, caches, capsys):
    from kvq_lab.cache import CacheConfig
    from kvq_lab.fit import precision

    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    cache = CacheConfig(mode="simulated")
    first, path = precision.cached_sensitivities(tiny_model, ids, cache, [2, 4], "tiny", "text")
    raw = json.loads(path.read_text())
    raw["key"]["2"][0] = 1e9
    path.write_text(json.dumps(raw))
    again, _ = precision.cached_sensitivities(tiny_model, ids, cache, [2, 4], "tiny", "text")
    assert again == first and f"{path} does not match its digest" in capsys.readouterr().err


def test_a_changed_converted_model_is_named_and_converted_again(tmp_path, monkeypatch, capsys):
    from kvq_lab.models import loading as models

    monkeypatch.setenv("KVQ_MODEL_CACHE", str(tmp_path))
    folder = tmp_path / "smollm2-135m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    integrity.seal_folder(folder)
    assert models.resolve("smollm2-135m") == str(folder)
    (folder / "model.safetensors").write_bytes(b"weigh")  # cut short on a shared home
    models._VERIFIED.clear()
    assert models.resolve("smollm2-135m").endswith(".gguf")  # the GGUF again: the next load converts it anew
    assert f"{folder / 'model.safetensors'} does not match its digest" in capsys.readouterr().err
    assert not folder.exists()


def test_a_changed_hash_memo_is_named_and_the_file_hashed_again(tmp_path, monkeypatch, capsys):
    from kvq_lab.records import provenance

    memo = tmp_path / "hashes.json"
    monkeypatch.setenv("KVQ_HASH_CACHE", str(memo))
    f = tmp_path / "weights.bin"
    f.write_bytes(b"abc")
    right = provenance.file_sha256(f)
    memo.write_text(memo.read_text().replace(right, "0" * 64))
    assert provenance.file_sha256(f) == right and f"{memo} does not match its digest" in capsys.readouterr().err


# --- records: sealed, and refused when they no longer match ---------------------------------------------------------


def test_an_edited_record_is_refused_by_resume_and_the_report_tools(tiny_model_dir, data_dir, tmp_path, capsys):
    res = tmp_path / "res"
    args = tiny_args(tiny_model_dir, res, data_dir)
    first = run(compose(args))
    (rec,) = load_records(res)
    path = Path(rec["_path"]) / RECORD
    assert integrity.unsealed_reason(rec) is None
    body = json.loads(path.read_text())
    body["metrics"]["ppl/ppl"] = 9.0  # edited by hand
    path.write_text(json.dumps(body, indent=2))
    capsys.readouterr()
    assert run(compose(args)) == first  # ran again: the edited record was not reused
    out = capsys.readouterr().out
    assert f"refusing record {path}: its contents do not match its digest" in out and "skip:" not in out

    compare = [sys.executable, str(REPO / "scripts" / "compare.py"), str(res), "--metrics", "ppl/ppl"]
    shown = subprocess.run(compare, capture_output=True, text=True, cwd=REPO)
    assert shown.returncode == 0 and "| 9 |" not in shown.stdout and "1 records" in shown.stdout
    assert f"refusing record {path}" in shown.stderr
    check = subprocess.run([*compare, "--verify"], capture_output=True, text=True, cwd=REPO)
    assert check.returncode == 1 and f"MISMATCH {path}" in check.stdout and "1 of 2 records match" in check.stdout


def test_an_edited_sample_is_named(tmp_path):
    from helpers_records import write_record

    d = write_record(tmp_path, "20261203-000000_x", {"status": "ok", "metrics": {"f1": 0.5}}, samples=[{"f1": 0.5}])
    rec = load_records(tmp_path)[0]
    assert integrity.unsealed_reason(rec) is None
    (d / "samples.json").write_text(json.dumps([{"f1": 1.0}]))
    assert integrity.unsealed_reason(rec) == "samples.json does not match the record's digest (edited or corrupt)"
    assert load_records(tmp_path, verified=True) == []


def test_every_committed_record_matches_its_digest():
    recs = [r for p in sorted(REPO.glob("experiments/**/runs")) for r in load_records(p.parent)]
    assert recs and [r["_path"] for r in recs if integrity.unsealed_reason(r) is not None] == []


# --- a full disk ------------------------------------------------------------------------------------------------------


def _full_disk_at_the_end(monkeypatch, fail_fallbacks: int):
    """The final record write fails (ENOSPC); so do the first `fail_fallbacks` ways of marking it failed."""
    import kvq_lab.records.record as results
    import kvq_lab.run.run_record as run_record

    failures = {"n": 0}

    def write(path, record, real=results.write_record):
        if record.get("status") == "ok" or (record.get("status") == "failed" and failures["n"] < fail_fallbacks):
            failures["n"] += record.get("status") == "failed"
            raise OSError(28, "No space left on device")
        return real(path, record)

    def in_place(path, record, real=results.overwrite_in_place):
        if fail_fallbacks > 1:
            raise OSError(28, "No space left on device")
        return real(path, record)

    monkeypatch.setattr(run_record, "write_record", write)
    monkeypatch.setattr(run_record, "overwrite_in_place", in_place)


@pytest.mark.parametrize("fail_fallbacks", [0, 1])
def test_a_full_disk_at_the_end_leaves_the_record_failed(tiny_model_dir, data_dir, tmp_path, monkeypatch, capsys,
                                                         fail_fallbacks):  # fmt: skip
    _full_disk_at_the_end(monkeypatch, fail_fallbacks)
    with pytest.raises(RecordNotWritten, match="No space left on device.*says failed"):
        run(compose(tiny_args(tiny_model_dir, tmp_path, data_dir)))
    out = capsys.readouterr().out
    assert "ppl/ppl=" in out and "record: not written" in out  # the metrics, and no path of a stale record
    (rec,) = load_records(tmp_path)
    assert rec["status"] == "failed" and "No space left on device" in rec["error"] and rec["metrics"]["ppl/ppl"] > 0
    assert integrity.unsealed_reason(rec) is None


def test_a_disk_that_refuses_every_write_says_the_record_is_stale(tiny_model_dir, data_dir, tmp_path, monkeypatch,
                                                                  capsys):  # fmt: skip
    _full_disk_at_the_end(monkeypatch, fail_fallbacks=2)
    with pytest.raises(RecordNotWritten, match="still says running.*not a result"):
        run(compose(tiny_args(tiny_model_dir, tmp_path, data_dir)))
    assert "record: not written" in capsys.readouterr().out


def test_a_full_disk_before_the_run_is_one_line(tiny_model_dir, data_dir, tmp_path, monkeypatch):
    import kvq_lab.preflight.settings as checks

    monkeypatch.setattr(checks.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 4096, 4096))
    with pytest.raises(ConfigError, match=r"its disk is full \(4 KiB free") as e:
        run(compose(tiny_args(tiny_model_dir, tmp_path / "res", data_dir)))
    assert "\n" not in str(e.value) and not (tmp_path / "res").exists()


# --- the record index -------------------------------------------------------------------------------------------------


def _some_records(root: Path, n: int = 3) -> None:
    from helpers_records import write_record

    for i in range(n):
        write_record(root, f"20261203-{i:06d}_r{i}", {"status": "ok", "run_key": f"k{i}", "metrics": {"x": i}})


def test_an_index_with_corrupt_pages_is_rebuilt_in_one_line(tmp_path, capsys):
    from kvq_lab.records import index

    _some_records(tmp_path, 200)
    assert len(index.query(tmp_path)) == 200
    con = sqlite3.connect(tmp_path / index.INDEX)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    db = bytearray((tmp_path / index.INDEX).read_bytes())
    assert db[:16] == b"SQLite format 3\0" and len(db) > 3 * 4096
    for page in range(4096, len(db), 4096):  # the header stays valid; the pages behind it do not
        db[page + 8 : page + 1000] = b"\xa5" * 992
    (tmp_path / index.INDEX).write_bytes(bytes(db))
    assert [r["run_key"] for r in index.query(tmp_path, {"run_key": "k7"})] == ["k7"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"the record index {tmp_path / index.INDEX} was unusable" in err
    assert len(index.query(tmp_path)) == 200 and capsys.readouterr().err == ""  # rebuilt: quiet again


def test_an_index_on_a_full_disk_is_read_in_memory(tmp_path, monkeypatch, capsys):
    from kvq_lab.records import index

    _some_records(tmp_path)
    real = sqlite3.connect

    def connect(path, *a, **k):
        if path != ":memory:":
            raise sqlite3.OperationalError("database or disk is full")
        return real(path, *a, **k)

    monkeypatch.setattr(index.sqlite3, "connect", connect)
    assert [r["run_key"] for r in index.query(tmp_path)] == ["k0", "k1", "k2"]
    assert "unusable (database or disk is full); reading the records without it" in capsys.readouterr().err


# --- sweeps -----------------------------------------------------------------------------------------------------------


def test_every_row_of_a_sweep_is_validated_before_the_first_runs(tiny_model_dir, data_dir, tmp_path):
    t0 = time.time()
    out = run_py(["-m", *tiny_args(tiny_model_dir, tmp_path, data_dir), "bits=2,6", "group_size=32,48"])
    assert out.returncode == 2 and time.time() - t0 < 60
    lines = out.stderr.strip().splitlines()
    assert lines == [
        "error: row 2 of 4 (bits=2 group_size=48): group_size (values)=48 does not divide head_dim=64 (per-token "
        "groups run along channels); use one of [1, 2, 4, 8, 16, 32, 64]",
        "error: row 3 of 4 (bits=6 group_size=32): bits=6 is not supported; choose one of: 1, 2, 3, 4, 5, 8, 16 (16 = "
        "no quantization)",
        "error: row 4 of 4 (bits=6 group_size=48): bits=6 is not supported; choose one of: 1, 2, 3, 4, 5, 8, 16 (16 = "
        "no quantization)",
        "error: 3 of 4 rows are invalid; nothing was run",
    ]
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # a real sweep: ~20 s
def test_a_failed_row_makes_the_sweep_exit_1_with_a_line_per_row(tiny_model_dir, data_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not weights")  # valid config: the load itself fails
    base = [a for a in tiny_args(tiny_model_dir, tmp_path / "res", data_dir) if not a.startswith("model.path=")]
    args = ["-m", *base, f"model.path={tiny_model_dir},{broken}"]
    out = run_py(args)
    assert out.returncode == 1, out.stderr[-2000:]
    tail = out.stderr.strip().splitlines()[-3:]
    assert tail[0] == "sweep: 1 of 2 rows ok or skipped"
    assert tail[1].startswith(f"  row 1 (model.path={tiny_model_dir}): ok: ")
    assert tail[2].startswith(f"  row 2 (model.path={broken}): failed: ")
    again = run_py(args)  # the ok row is skipped, the failed one tried again
    assert again.returncode == 1 and "row 1" in again.stderr and ": skipped: a completed record exists" in again.stderr


# --- errors that once came after the load -----------------------------------------------------------------------------


def _late_inputs(tmp: Path, tiny: Path) -> list[tuple[list[str], str]]:
    from kvq_lab.models.loading import embedded_gguf

    gguf = tmp / "cut.gguf"
    with open(embedded_gguf("smollm2-135m"), "rb") as f:
        gguf.write_bytes(f.read(1 << 20))  # the first megabyte of the real model file
    short = tmp / "short.txt"
    short.write_text("Too short to fit a codebook on.")
    three = tmp / "precision.yaml"
    three.write_text(json.dumps({"kind": "kvq_lab.precision/per_layer_bits/v1", "key_bits": [2, 4, 8],
                                 "value_bits": [2, 2, 2]}))  # fmt: skip
    return [
        (["model=hub", f"model.path={gguf}"], "is not a valid model file (truncated?)"),
        (["key_format=nuq", "calibration=file", f"calibration.path={short}"], "has 9 tokens; calibration.tokens=2048"),
        (["model=hub", f"model.path={tiny}", "precision=file", f"precision.path={three}"],
         "gives 3 layers but the model has 2"),
        (["precision=search", "precision.budget=5", "precision.source=file", f"precision.path={short}"],
         "precision.source=file has 9 tokens; lower precision.tokens=512"),
    ]  # fmt: skip


def test_errors_the_model_files_can_tell_come_before_the_load(data_dir, tiny_model_dir, tmp_path, monkeypatch):
    import kvq_lab.models.loading as models

    def no_load(*a, **k):
        raise AssertionError("a model was loaded for a bad input")

    monkeypatch.setattr(models, "load_model", no_load)
    res = tmp_path / "res"
    for args, message in _late_inputs(tmp_path, tiny_model_dir):
        with pytest.raises(ConfigError) as e:
            run(compose([f"data_dir={data_dir}", f"results_dir={res}", "logger=none", *args]))
        assert message in str(e.value) and "\n" not in str(e.value), (args, str(e.value))
    assert not res.exists()


def test_a_config_rejected_after_the_load_leaves_nothing(tiny_model_dir, data_dir, tmp_path, monkeypatch, caches):
    """Where only the loaded model can tell (a hub model: nothing local to read first), the run is rejected like any
    bad input: one line, no record."""
    import kvq_lab.preflight.model as checks

    monkeypatch.setattr(checks, "check_against_model", lambda *a: None)  # as for a model known only on the hub
    short = tmp_path / "short.txt"
    short.write_text("Too short to fit a codebook on.")
    args = tiny_args(tiny_model_dir, tmp_path / "res", data_dir) + ["key_format=nuq", "calibration=file",
                                                                    f"calibration.path={short}"]  # fmt: skip
    with pytest.raises(ConfigError, match="has 9 tokens"):
        run(compose(args))
    assert list((tmp_path / "res" / "runs").iterdir()) == []


@pytest.mark.parametrize(
    "command, model_args, message",  # both entry points, each bad value through one of them
    [("kvq-lm-eval", "bits=7", "bits=7 is not supported"),
     ("lm_eval", "key_axis=head", "key_axis='head' is not allowed"),
     ("kvq-lm-eval", "pretrained=/nonexistent", "pretrained='/nonexistent' does not exist")],
)  # fmt: skip
def test_bad_lm_eval_model_args_are_one_line_before_the_tasks_load(command, model_args, message, tmp_path):
    exe = Path(sys.executable).parent / command
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([str(exe), "run", "--model", "kvq", "--model_args", model_args, "--tasks", "coqa_turns"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    # lm-eval's task index (~20 s of CPU) was never read; CPU time, not wall time, so a busy machine does not fail it
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert cpu < 12, cpu


# --- provenance: the backend that ran, the defaults the docs list -----------------------------------------------------


def test_records_name_the_backend_that_ran_and_auto_is_that_run(tiny_model_dir, data_dir, tmp_path):
    base = tiny_args(tiny_model_dir, tmp_path, data_dir) + ["mode=packed"]
    auto, cpu = validate(compose(base + ["backend=auto"])), validate(compose(base + ["backend=cpu"]))
    assert auto.cache.backend == "cpu" and auto.run_key == cpu.run_key
    run(compose(base + ["backend=auto"]))
    (rec,) = load_records(tmp_path)
    assert rec["backend"] == rec["cache_config"]["backend"] == "cpu" and rec["config"]["backend"] == "auto"
    sim = [validate(compose(tiny_args(tiny_model_dir, tmp_path, data_dir) + [f"backend={b}"])) for b in ("auto", "cpu")]
    assert {p.cache.backend for p in sim} == {"torch"} and sim[0].run_key == sim[1].run_key  # simulated: PyTorch
    outliers = validate(compose(base + ["backend=cpu", "key_outliers=0.01"]))
    assert outliers.cache.backend == "torch"  # the packed cache reads sparse outliers on the PyTorch path


def test_the_docs_list_every_formats_default_width():
    from kvq_lab.quant.formats import FORMATS, default_bits

    listed = {
        "README.md": next(x for x in (REPO / "README.md").read_text().splitlines() if "`bits` / `key_bits`" in x),
        "conf/config.yaml": next(x for x in (REPO / "conf/config.yaml").read_text().splitlines() if "key_bits:" in x),
    }
    for name in FORMATS:
        family = "fp8" if name.startswith("fp8") else name
        for where, line in listed.items():
            assert f"{family} {default_bits(name)}" in line, (where, name)
