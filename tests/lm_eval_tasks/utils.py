"""Inline data for the test tasks in this folder (no files, no network)."""

QUESTIONS = ["The sky is", "Two plus two is", "Water freezes at"]


def load_tiny_mc(**kwargs):
    import datasets

    rows = [{"question": q, "choices": [" blue", " four", " zero"], "label": i} for i, q in enumerate(QUESTIONS)]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_tiny_gen(**kwargs):
    import datasets

    rows = [{"question": q, "answer": a} for q, a in zip(QUESTIONS, [" blue", " four", " zero"], strict=True)]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
