"""The record index (kvq_lab/records/index.py) equals the records it is rebuilt from, follows every change, survives
corruption; large tables go to Parquet sidecars; scripts/compare.py selects across folders."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers_models import REPO

from kvq_lab.records import index
from kvq_lab.records.record import load_records, read_table, write_record, write_sidecars


def _write(root: Path, name: str, **rec) -> Path:
    d = root / "runs" / name
    d.mkdir(parents=True, exist_ok=True)
    write_record(d / "record.json", rec)  # sealed, as the runner writes it
    return d


def _cfg(ka="channel", kb=2, task="ppl", probe=False):
    return {"key_axis": ka, "key_bits": kb, "task": {"name": task}, "probe": probe, "limit": None}


def test_index_equals_the_records_and_follows_changes(tmp_path):
    _write(tmp_path, "20261130-000001_a", status="ok", run_key="k1", config=_cfg(), metrics={"ppl/ppl": 20.0})
    _write(tmp_path, "20261130-000002_b", status="failed", run_key="k2", config=_cfg("token", 3), experiment="e")
    _write(tmp_path, "20261130-000003_c", status="ok", run_key="k3", config=_cfg("token", 2, "coqa", True),
           metrics={"probe/key/kivi_ratio/mean": float("inf"), "x": float("nan")})  # fmt: skip
    (tmp_path / "runs" / "20261130-000004_empty").mkdir()  # a folder without a record is not a run
    assert json.dumps(index.query(tmp_path)) == json.dumps(load_records(tmp_path))  # built from scratch (NaN, inf too)
    assert (tmp_path / index.INDEX).exists()

    # selection by any field: top-level columns, dotted config paths, lists, booleans
    assert [r["run_key"] for r in index.query(tmp_path, {"config.key_axis": "token"})] == ["k2", "k3"]
    assert [r["run_key"] for r in index.query(tmp_path, {"config.key_bits": [2], "status": "ok"})] == ["k1", "k3"]
    assert [r["run_key"] for r in index.query(tmp_path, {"config.probe": True})] == ["k3"]
    assert [r["run_key"] for r in index.query(tmp_path, {"experiment": "e"})] == ["k2"]
    assert index.query(tmp_path, {"config.task.name": "nope"}) == []

    # a changed, a new and a deleted record are all seen at the next query
    d = _write(tmp_path, "20261130-000002_b", status="ok", run_key="k2", config=_cfg("token", 3), experiment="e")
    _write(tmp_path, "20261130-000005_d", status="ok", run_key="k5", config=_cfg())
    (tmp_path / "runs" / "20261130-000001_a" / "record.json").unlink()
    assert index.query(tmp_path) == load_records(tmp_path)
    assert index.query(tmp_path, {"run_key": "k2"})[0]["status"] == "ok" and d.exists()
    assert [r["run_key"] for r in index.query(tmp_path)] == ["k2", "k3", "k5"]


def test_a_corrupt_index_is_rebuilt(tmp_path):
    _write(tmp_path, "20261130-000001_a", status="ok", run_key="k1", config=_cfg())
    index.query(tmp_path)
    (tmp_path / index.INDEX).write_bytes(b"this is not a database" * 100)
    for extra in ("-wal", "-shm"):
        Path(f"{tmp_path / index.INDEX}{extra}").unlink(missing_ok=True)
    assert [r["run_key"] for r in index.query(tmp_path)] == ["k1"]


def test_large_tables_go_to_a_parquet_sidecar(tmp_path):
    big = {"columns": ["layer", "head", "err"], "rows": [[i // 9, i % 9, i / 7] for i in range(300)]}
    small = {"columns": ["layer", "err"], "rows": [[0, 0.5], [1, 0.25]]}
    art = {"probe_tables": {"n_prompts": 2, "per_head": big, "per_layer": small}, "note": "x"}
    out = write_sidecars(tmp_path, art)
    assert out["probe_tables"]["per_head"] == {"file": "probe_tables.per_head.parquet", "columns": big["columns"],
                                               "n_rows": 300}  # fmt: skip
    assert out["probe_tables"]["per_layer"] == small and out["note"] == "x"
    rec = {"artifacts": out, "_path": str(tmp_path)}
    assert read_table(rec, "probe_tables", "per_head") == big
    assert read_table(rec, "probe_tables", "per_layer") == small
    assert len(json.dumps(out)) < 300  # record.json stays small


def test_compare_selects_across_folders(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _write(a, "20261130-000001_x", status="ok", run_key="k1", config=_cfg("channel"), metrics={"ppl/ppl": 21.5})
    _write(b, "20261130-000002_y", status="ok", run_key="k2", config=_cfg("token"), metrics={"ppl/ppl": 212.0})
    _write(b, "20261130-000003_z", status="ok", run_key="k3", config=_cfg("token", task="coqa"), metrics={})
    cmd = [sys.executable, str(REPO / "scripts" / "compare.py"), str(a), str(b), "--where", "task.name=ppl",
           "--cols", "key_axis,key_bits"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "| ok | channel | 2 | 21.5 |" in out and "| ok | token | 2 | 212 |" in out and "2 records" in out
    out = subprocess.run([*cmd, "--where", "key_axis=token,nothing"], capture_output=True, text=True).stdout
    assert "1 records" in out


def test_compare_refuses_bad_arguments_in_one_line_before_any_index(tmp_path):
    """A --where that is not YAML, a mistyped folder, a folder without runs/: one line naming the value, exit
    status 2, and no index.sqlite left behind (before, a YAML traceback and `no records match` in a new index)."""
    good = tmp_path / "good"
    _write(good, "20261130-000001_x", status="ok", run_key="k1", config=_cfg(), metrics={"ppl/ppl": 21.5})
    (tmp_path / "empty").mkdir()
    script = str(REPO / "scripts" / "compare.py")
    cases = {
        (str(good), "--where", "bits=["): "'bits=[': the value '[' is not YAML",
        (str(good), "--where", "bits={a: 1}"): "a value is a scalar",
        (str(good), "--where", "=2"): "must be FIELD=VALUE",
        (str(tmp_path / "goood"),): "goood' does not exist",
        (str(tmp_path / "empty"),): "empty' holds no runs/ folder",
        (str(good), "--bogus"): "unrecognized arguments: --bogus",
    }
    for args, needle in cases.items():
        out = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, cwd=tmp_path)
        assert out.returncode == 2 and out.stdout == "", (args, out)
        assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: ") and needle in out.stderr, out.stderr
    assert not (tmp_path / "goood").exists() and not list((tmp_path / "empty").iterdir())
    assert not (good / index.INDEX).exists()


def test_a_folder_without_runs_has_no_records_and_gains_nothing(tmp_path):
    assert index.query(tmp_path / "missing") == [] and not (tmp_path / "missing").exists()
    (tmp_path / "empty").mkdir()
    assert index.query(tmp_path / "empty") == [] and not list((tmp_path / "empty").iterdir())
