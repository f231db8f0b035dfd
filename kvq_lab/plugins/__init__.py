"""The built-in tasks' registry lines: `task=<name>` runs the task `module:NAME`, imported on first lookup.

Kept here, above kvq_lab.lmeval, because some tasks live there and the task registry (kvq_lab.tasks) sits below it:
the registry imports none of its plugins, and this module imports none either (it names them). Validation, the
runner and the report read `TASKS` from here. A new task is one module, one line here and `conf/task/<name>.yaml`.
Torch-free: listing the names imports nothing; looking one up imports that task's module only.
"""

from __future__ import annotations

from kvq_lab.tasks import TASKS

TASKS.add_lazy("behavior", "kvq_lab.tasks.behavior:BEHAVIOR")
TASKS.add_lazy("coqa", "kvq_lab.lmeval.tasks:COQA")
TASKS.add_lazy("coqa_turns", "kvq_lab.lmeval.tasks:COQA_TURNS")
TASKS.add_lazy("fidelity", "kvq_lab.tasks.fidelity:FIDELITY")
TASKS.add_lazy("gsm8k", "kvq_lab.lmeval.tasks:GSM8K")
TASKS.add_lazy("lm_eval", "kvq_lab.lmeval.tasks:LM_EVAL")
TASKS.add_lazy("ppl", "kvq_lab.tasks.ppl:PPL")
TASKS.add_lazy("probe", "kvq_lab.tasks.probe:PROBE")
TASKS.add_lazy("retrieval", "kvq_lab.tasks.retrieval:RETRIEVAL")
TASKS.add_lazy("truthfulqa_gen", "kvq_lab.lmeval.tasks:TRUTHFULQA_GEN")

__all__ = ["TASKS"]
