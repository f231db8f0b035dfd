"""One run key, one number: the run that converts an embedded model's GGUF and every later run, which loads the
converted copy, give the same metrics bit for bit (kvq_lab.models.loading: the converting run computes from the copy
too), at any thread count (kvq_lab.models.numerics: MKL pinned to its reproducible mode). Before, SmolLM2's 2-bit
ppl was 20.33 converting and 20.83 afterwards with 2 threads, 19.91 and 19.64 with 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_models import compose, tiny_args

from kvq_lab.models.loading import EMBEDDED, embedded_gguf
from kvq_lab.models.numerics import PINNED

REPO = Path(__file__).resolve().parents[2]
DATA_DIR = Path(os.environ.get("KVQ_DATA_DIR", REPO.parent / "shared" / "data"))
# 2-bit K per-channel / V per-token, one short ppl window; Gemma in packed mode (the C kernel), SmolLM2 simulated
CONFIGS = {
    "smollm2-135m": [],
    "gemma3-270m": ["mode=packed", "exact_window=32"],
}


def _run(name: str, extra: list[str], results: Path, models: Path, threads: int) -> dict:
    args = [
        f"model={name}", "task=ppl", "task.context_tokens=64", "task.eval_tokens=16", "task.windows=1", "logger=none",
        f"results_dir={results}", f"data_dir={DATA_DIR}", "bits=2", "resume_dirty=true", *extra,
    ]  # fmt: skip
    env = {**os.environ, "KVQ_MODEL_CACHE": str(models), "OMP_NUM_THREADS": str(threads), "WANDB_MODE": "offline"}
    cmd = [sys.executable, "run.py", *args]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (record,) = (results / "runs").glob("*/record.json")
    return json.loads(record.read_text())


@pytest.mark.slow  # SmolLM2: ~20 s to convert; Gemma-3-270M: ~55 s and 1.1 GB (in a temporary model cache)
@pytest.mark.parametrize("name", sorted(EMBEDDED))
def test_the_converting_run_gives_the_numbers_of_every_later_run(name, tmp_path):
    if embedded_gguf(name) is None:
        pytest.skip(f"{name}'s GGUF is not installed (scripts/setup.sh installs it)")
    models = tmp_path / "models"
    first = _run(name, CONFIGS[name], tmp_path / "converting", models, threads=2)
    assert (models / name / "config.json").is_file(), "the first run converts into the temporary model cache"
    later = _run(name, CONFIGS[name], tmp_path / "cached", models, threads=1)
    assert first["run_key"] == later["run_key"]
    assert first["metrics"] == later["metrics"]  # bit for bit: the JSON floats are the same doubles
    assert first["blas"] == later["blas"] == PINNED


def test_a_process_that_used_mkl_before_pinning_keys_runs_by_thread_count(monkeypatch, tmp_path, tiny_model_dir):
    """Where MKL computed before kvq_lab could pin it, the run key carries what then changes the numbers (the mode and
    the thread count); pinned (run.py's fresh processes, the test above, this session: tests/conftest.py), nothing, so
    the run keys of pinned runs are those of records made before the rule."""
    from kvq_lab.models import numerics
    from kvq_lab.run.config import validate

    cfg = compose(tiny_args(tiny_model_dir, tmp_path, DATA_DIR))
    monkeypatch.setattr(numerics, "_state", PINNED)
    pinned = validate(cfg)
    assert "numerics" not in pinned.inputs
    unpinned = "mkl unpinned (MKL was called before kvq_lab could set its reproducible mode)"
    monkeypatch.setattr(numerics, "_state", unpinned)
    for threads in (1, 2):
        monkeypatch.setattr("torch.get_num_threads", lambda n=threads: n)
        plan = validate(cfg)
        assert plan.inputs["numerics"] == {"blas": unpinned, "threads": threads}
        assert plan.run_key != pinned.run_key
    monkeypatch.setattr(numerics, "_state", "mkl branch 10,STRICT")  # MKL_CBWR=AVX2,STRICT from the environment
    assert validate(cfg).inputs["numerics"] == {"blas": "mkl branch 10,STRICT"}  # strict: threads change nothing


def test_one_load_parses_a_gguf_file_once(monkeypatch):
    """transformers parses a GGUF file for the tokenizer's config, the tokenizer, the model's config and the tensors
    (~20 s each for Gemma-3-270M); one conversion parses it once and decodes its metadata once (each caller gets its
    own copy), and outside the conversion nothing is kept. Checked 2026-12-07: the converted weights, config and
    tokenizer files are those of transformers' own four parses, bit for bit, for both embedded models."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    from kvq_lab.models import loading

    made, decoded = [], []
    monkeypatch.setattr(gguf, "GGUFReader", lambda path, mode="r": made.append(path) or object())
    meta = {"config": {"n": [1]}}
    monkeypatch.setattr(hf_gguf, "load_gguf_checkpoint", lambda path, tensors=False, **kw: decoded.append(path) or meta)
    real_reader, real_load = gguf.GGUFReader, hf_gguf.load_gguf_checkpoint
    with loading._parsed_once():
        assert gguf.GGUFReader("a.gguf") is gguf.GGUFReader("a.gguf") is not gguf.GGUFReader("b.gguf")
        first, second = (hf_gguf.load_gguf_checkpoint("a.gguf") for _ in range(2))
        assert first == second == meta and first is not second and first["config"]["n"] is not second["config"]["n"]
        hf_gguf.load_gguf_checkpoint("a.gguf", return_tensors=True)  # the tensors: read, never kept
    assert made == ["a.gguf", "b.gguf"] and decoded == ["a.gguf", "a.gguf"]
    assert (gguf.GGUFReader, hf_gguf.load_gguf_checkpoint) == (real_reader, real_load)


def test_the_kept_reader_maps_the_file_read_only_and_copies_what_transformers_edits(tmp_path):
    """The reader's file is the mapped bytes as a plain array (read-only, as np.memmap's mode "r"); each caller gets
    dicts and lists of its own, so an edit never reaches the kept metadata."""
    import numpy as np

    from kvq_lab.models import loading

    f = tmp_path / "x.bin"
    f.write_bytes(bytes(range(16)))
    data = loading._PlainMaps().memmap(f, mode="r")
    assert type(data) is np.ndarray and data.tolist() == list(range(16)) and not data.flags.writeable
    kept = {"tokenizer": {"tokens": ["a", "b"], "merges": [["a", "b"]]}, "config": {"n": 1}}
    copied = loading._copied(kept)
    copied["tokenizer"]["tokens"].append("c")
    copied["tokenizer"]["merges"][0].append("c")
    copied["config"].pop("n")
    assert kept == {"tokenizer": {"tokens": ["a", "b"], "merges": [["a", "b"]]}, "config": {"n": 1}}
