"""scripts/make_table.py: records of one experiment -> markdown beside KIVI's numbers + PNG, honest about gaps."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers_records import axis_table_results, config, write_record

from kvq_lab.records.record import load_records
from kvq_lab.report.anchors import paper_values, row_name
from kvq_lab.report.rows import build_rows
from kvq_lab.report.tables import make_report, markdown_table, to_frame

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


def test_table_rows_paper_column_and_gaps(tmp_path):
    results = axis_table_results(tmp_path / "results")
    rows = build_rows(load_records(results), "kivi_axis_table")
    assert [r.name for r in rows] == [
        "16bit",
        "4bit (K-T, V-T)",
        "2bit (K-C, V-T)",
        "2bit (K-T, V-T)",
        "2bit (K-C, V-C)",
        "2bit (K-T, V-C)",
    ]  # fmt: skip  (the paper's row order; the other experiment's record is not here)
    assert [r.paper["CoQA"] for r in rows] == [66.37, 66.48, 63.53, 52.93, 2.88, 2.80]
    kc_vt = rows[2].cells["coqa_turns"]
    assert kc_vt.limit is None and kc_vt.metrics["coqa_turns/f1"] == 50.0  # the full run beats a newer quick one
    assert rows[3].cells["coqa_turns"].status == "ok"  # a killed rerun does not hide the finished record
    assert rows[5].cells["coqa_turns"].status == "failed" and "layer 3" in rows[5].cells["coqa_turns"].error
    assert rows[2].probes["probe/key/rel_fro/mean"] == 0.123 and not rows[0].probes
    md = markdown_table(rows)
    assert "paper CoQA (Llama-2-13B)" in md and "| 63.53 |" in md and "**failed**: NonFiniteError" in md
    assert "50.00 ± 5.8" in md  # F1 with its standard error over documents (samples.json)
    assert "| 0.123 |" in md and "attn-out err" in md
    quick = build_rows(load_records(results), "kivi_axis_table", limit=20)
    assert [(r.name, r.cells["coqa_turns"].metrics["coqa_turns/f1"]) for r in quick] == [("2bit (K-C, V-T)", 1.0)]
    df = to_frame(rows)
    assert list(df["setting"])[:2] == ["16bit", "4bit (K-T, V-T)"] and "paper CoQA" in df.columns


def test_incomplete_row_is_shown(tmp_path):
    from helpers_records import config, write_record

    rec = {"status": "running", "cache": "K2b-C32_V2b-T32_sim", "experiment": "x", "metrics": {},
           "config": config(2, 2, "channel", "token", experiment="x")}  # fmt: skip
    write_record(tmp_path, "a", rec)
    md, png = make_report(tmp_path, "x", tmp_path / "out")
    assert "**incomplete**" in md and png.exists()


def test_paper_values_for_kivi_rows():
    cfg = {"key_bits": 2, "value_bits": 2, "key_axis": "channel", "value_axis": "token", "group_size": 32,
           "mode": "packed", "exact_window": 128, "rope": "post"}  # fmt: skip
    assert paper_values(cfg) == {"CoQA": 66.23, "TruthfulQA": 29.84, "GSM8K": 20.77}
    assert paper_values({**cfg, "exact_window": 32}) == {"GSM8K": 20.62}
    assert paper_values({**cfg, "group_size": 128}) == {"GSM8K": 17.29}
    assert paper_values({**cfg, "rope": "pre"}) == {}
    assert paper_values({**cfg, "mode": "simulated", "exact_window": 0}, "Llama-2-7B")["CoQA"] == 59.08
    assert row_name({**cfg, "exact_window": 32}) == "2bit (K-C, V-T), real cache R=32"
    assert row_name({**cfg, "mode": "simulated", "key_bits": 3, "rope": "pre"}) == "K3/V2bit (K-C, V-T), pre-RoPE keys"


@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_cli_prints_and_writes_table_and_png(tmp_path):
    results = axis_table_results(tmp_path / "results")
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "scripts" / "make_table.py"), "kivi_axis_table", "--results-dir", str(results)]
    p = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "| 2bit (K-C, V-T) |" in p.stdout and (out / "table.md").read_text().strip() in p.stdout
    assert (out / "kivi_axis_table.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    p = subprocess.run([*cmd, "--out", str(out), "--paper-model", "Llama-2-7B"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=300)  # fmt: skip
    assert "| 59.08 |" in p.stdout
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "make_table.py"), "nope", "--results-dir",
                        str(results), "--out", str(out)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 1 and "no records" in p.stdout
    for folder in (tmp_path / "mistyped", out):  # missing, and a folder without runs/: one line, exit 2
        p = subprocess.run([*cmd[:3], "--results-dir", str(folder)], capture_output=True, text=True, timeout=300)
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and str(folder) in p.stderr and not p.stdout
    assert not (tmp_path / "mistyped").exists()


def test_rows_come_from_the_structured_cache_config_not_the_label(tmp_path):
    """A record with `cache_config` is placed by its fields: a misleading label changes nothing, a new format or
    transform makes its own row, named, and without a paper column."""
    from helpers_records import config, write_record

    def cc(kbits, kaxis, fmt="int", kt=()):
        return {"key": {"bits": kbits, "group_size": 32, "axis": kaxis, "format": fmt},
                "value": {"bits": 2, "group_size": 32, "axis": "token", "format": "int"}, "mode": "simulated",
                "exact_window": 0, "sink_tokens": 0, "rope": "post", "backend": "auto",
                "key_transform": list(kt), "value_transform": []}  # fmt: skip

    res = tmp_path / "r"
    base = {"status": "ok", "experiment": "x", "config": config(2, 2, "token", "token", experiment="x")}
    write_record(res, "1_a", {**base, "cache": "LABEL-IS-WRONG", "cache_config": cc(2, "channel"),
                              "metrics": {"coqa_turns/f1": 50.0}})  # fmt: skip
    write_record(res, "2_b", {**base, "cache": "K2b-C32_V2b-T32_sim", "cache_config": cc(2, "channel", kt=["hadamard"]),
                              "metrics": {"coqa_turns/f1": 51.0}})  # fmt: skip
    write_record(res, "3_c", {**base, "cache": "x", "cache_config": cc(8, "token", fmt="fp8_e4m3"),
                              "metrics": {"coqa_turns/f1": 52.0}})  # fmt: skip
    rows = {r.name: r for r in build_rows(load_records(res), "x")}
    assert set(rows) == {"2bit (K-C, V-T)", "2bit (K-C, V-T), keys hadamard", "K8/V2bit (K-T, V-T), keys fp8_e4m3"}
    assert rows["2bit (K-C, V-T)"].paper["CoQA"] == 63.53  # from the fields (K-C), not the flat knobs (K-T)
    assert rows["2bit (K-C, V-T), keys hadamard"].paper == {} and rows["K8/V2bit (K-T, V-T), keys fp8_e4m3"].paper == {}


def test_a_second_models_records_make_its_own_table(tmp_path):
    """Records of two models under one experiment: each model's table from its own runs only, and no table that
    silently mixes them."""
    results = axis_table_results(tmp_path / "res")
    gemma = {"name": "gemma3-270m", "path": "gemma3-270m"}
    rec = {"status": "ok", "cache": "K16b_V16b_sim", "experiment": "kivi_axis_table",
           "config": config(16, 16, "token", "token", model=gemma), "metrics": {"coqa_turns/f1": 42.0}}  # fmt: skip
    write_record(results, "20260201-000000_gemma", rec)
    with pytest.raises(ValueError, match="records of 2 models .*--model"):
        build_rows(load_records(results), "kivi_axis_table")
    (g,) = build_rows(load_records(results), "kivi_axis_table", model="gemma3-270m")
    assert g.cells["coqa_turns"].metrics["coqa_turns/f1"] == 42.0
    assert len(build_rows(load_records(results), "kivi_axis_table", model="smollm2-135m")) == 6
