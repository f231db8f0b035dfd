"""The evaluation datasets kvq_lab reads, in one place: each one's file under the data folder (what validation parses
and hashes before any model loads), its hub id (read when no data folder is given), the loaders lm-eval's task YAMLs
call (`custom_dataset`, kvq_lab/lmeval/yaml/), and CoQA's prompt, which the probes reuse.

Loaders read $KVQ_DATA_DIR (the runner sets it from `data_dir`) and fall back to the hub; they import `datasets`
only when called, so validation stays light.
"""

from __future__ import annotations

import csv
import json
import os
from itertools import zip_longest
from pathlib import Path

from . import DataFile

COQA_FILE = "coqa/coqa-validation.first20.lm_eval.jsonl"
COQA_HUB = "EleutherAI/coqa"
COQA_DATA = DataFile(COQA_FILE, "jsonl", ("story", "questions", "answers"))

GSM8K_FILES = {"train": "gsm8k/train.jsonl", "test": "gsm8k/test.jsonl"}
GSM8K_HUB, GSM8K_CONFIG = "gsm8k", "main"
GSM8K_DATA = tuple(DataFile(GSM8K_FILES[s], "jsonl", ("question", "answer")) for s in ("test", "train"))

TQA_FILE = "truthfulqa/TruthfulQA.csv"
TQA_HUB, TQA_CONFIG = "truthfulqa/truthful_qa", "generation"
TQA_COLUMNS = ("Type", "Category", "Question", "Best Answer", "Correct Answers", "Incorrect Answers", "Source")
TQA_DATA = DataFile(TQA_FILE, "csv", TQA_COLUMNS)

ADVBENCH_DATA = DataFile("advbench/harmful_behaviors.csv", "csv", ("goal", "target"))


def _local(rel: str, what: str) -> Path | None:
    """The data folder's copy of `rel`, None without a data folder (then the hub); FileNotFoundError if missing."""
    data_dir = os.environ.get("KVQ_DATA_DIR")
    if not data_dir:
        return None
    path = Path(data_dir) / rel
    if not path.exists():
        raise FileNotFoundError(f"{what} data file {path} not found; set KVQ_DATA_DIR/data_dir to the data folder")
    return path


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_coqa(**kwargs):
    """DatasetDict with a `validation` split: from $KVQ_DATA_DIR when set, else the hub."""
    import datasets

    path = _local(COQA_FILE, "CoQA")
    if path is None:
        return datasets.load_dataset(COQA_HUB)
    return datasets.DatasetDict({"validation": datasets.Dataset.from_list(_jsonl(path))})


def load_gsm8k(**kwargs):
    """DatasetDict with `train` (the few-shot pool) and `test`: from $KVQ_DATA_DIR when set, else the hub."""
    import datasets

    if not os.environ.get("KVQ_DATA_DIR"):
        return datasets.load_dataset(GSM8K_HUB, GSM8K_CONFIG)
    splits = {}
    for split, rel in GSM8K_FILES.items():
        rows = _jsonl(_local(rel, "GSM8K"))
        splits[split] = datasets.Dataset.from_list([{"question": r["question"], "answer": r["answer"]} for r in rows])
    return datasets.DatasetDict(splits)


def _split(field: str) -> list[str]:
    # as the hub dataset's builder splits the CSV's list columns
    return [item.strip() for item in field.strip().split(";")]


def load_truthfulqa(**kwargs):
    """DatasetDict with a `validation` split (817 questions): from $KVQ_DATA_DIR when set, else the hub."""
    import datasets

    path = _local(TQA_FILE, "TruthfulQA")
    if path is None:
        return datasets.load_dataset(TQA_HUB, TQA_CONFIG)
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


def coqa_prompt(doc: dict) -> str:
    """lm-eval's CoQA prompt: the story, then "Q: ...\\n\\nA: ...\\n\\n" turns, ending "Q: <last>\\n\\nA:"."""
    # Given a passage p, the conversation history {q1, a1, . . . qi−1, ai−1} and a question qi, predict ai
    doc_text = doc["story"] + "\n\n"
    for q, a in zip_longest(doc["questions"]["input_text"], doc["answers"]["input_text"][:-1]):
        question = f"Q: {q}\n\n"
        answer = f"A: {a}\n\n" if a is not None else "A:"
        doc_text += question + answer
    return doc_text
