"""Run lm-eval-harness tasks (ours, from kvq_lab/eval/tasks/, or lm-eval's own) through a quantized cache."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

log = logging.getLogger(__name__)

TASK_DIR = Path(__file__).parent / "tasks"  # our task YAMLs (they override lm-eval's coqa, gsm8k, truthfulqa_gen)
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
    """The `task:` names of our YAMLs (kvq_lab/eval/tasks), read without lm-eval: names among them need no index."""
    names = set()
    for f in TASK_DIR.rglob("*.yaml"):
        m = re.search(r"^task:\s*([\w.-]+)\s*$", f.read_text(), flags=re.M)
        if m:
            names.add(m.group(1))
    return names


def seeded_evaluate(lm, tasks, task_manager, limit=None, num_fewshot=None, log_samples: bool = False) -> dict:
    """`lm_eval.simple_evaluate` with every seed fixed and no bootstrap: the one call every lm-eval path here makes."""
    import lm_eval

    return lm_eval.simple_evaluate(
        model=lm,
        tasks=list(tasks),
        limit=limit,
        task_manager=task_manager,
        num_fewshot=num_fewshot,
        log_samples=log_samples,
        bootstrap_iters=0,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


def run_lm_eval(
    task: str,
    model,
    tokenizer,
    make_cache,
    limit: int | None = None,
    batch_size: int = 1,
    num_fewshot=None,
    log_samples: bool = False,
    prefix_reuse: bool = True,
) -> tuple[dict[str, float], list[dict]]:
    """-> (flat metrics `{task}/{metric}` plus `{task}/n`, per-sample records (empty unless log_samples))."""
    from .lm import QuantCacheLM

    lm = QuantCacheLM(model, tokenizer, make_cache, batch_size=batch_size, prefix_reuse=prefix_reuse)
    tm = task_manager(names=[task])
    out = seeded_evaluate(lm, [task], tm, limit=limit, num_fewshot=num_fewshot, log_samples=log_samples)
    if lm.prefix_reuse:
        log.info("prefix reuse: %d prompt tokens came from checkpoints instead of a prefill", lm.prefix_tokens)
    res = out["results"][task]
    metrics: dict[str, float] = {}
    for key, value in res.items():
        if key in ("alias", "sample_len") or "_stderr" in key or not isinstance(value, (int, float)):
            continue
        name, _, filt = key.partition(",")
        # multiply by 100: scores are reported in percent, as the papers do
        label = name if filt in ("", "none") else f"{name}_{filt}"
        metrics[f"{task}/{label}"] = float(value) * 100 if not math.isnan(value) else float("nan")
    metrics[f"{task}/n"] = int(out["n-samples"][task]["effective"])
    samples = out.get("samples", {}).get(task, []) if log_samples else []
    return metrics, samples
