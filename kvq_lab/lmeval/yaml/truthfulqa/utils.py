"""TruthfulQA (generation) for lm-eval-harness: lm-eval's task and scoring, data from the local CSV when set."""

from __future__ import annotations

from kvq_lab.tasks.datasets import load_truthfulqa  # noqa: F401  (`!function utils.load_truthfulqa`)


# lm-eval's own processing and metrics (t5-style BLEU via sacrebleu, ROUGE via rouge_score), imported when lm-eval
# calls them.
def process_docs_gen(dataset):
    from lm_eval.tasks.truthfulqa.utils import process_docs_gen as f

    return f(dataset)


def process_results_gen(doc, results):
    from lm_eval.tasks.truthfulqa.utils import process_results_gen as f

    return f(doc, results)
