"""The one way kvq_lab runs lm-eval-harness: `evaluate(names, ...)` over our tasks (kvq_lab/lmeval/yaml/, which
override lm-eval's coqa, gsm8k and truthfulqa_gen), lm-eval's own, or YAMLs under `include_path`, through the
quantized-cache wrapper (`QuantCacheLM`: every generate call gets a fresh cache).

Task names are looked up in lm-eval's index plus our task folder. Indexing lm-eval's ~15k task YAMLs takes tens of
seconds, so one TaskManager per set of folders is kept for the process (the check before the model load and the run
share it), and when every name is one of ours the index is skipped. Importing this module does not import torch.

Metrics are flattened to `<task or group>/<metric>[_<filter>]` (stderr and aliases left out) plus `<task>/n`, times
`scale` (the CoQA/GSM8K/TruthfulQA tasks report percent, as the papers do: scale=100), and the wrapper's counts
`lm_eval/generate_calls` (each got a fresh cache) and `lm_eval/loglikelihood_requests` (which never read a
generation cache).
"""

from __future__ import annotations

import difflib
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

TASK_DIR = Path(__file__).parent / "yaml"  # our task YAMLs (they override lm-eval's coqa, gsm8k, truthfulqa_gen)
_MANAGERS: dict[tuple[str, ...], object] = {}


def task_manager(include_path: list[str] | tuple[str, ...] = (), names: list[str] | tuple[str, ...] = ()):
    """lm-eval's TaskManager over its own tasks, ours and `include_path`, memoized per folder set. When every name
    in `names` is one of ours and there is no include_path, lm-eval's own index is skipped (milliseconds instead of
    ~20 s a run)."""
    defaults = bool(include_path) or not names or not set(names) <= our_task_names()
    key = (defaults, str(TASK_DIR), *map(str, include_path))
    if key not in _MANAGERS:
        from lm_eval.tasks import TaskManager

        _MANAGERS[key] = TaskManager(include_path=list(key[1:]), include_defaults=defaults)
    return _MANAGERS[key]


def our_task_names() -> set[str]:
    """The `task:` names of our YAMLs (kvq_lab/lmeval/yaml), read without lm-eval: names among them need no index."""
    names = set()
    for f in TASK_DIR.rglob("*.yaml"):
        m = re.search(r"^task:\s*([\w.-]+)\s*$", f.read_text(), flags=re.M)
        if m:
            names.add(m.group(1))
    return names


def check_tasks(names: list[str], include_path: list[str] | tuple[str, ...] = ()) -> None:
    """ValueError naming the first unknown task/group/tag, with the closest known names."""
    for p in include_path:
        if not Path(p).is_dir():
            raise ValueError(f"task.include_path entry {p!r} is not a folder of lm-eval task YAMLs")
    if set(names) <= our_task_names():
        return
    known = set(task_manager(include_path).all_tasks)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else "; `lm_eval ls tasks` lists them"
            raise ValueError(f"task.tasks: {name!r} is not an lm-eval task, group or tag{hint}")


def flatten(results: dict, n_samples: dict, scale: float = 1.0) -> dict[str, float]:
    """lm-eval's `results` (per task and group) -> flat `{name}/{metric}[_{filter}]` times `scale` (stderr and
    aliases left out) plus `{name}/n` for tasks."""
    metrics: dict[str, float] = {}
    for task, res in results.items():
        for key, value in res.items():
            if key in ("alias", "sample_len") or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            name, _, filt = key.partition(",")
            label = name if filt in ("", "none") else f"{name}_{filt}"
            metrics[f"{task}/{label}"] = float(value) * scale if not math.isnan(value) else float("nan")
        if task in n_samples:
            metrics[f"{task}/n"] = int(n_samples[task]["effective"])
    return metrics


@dataclass
class Evaluation:
    """What `evaluate` returns: flat metrics, lm-eval's per-sample records per task, and the wrapper's counts."""

    metrics: dict[str, float]
    samples: dict[str, list[dict]]
    generate_calls: int
    loglikelihood_requests: int


def evaluate(
    names: list[str],
    model,
    tokenizer,
    make_cache,
    limit: int | None = None,
    batch_size: int = 1,
    num_fewshot=None,
    include_path: list[str] | tuple[str, ...] = (),
    prefix_reuse: bool = True,
    scale: float = 1.0,
    max_length: int | None = None,
) -> Evaluation:
    """Run lm-eval on `names` with every generate call given `make_cache()`; every seed fixed, no bootstrap."""
    import lm_eval

    from .wrapper import QuantCacheLM

    lm = QuantCacheLM(
        model, tokenizer, make_cache, batch_size=batch_size, max_length=max_length, prefix_reuse=prefix_reuse
    )
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(names),
        limit=limit,
        task_manager=task_manager(include_path, names),
        num_fewshot=num_fewshot,
        log_samples=True,
        bootstrap_iters=0,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    if lm.prefix_reuse:
        log.info("prefix reuse: %d prompt tokens came from checkpoints instead of a prefill", lm.prefix_tokens)
    metrics = flatten(out["results"], out.get("n-samples", {}), scale)
    return Evaluation(metrics, out.get("samples", {}), lm.generate_calls, lm.loglikelihood_requests)
