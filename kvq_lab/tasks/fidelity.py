"""Fidelity along the generation: the quantized cache's next-token distributions against the 16-bit model's own.

Same windows and the same teacher-forced decode as decode-mode perplexity (kvq_lab/tasks/decode.py: prefill the
context, then feed the true tokens one at a time through the cache), run twice: once with an exact `DynamicCache`
(the reference, computed once per model, token ids and protocol and kept on disk across processes:
kvq_lab/tasks/reference.py) and once through the run's cache. At every scored position t (decode step t of window b):

    KL_t = sum_v p_ref(v) * (log p_ref(v) - log p_q(v))      (KL(reference || quantized), nats)
    top1_t = [argmax p_ref == argmax p_q]

Metrics: what `llama-perplexity --kl-divergence` reports, with its definitions (kvq_lab/tasks/kld_stats.py):
`fidelity/kl_mean` (± `kl_mean_unc`) and the KL percentiles (`kl_max`, `kl_p99_9`, `kl_p99`, ... `kl_median` ...
`kl_min`), `fidelity/top1_agree` ("same top p", ± its binomial `top1_agree_unc`), the perplexities (`fidelity/ppl`,
`fidelity/ref_ppl`, each ± `_unc`), `ln_ppl_ratio` ± `ln_ppl_ratio_unc`, `ppl_ratio`, `ppl_diff`, `ln_ppl_cor`,
and the change in the probability of the true token (`dp_mean` ± `dp_mean_unc`, `dp_<percentile>`, `dp_rms`);
then KL and top-1 agreement over the first and the last quarter of decode positions (`kl_first`, `kl_last`,
`top1_first`, `top1_last`: does the error grow with generation length?). The curve
over decode position (mean over windows, in bins) goes to the record's artifacts and `fidelity_curve.png`.

`task=fidelity` takes the windows, text sources and checks of `task=ppl`; options in conf/task/fidelity.yaml.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvq_lab.common.metric import Metric
from kvq_lab.tasks.reference import stored_reference

from . import Task, TaskContext, register_task
from .ppl import PplTask

if TYPE_CHECKING:  # torch loads when the task runs, not when validation imports the task registry
    import torch

CURVE_BINS = 16


def reference_logprobs(model, windows: torch.Tensor, context: int, exact_prefill: bool, progress=None) -> torch.Tensor:
    """The 16-bit model's log-probs [B, N, V] at every scored position (exact DynamicCache), computed once
    (kvq_lab.tasks.reference)."""

    def compute():
        import torch
        from transformers import DynamicCache

        from kvq_lab.tasks.decode import teacher_forced_logits

        steps = []
        for step, logits in teacher_forced_logits(model, DynamicCache(), windows, context, exact_prefill):
            steps.append(torch.log_softmax(logits, dim=-1))
            if progress is not None:
                progress.done = step + 1
        return torch.stack(steps, dim=1)

    protocol = {"protocol": "decode", "context": context, "exact_prefill": exact_prefill}
    return stored_reference(model, windows, protocol, compute)


def compare(ref_logp: torch.Tensor, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log-probs [..., V] of the reference and the quantized model -> (KL(ref || q) [...], top-1 agreement [...]
    as bool). Identical inputs give exactly 0 and True."""
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(dim=-1)
    return kl, ref_logp.argmax(dim=-1) == logp.argmax(dim=-1)


def curve(per_position: torch.Tensor, bins: int = CURVE_BINS) -> tuple[list[float], list[float]]:
    """[N] values per decode position -> (bin centres, bin means) over `bins` near-equal consecutive bins."""
    n = per_position.numel()
    edges = [round(i * n / min(bins, n)) for i in range(min(bins, n) + 1)]
    centres = [(a + b - 1) / 2 for a, b in zip(edges, edges[1:], strict=False)]
    means = [float(per_position[a:b].mean()) for a, b in zip(edges, edges[1:], strict=False)]
    return centres, means


