"""TruthfulQA (generation) for lm-eval-harness: lm-eval's task and scoring, data from the local CSV when set."""

from __future__ import annotations

import csv
import os
from pathlib import Path

LOCAL_FILE = "truthfulqa/TruthfulQA.csv"
HUB_ID, HUB_CONFIG = "truthfulqa/truthful_qa", "generation"


def _split(field: str) -> list[str]:
    # as the hub dataset's builder splits the CSV's list columns
    return [item.strip() for item in field.strip().split(";")]


def load_truthfulqa(**kwargs):
    """DatasetDict with a `validation` split (817 questions): from $KVQ_DATA_DIR when set, else the hub."""
    import datasets

    data_dir = os.environ.get("KVQ_DATA_DIR")
    if not data_dir:
        return datasets.load_dataset(HUB_ID, HUB_CONFIG)
    path = Path(data_dir) / LOCAL_FILE
    if not path.exists():
        raise FileNotFoundError(f"TruthfulQA file {path} not found; set KVQ_DATA_DIR/data_dir to the data folder")
    with path.open(newline="", encoding="utf-8-sig") as f:
        rows = [
            {
                "type": r["Type"],
                "category": r["Category"],
                "question": r["Question"],
                "best_answer": r["Best Answer"],
                "correct_answers": _split(r["Correct Answers"]),
                "incorrect_answers": _split(r["Incorrect Answers"]),
                "source": r["Source"],
            }
            for r in csv.DictReader(f)
        ]
    return datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows)})


# lm-eval's own processing and metrics (t5-style BLEU via sacrebleu, ROUGE via rouge_score), imported when lm-eval
# calls them: run validation reads LOCAL_FILE from this module and must stay light.
def process_docs_gen(dataset):
    from lm_eval.tasks.truthfulqa.utils import process_docs_gen as f

    return f(dataset)


def process_results_gen(doc, results):
    from lm_eval.tasks.truthfulqa.utils import process_results_gen as f

    return f(doc, results)
