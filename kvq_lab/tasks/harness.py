"""Generation tasks through lm-eval-harness (kvq_lab/eval/), with a fresh quantized cache for every `generate`."""

from __future__ import annotations

from kvq_lab.eval.tasks.coqa.utils import HUB_ID as COQA_HUB
from kvq_lab.eval.tasks.coqa.utils import LOCAL_FILE as COQA_FILE
from kvq_lab.eval.tasks.gsm8k.utils import HUB_CONFIG as GSM8K_CONFIG
from kvq_lab.eval.tasks.gsm8k.utils import HUB_ID as GSM8K_HUB
from kvq_lab.eval.tasks.gsm8k.utils import LOCAL_FILES as GSM8K_FILES
from kvq_lab.eval.tasks.truthfulqa.utils import HUB_CONFIG as TQA_CONFIG
from kvq_lab.eval.tasks.truthfulqa.utils import HUB_ID as TQA_HUB
from kvq_lab.eval.tasks.truthfulqa.utils import LOCAL_FILE as TQA_FILE

from . import DataFile, Task, TaskContext, register_task

COQA_DATA = DataFile(COQA_FILE, "jsonl", ("story", "questions", "answers"))


class LmEvalTask(Task):
    """A generation task through lm-eval-harness, with the cache handed to every `generate` call.

    count: documents `limit` selects from, from the rows of the first data file (default: one per row)."""

    options = ("name", "num_fewshot")

    def __init__(self, name: str, data: tuple[DataFile, ...], hub: tuple[str, ...], count=len, lm_eval_name=None):
        self.name = name
        self.data = data
        self.hub = hub
        self.count = count
        self.lm_eval_name = lm_eval_name or name

    def count_docs(self, rows):
        return self.count(rows[self.data[0].rel])

    def run(self, ctx: TaskContext) -> dict[str, float]:
        from kvq_lab.eval.harness import run_lm_eval

        ctx.progress.unit = "generate calls"
        make_cache = ctx.make_cache

        def counted():  # one cache per generate call: counts the batches done, for an interrupted run's record
            ctx.progress.done += 1
            return make_cache()

        metrics, samples = run_lm_eval(
            self.lm_eval_name,
            ctx.model,
            ctx.tokenizer,
            counted,
            limit=ctx.limit,
            batch_size=ctx.cfg.batch_size,
            num_fewshot=ctx.cfg.task.get("num_fewshot"),
            log_samples=True,
            prefix_reuse=ctx.cfg.prefix_reuse,
        )
        ctx.artifacts["samples"] = [
            {
                "doc_id": s.get("doc_id"),
                "target": s.get("target"),
                "response": (s.get("filtered_resps") or [None])[0],
                **{k: s[k] for k in ("em", "f1", "exact_match") if k in s},
            }
            for s in samples
        ]
        return metrics


def _turns(rows) -> int:
    return sum(len(r["questions"]["input_text"]) for r in rows)


register_task(LmEvalTask("coqa", (COQA_DATA,), (COQA_HUB,)))
register_task(LmEvalTask("coqa_turns", (COQA_DATA,), (COQA_HUB,), count=_turns))
register_task(
    LmEvalTask(
        "gsm8k",
        tuple(DataFile(GSM8K_FILES[s], "jsonl", ("question", "answer")) for s in ("test", "train")),
        (f"{GSM8K_HUB}/{GSM8K_CONFIG}",),
    )
)
TQA_COLUMNS = ("Type", "Category", "Question", "Best Answer", "Correct Answers", "Incorrect Answers", "Source")
register_task(LmEvalTask("truthfulqa_gen", (DataFile(TQA_FILE, "csv", TQA_COLUMNS),), (f"{TQA_HUB}/{TQA_CONFIG}",)))
