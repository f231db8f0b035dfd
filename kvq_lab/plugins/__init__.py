"""The one module that assembles kvq_lab's built-in plugins: importing a plugin module registers it.

Registries (`kvq_lab.tasks.TASKS`, ...) never import their plugins; this module does, and validation and the runner
import this module. A new task is one module plus one line here. Kept torch-free: validation imports it.
"""

from __future__ import annotations

from kvq_lab.lmeval import tasks as _lm_eval_tasks  # noqa: F401  (coqa, coqa_turns, gsm8k, truthfulqa_gen, lm_eval)
from kvq_lab.tasks import TASKS
from kvq_lab.tasks import behavior as _behavior  # noqa: F401  (behavior)
from kvq_lab.tasks import fidelity as _fidelity  # noqa: F401  (fidelity)
from kvq_lab.tasks import ppl as _ppl  # noqa: F401  (ppl)
from kvq_lab.tasks import probe as _probe  # noqa: F401  (probe)
from kvq_lab.tasks import retrieval as _retrieval  # noqa: F401  (retrieval)

__all__ = ["TASKS"]
