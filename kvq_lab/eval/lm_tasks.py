"""Any lm-eval-harness task or group through the quantized-cache wrapper (`task=lm_eval task.tasks=<names>`).

Task names are looked up in lm-eval's index plus our task folder (kvq_lab/eval/tasks, which overrides lm-eval's
coqa, gsm8k and truthfulqa_gen) and any `include_path` folders. Indexing lm-eval's ~15k task YAMLs takes tens of
seconds, so one TaskManager per set of folders is kept for the process: the check before the model load and the
run share it. Importing this module does not import torch.

Metrics are lm-eval's values as it reports them (fractions for accuracies, perplexities as they are), flattened to
`<task or group>/<metric>[_<filter>]`, plus `<task>/n` and the wrapper's counts `lm_eval/generate_calls` (each
got a fresh cache) and `lm_eval/loglikelihood_requests` (which never read a generation cache).
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path

from .harness import our_task_names, seeded_evaluate, task_manager


def check_tasks(names: list[str], include_path: list[str] | tuple[str, ...] = ()) -> None:
    """ValueError naming the first unknown task/group/tag, with the closest known names."""
    for p in include_path:
        if not Path(p).is_dir():
            raise ValueError(f"task.include_path entry {p!r} is not a folder of lm-eval task YAMLs")
    if set(names) <= our_task_names():
        return
    tm = task_manager(include_path)
    known = set(tm.all_tasks)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else "; `lm_eval ls tasks` lists them"
            raise ValueError(f"task.tasks: {name!r} is not an lm-eval task, group or tag{hint}")


def flatten(results: dict, n_samples: dict) -> dict[str, float]:
    """lm-eval's `results` (per task and group) -> flat `{name}/{metric}[_{filter}]` (stderr and aliases left out)
    plus `{name}/n` for tasks."""
    metrics: dict[str, float] = {}
    for task, res in results.items():
        for key, value in res.items():
            if key in ("alias", "sample_len") or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            name, _, filt = key.partition(",")
            label = name if filt in ("", "none") else f"{name}_{filt}"
            metrics[f"{task}/{label}"] = float(value) if not math.isnan(value) else float("nan")
        if task in n_samples:
            metrics[f"{task}/n"] = int(n_samples[task]["effective"])
    return metrics


def run_tasks(
    names: list[str],
    model,
    tokenizer,
    make_cache,
    limit: int | None = None,
    batch_size: int = 1,
    num_fewshot=None,
    include_path: list[str] | tuple[str, ...] = (),
    prefix_reuse: bool = True,
) -> tuple[dict[str, float], list[dict]]:
    """-> (flat metrics, per-sample records with the response). Every generate call gets `make_cache()`."""
    from .lm import QuantCacheLM

    lm = QuantCacheLM(model, tokenizer, make_cache, batch_size=batch_size, max_length=None, prefix_reuse=prefix_reuse)
    out = seeded_evaluate(
        lm, names, task_manager(include_path, names), limit=limit, num_fewshot=num_fewshot, log_samples=True
    )
    metrics = flatten(out["results"], out.get("n-samples", {}))
    metrics["lm_eval/generate_calls"] = lm.generate_calls
    metrics["lm_eval/loglikelihood_requests"] = lm.loglikelihood_requests
    samples = [
        {"task": task, "doc_id": s.get("doc_id"), "target": s.get("target"), "responses": s.get("filtered_resps")}
        for task, rows in out.get("samples", {}).items()
        for s in rows
    ]
    return metrics, samples
