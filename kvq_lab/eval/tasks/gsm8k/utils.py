"""GSM8K for lm-eval-harness: lm-eval's own task definition, data from local files when $KVQ_DATA_DIR is set."""

from __future__ import annotations

import json
import os
from pathlib import Path

LOCAL_FILES = {"train": "gsm8k/train.jsonl", "test": "gsm8k/test.jsonl"}
HUB_ID, HUB_CONFIG = "gsm8k", "main"


def load_gsm8k(**kwargs):
    """DatasetDict with `train` (the few-shot pool) and `test`: from $KVQ_DATA_DIR when set, else the hub."""
    import datasets

    data_dir = os.environ.get("KVQ_DATA_DIR")
    if not data_dir:
        return datasets.load_dataset(HUB_ID, HUB_CONFIG)
    splits = {}
    for split, rel in LOCAL_FILES.items():
        path = Path(data_dir) / rel
        if not path.exists():
            raise FileNotFoundError(f"GSM8K data file {path} not found; set KVQ_DATA_DIR/data_dir to the data folder")
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        splits[split] = datasets.Dataset.from_list([{"question": r["question"], "answer": r["answer"]} for r in rows])
    return datasets.DatasetDict(splits)
