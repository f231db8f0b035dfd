"""Helpers for task and sweep tests: compose run configs like run.py does, tiny decode-perplexity settings, and
tiny models with a poisoned (NaN) weight. The tiny model folder itself is conftest's `tiny_model_dir`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


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
        # test (tests/test_trust.py)
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
