"""Run lm-eval-harness tasks (ours, from kvq_lab/eval/tasks/, or lm-eval's own) through a quantized cache."""

from __future__ import annotations

import logging
import math

log = logging.getLogger(__name__)


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
    from .lm_tasks import task_manager

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
