"""`task=fidelity`: KL divergence and top-1 agreement of the cache's next-token distributions against the 16-bit
model's own, along a teacher-forced decode (kvq_lab/eval/fidelity.py). Same windows, text sources and checks as
`task=ppl`; options in conf/task/fidelity.yaml."""

from __future__ import annotations

from . import TaskContext, register_task
from .ppl import PplTask


class FidelityTask(PplTask):
    """Drift of the next-token distribution from the 16-bit model's, per decode position (no accuracy)."""

    name = "fidelity"

    def run(self, ctx: TaskContext) -> dict[str, float]:
        from kvq_lab.eval.fidelity import run_fidelity

        return run_fidelity(ctx)


register_task(FidelityTask())
