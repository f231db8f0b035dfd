"""Helpers shared by tests: compose run configs like run.py does, run run.py as a user would, tiny decode-perplexity
settings, tiny models with a poisoned (NaN) weight, and a small peaked Llama with greedy generation for cache tests
(conftest's `tiny` fixture). The tiny model folder itself is conftest's `tiny_model_dir`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def script_module(name: str, monkeypatch):
    """scripts/<name>.py as a module (scripts/ is not a package), registered under its name for the test (its
    dataclasses resolve annotations through sys.modules)."""
    import importlib.util

    path = REPO / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def peaked_llama():
    """A seeded 2-layer GQA Llama (4 query heads, 2 KV heads of 64) with peaked logits, so greedy choices sit far
    from ties and a cache that changes attention shows in the generated tokens (SDPA attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=256,
        max_position_embeddings=1024,
        initializer_range=0.1,  # peaked logits: greedy choices far from ties
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval()


def gen(model, cache, ids, n=24, mask=None):
    """n greedy tokens after `ids` through `cache` (the new tokens only)."""
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, past_key_values=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[:, ids.shape[1] :]


def run_cli(*args, env=None):
    """`python run.py <args>` from the repo root, as a user runs it: (completed process, seconds)."""
    e = {**os.environ, "WANDB_MODE": "offline", **(env or {})}
    t0 = time.time()
    p = subprocess.run([sys.executable, "run.py", *args], cwd=REPO, capture_output=True, text=True, env=e, timeout=600)
    return p, time.time() - t0


def compose(overrides: list[str]):
    """The config `python run.py <overrides>` would run (no multirun expansion)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from kvq_lab.run.config import register_schema

    register_schema()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return hydra_compose(config_name="config", overrides=overrides)


def tiny_args(model_dir: Path, results_dir: Path, data_dir: Path, task: str = "ppl") -> list[str]:
    """Overrides for a fast run on the tiny random model (decode ppl: 2 windows of 32 + 16 tokens)."""
    args = [
        "model=hub",
        f"model.path={model_dir}",
        "model.head_dim=null",
        "logger=none",
        f"results_dir={results_dir}",
        f"data_dir={data_dir}",
        f"task={task}",
        # tests run in developers' trees, often with uncommitted changes; the dirty-tree rule of resume has its own
        # test (tests/run/test_trust.py)
        "resume_dirty=true",
    ]
    if task == "ppl":
        args += ["task.context_tokens=32", "task.eval_tokens=16", "task.windows=2"]
    return args


def run_py(args: list[str], timeout: int = 600, **kw) -> subprocess.CompletedProcess:
    """`python run.py <args>` in a subprocess (one thread: the test machine has two cores)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [sys.executable, str(REPO / "run.py"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def poisoned_model_dir(src: Path, out: Path, where: str) -> Path:
    """A copy of the model in `src` with one NaN weight. where: `k_proj` (layer 1's key projection: NaN keys in
    the cache at layer 1) or `norm` (the final norm: finite K/V, NaN logits)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        if where == "k_proj":
            model.model.layers[1].self_attn.k_proj.weight[0, 0] = float("nan")
        elif where == "norm":
            model.model.norm.weight[0] = float("nan")
        else:
            raise ValueError(where)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out