def save_curve_png(path: Path, positions: list[float], kl: list[float], top1: list[float], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    a.plot(positions, kl, marker="o")
    a.set(xlabel="decode position", ylabel="KL(16-bit || cache), nats", title="KL")
    b.plot(positions, top1, marker="o", color="C1")
    b.set(xlabel="decode position", ylabel="top-1 agreement", title="top-1 agreement", ylim=(0, 1.02))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reference_chunk_logprobs(model, chunks: torch.Tensor, progress=None) -> torch.Tensor:
    """The 16-bit model's log-probs [C, n_ctx - 1 - first, V] over the scored halves of the chunks protocol (exact
    attention, no cache), computed once like `reference_logprobs`."""

    def compute():
        import torch

        from kvq_lab.tasks.chunks import chunk_logprobs

        rows = [logp for _, logp, _ in chunk_logprobs(model, lambda: None, chunks, progress, desc="16-bit chunks")]
        return torch.stack(rows)

    return stored_reference(model, chunks, {"protocol": "chunks"}, compute)


def run_fidelity_chunks(ctx) -> dict[str, float]:
    """`task=fidelity task.protocol=chunks`: llama-perplexity --kl-divergence's report on llama.cpp's chunks
    (kvq_lab/tasks/chunks.py): every scored token of every chunk, the cache's distribution against the 16-bit one."""
    import torch

    from kvq_lab.tasks.chunks import chunk_logprobs, text_chunks
    from kvq_lab.tasks.kld_stats import report

    chunks = text_chunks(ctx)
    ctx.progress.unit, ctx.progress.total = "reference chunks", chunks.shape[0]
    ref = reference_chunk_logprobs(ctx.model, chunks, ctx.progress)
    ctx.progress.unit, ctx.progress.done = "chunks", 0
    kl, agree, nll, ref_nll = [], [], [], []
    for c, logp, target in chunk_logprobs(ctx.model, ctx.make_cache, chunks, ctx.progress):
        k, a = compare(ref[c], logp)
        kl.append(k), agree.append(a)
        nll.append(-logp.gather(1, target[:, None])[:, 0]), ref_nll.append(-ref[c].gather(1, target[:, None])[:, 0])
    stats = report(*(torch.cat(x).double().cpu().numpy() for x in (nll, ref_nll, kl)), torch.cat(agree).numpy())
    return {
        **{f"fidelity/{k}": v for k, v in stats.items()},
        "fidelity/n_tokens": int(sum(x.numel() for x in kl)),
        "fidelity/chunks": int(chunks.shape[0]),
    }


def run_fidelity(ctx) -> dict[str, float]:
    """Task entry point (see the module docstring)."""
    if str(ctx.cfg.task.get("protocol", "decode")) == "chunks":
        return run_fidelity_chunks(ctx)
    import torch
    from transformers import DynamicCache

    from kvq_lab.tasks.decode import teacher_forced_logits, text_windows

    t = ctx.cfg.task
    context, eval_tokens = int(t.context_tokens), int(t.eval_tokens)
    batch = text_windows(ctx)
    windows = batch.shape[0]
    exact = str(t.prompt_forward) == "exact"
    ctx.progress.unit, ctx.progress.total = "reference decode steps", eval_tokens
    ref = reference_logprobs(ctx.model, batch, context, exact, progress=ctx.progress)
    ctx.progress.unit, ctx.progress.done = "decode steps", 0
    cache = ctx.make_cache() or DynamicCache()
    kl = torch.empty(windows, eval_tokens)
    agree = torch.empty(windows, eval_tokens, dtype=torch.bool)
    nll = torch.empty(windows, eval_tokens)
    for step, logits in teacher_forced_logits(ctx.model, cache, batch, context, exact):
        logp = torch.log_softmax(logits, dim=-1)
        kl[:, step], agree[:, step] = compare(ref[:, step], logp)
        nll[:, step] = -logp.gather(1, batch[:, context + step, None])[:, 0]
        ctx.progress.done = step + 1
    ref_nll = -ref.gather(2, batch[:, context:, None])[..., 0]
    q = max(1, eval_tokens // 4)
    pos_kl, pos_top1 = kl.mean(dim=0), agree.float().mean(dim=0)
    centres, kl_bins = curve(pos_kl)
    _, top1_bins = curve(pos_top1)
    ctx.artifacts["fidelity_curve"] = {
        "position": centres,
        "kl_mean": [round(x, 6) for x in kl_bins],
        "top1_agree": [round(x, 4) for x in top1_bins],
    }
    ctx.artifacts["fidelity_by_position"] = {
        "kl_mean": [round(float(x), 6) for x in pos_kl],
        "top1_agree": [round(float(x), 4) for x in pos_top1],
    }
    if ctx.run_dir is not None:
        title = ctx.cache_config.label() if ctx.cache_config is not None else "cache"
        png = Path(ctx.run_dir) / "fidelity_curve.png"
        save_curve_png(png, centres, kl_bins, top1_bins, title)
        ctx.artifacts["fidelity_figures"] = [png.name]
        ctx.artifacts["wandb_images"] = {"fidelity/curve": str(png)}
    from kvq_lab.tasks.kld_stats import report

    stats = report(nll.numpy(), ref_nll.numpy(), kl.numpy(), agree.numpy())  # llama.cpp's --kl-divergence report
    return {
        **{f"fidelity/{k}": v for k, v in stats.items()},
        "fidelity/kl_first": float(kl[:, :q].mean()),
        "fidelity/kl_last": float(kl[:, -q:].mean()),
        "fidelity/top1_first": float(agree[:, :q].float().mean()),
        "fidelity/top1_last": float(agree[:, -q:].float().mean()),
        "fidelity/n_tokens": int(kl.numel()),
        "fidelity/windows": windows,
    }


class FidelityTask(PplTask):
    """Drift of the next-token distribution from the 16-bit model's, per decode position (no accuracy)."""

    name = "fidelity"
    headline = (
        Metric("fidelity/kl_mean", "KL mean", "lower"),
        Metric("fidelity/top1_agree", "top-1 agreement", "higher"),
    )

    def cached_tokens(self, task_cfg) -> int:
        """A chunk of n_ctx under protocol=chunks; otherwise the default length (as fidelity records have always
        been counted, though its windows are ppl's)."""
        return (
            super().cached_tokens(task_cfg)
            if task_cfg.get("protocol") == "chunks"
            else Task.cached_tokens(self, task_cfg)
        )

    def run(self, ctx: TaskContext) -> dict[str, float]:
        return run_fidelity(ctx)


FIDELITY = register_task(FidelityTask())
