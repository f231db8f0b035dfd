"""scripts/bench_throughput.py on a tiny model: the batch each cache fits in the budget, its bytes measured again,
batched decoding generating what one sequence generates through the same cache, and the JSON rows; it and
scripts/bench_cache.py refuse bad arguments in one line before the model loads."""

from __future__ import annotations

import argparse
import json

import pytest
from helpers_models import script_module

KEYS = {"dtype", "kind", "label", "length", "batch", "bytes_per_seq", "cache_bytes", "fits", "decode_tok_s",
        "per_seq_tok_s", "step_s", "step_s_min", "step_s_max", "prefill_forward_s", "quantize_s", "prefill_tok_s",
        "peak_rss_bytes", "same_tokens", "ratio", "batch_ratio", "curve"}  # fmt: skip
PACKED_2BIT = "ours packed 2b K-C V-T G32 R128 ("  # rope=post only


def bench(monkeypatch):
    return script_module("bench_throughput", monkeypatch)  # it imports its sibling bench_cache


@pytest.mark.parametrize("text,n", [("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1.5g", 3 * 2**29), ("4096", 4096)])
def test_budgets_parse(monkeypatch, text, n):
    assert bench(monkeypatch).parse_bytes(text) == n


def test_a_bad_budget_names_the_fix(monkeypatch):
    with pytest.raises(argparse.ArgumentTypeError, match=r"--budget '2 parsecs'.*2GiB"):
        bench(monkeypatch).parse_bytes("2 parsecs")


def test_batches_fit_the_budget_and_generate_what_one_sequence_does(tiny_model_dir, tmp_path, monkeypatch):
    """600 tokens (the 2-bit cache quantizes all but its window of 128): each cache's batch is the budget over its
    bytes per sequence, the batched cache measured at the end fits, every row generates what the single sequence
    generates through the same cache, and the packed 2-bit cache fits more sequences than DynamicCache."""
    b = bench(monkeypatch)
    out = tmp_path / "t.json"
    args = ["--model", str(tiny_model_dir), "--lengths", "600", "--budget", "2MiB", "--new-tokens", "5", "--warmup",
            "1", "--repeats", "2", "--only", PACKED_2BIT, "--curve", "--json", str(out)]  # fmt: skip
    rows = b.main(args)
    data = json.loads(out.read_text())
    assert data["rows"] == rows and data["argv"] == args and data["budget_bytes"] == 2 * 2**20
    assert [r["kind"] for r in rows] == ["dynamic", "ours_packed"]
    for r in rows:
        assert set(r) == KEYS
        assert r["batch"] == 2 * 2**20 // r["bytes_per_seq"] and r["fits"] and r["cache_bytes"] <= 2 * 2**20
        assert r["same_tokens"] is True and r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0
        assert r["step_s_min"] * 0.9999 <= r["step_s"] <= r["step_s_max"] * 1.0001  # the pooled median lies between
        assert [b for b, _ in r["curve"]] == [2**i for i in range(r["batch"].bit_length()) if 2**i < r["batch"]] + [
            r["batch"]
        ] and r["curve"][-1][1] == r["decode_tok_s"]
    dyn, packed = rows
    assert dyn["ratio"] == 1.0 and dyn["batch_ratio"] == 1.0
    assert packed["batch"] > 2 * dyn["batch"]


def test_full_prefill_runs_mixed_length_prompts_through_generate(tiny_model_dir, monkeypatch):
    args = ["--model", str(tiny_model_dir), "--lengths", "200", "--budget", "4MiB", "--new-tokens", "4", "--warmup",
            "1", "--repeats", "1", "--max-batch", "3", "--prefill", "full", "--only", PACKED_2BIT]  # fmt: skip
    rows = bench(monkeypatch).main(args)
    assert [r["batch"] for r in rows] == [3, 3] and all(r["same_tokens"] is None for r in rows)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--budget", "0"], "--budget '0' holds no byte"),  # silently 2 GiB before
        (["--budget", "0.1b"], "--budget '0.1b' holds no byte"),
        (["--lengths", "0"], "--lengths 0: a context holds at least 2 token(s)"),  # the case
        (["--lengths", "1"], "--lengths 1: a context holds at least 2 token(s)"),  # a traceback after the load before
        (["--lengths", "64", "100000"], "--lengths 100000: "),  # grew to 2.2 GB before
        (["--lengths", "506"], "--lengths 506: "),  # 506 + 8 - 1 positions: one too many
        (["--repeats", "0"], "--repeats 0: must be at least 1"),
        (["--max-batch", "0"], "--max-batch 0: must be at least 1"),
        (["--new-tokens", "4", "--warmup", "3"], "--warmup 3 leaves no timed step"),
        (["--model", "./no/such/folder"], "--model './no/such/folder' does not exist"),
    ],
)
def test_bad_arguments_fail_in_one_line_before_the_model_loads(monkeypatch, capsys, tmp_path, args, needle):
    """A model folder whose config.json says 512 positions (nothing else there: the checks read the files only)."""
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_hidden_layers": 2,
                                                      "hidden_size": 128, "max_position_embeddings": 512}))  # fmt: skip
    b = bench(monkeypatch)
    monkeypatch.setattr(b, "load_model", lambda *a, **k: pytest.fail("loaded the model before refusing"))
    base = ["--model", str(tmp_path), "--lengths", "64", "--new-tokens", "8", "--warmup", "1"]
    with pytest.raises(SystemExit) as e:
        b.main([*base, *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and needle in err, err
    if "100000" in args or "506" in args:
        assert "has 512 positions" in err and "up to 505" in err


def test_the_longest_context_the_model_holds_passes_the_checks(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_hidden_layers": 2,
                                                      "hidden_size": 128, "max_position_embeddings": 512}))  # fmt: skip
    b = bench(monkeypatch)
    monkeypatch.setattr(b, "load_model", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("reached the load")))
    with pytest.raises(RuntimeError, match="reached the load"):
        b.main(["--model", str(tmp_path), "--lengths", "505", "--new-tokens", "8", "--warmup", "1"])


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--lengths", "0"], "--lengths 0: a context holds at least 1 token"),
        (["--lengths", "506"], "--lengths 506: "),  # 506 + 8 - 1 positions of 512
        (["--repeats", "0"], "--repeats 0: must be at least 1"),
        (["--group-size", "0"], "--group-size 0: must be at least 1"),
        (["--new-tokens", "4", "--warmup", "4"], "--warmup 4 leaves no timed step"),
        (["--model", "./no/such/folder"], "--model './no/such/folder' does not exist"),
        (["--settings", "fp64"], "argument --settings: invalid choice"),
    ],
)
def test_bench_cache_refuses_bad_arguments_before_the_load(monkeypatch, capsys, tmp_path, args, needle):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_hidden_layers": 2,
                                                      "hidden_size": 128, "max_position_embeddings": 512}))  # fmt: skip
    b = script_module("bench_cache", monkeypatch)
    monkeypatch.setattr(b, "load_model", lambda *a, **k: pytest.fail("loaded the model before refusing"))
    with pytest.raises(SystemExit) as e:
        b.main(["--model", str(tmp_path), "--lengths", "64", "--new-tokens", "8", "--warmup", "1", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and needle in err, err
