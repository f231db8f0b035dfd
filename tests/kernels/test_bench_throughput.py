"""scripts/bench_throughput.py on a tiny model: the batch each cache fits in the budget, its bytes measured again,
batched decoding generating what one sequence generates through the same cache, and the JSON rows."""

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
