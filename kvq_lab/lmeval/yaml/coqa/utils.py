"""CoQA for lm-eval-harness: prompt and scoring as lm-eval 0.4's `coqa`, self-contained metrics; the data and the
prompt come from kvq_lab.tasks.datasets."""

from __future__ import annotations

import collections
import re
import string

from kvq_lab.tasks.datasets import coqa_prompt, load_coqa  # noqa: F401  (`!function utils.load_coqa`)

doc_to_text = coqa_prompt  # the YAMLs' `!function utils.doc_to_text`


def expand_turns(dataset):
    """One doc per turn: the story with the conversation up to and including that turn's question."""

    def gen():
        for doc in dataset:
            n = len(doc["questions"]["input_text"])
            for i in range(1, n + 1):
                extra = doc.get("additional_answers") or {}
                yield {
                    **doc,
                    "questions": {k: v[:i] for k, v in doc["questions"].items()},
                    "answers": {k: v[:i] for k, v in doc["answers"].items()},
                    "additional_answers": {key: {k: v[:i] for k, v in a.items()} for key, a in extra.items()} or None,
                }

    import datasets

    return datasets.Dataset.from_list(list(gen()))


def doc_to_target(doc):
    """The reference answer for the last turn, plus distinct additional answers."""
    turn_id = len(doc["questions"]["input_text"])
    answers = [doc["answers"]["input_text"][turn_id - 1]]
    for extra in (doc.get("additional_answers") or {}).values():
        if extra is None or len(extra["input_text"]) < turn_id:
            continue
        alt = extra["input_text"][turn_id - 1]
        if alt.lower() not in map(str.lower, answers):
            answers.append(alt)
    return answers


# --- SQuAD v2 normalisation and scores (as transformers' former squad_metrics) ---
def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def compute_exact(a_gold: str, a_pred: str) -> int:
    return int(normalize_answer(a_gold) == normalize_answer(a_pred))


def compute_f1(a_gold: str, a_pred: str) -> float:
    gold_toks = normalize_answer(a_gold).split()
    pred_toks = normalize_answer(a_pred).split()
    common = collections.Counter(gold_toks) & collections.Counter(pred_toks)
    num_same = sum(common.values())
    if len(gold_toks) == 0 or len(pred_toks) == 0:
        # If either is no-answer, then F1 is 1 if they agree, 0 otherwise
        return float(gold_toks == pred_toks)
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_toks)
    recall = num_same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def compute_scores(gold_list, pred):
    """lm-eval's CoQA scoring: with several golds, average over leave-one-out maxima."""
    f1_sum = em_sum = 0.0
    if len(gold_list) > 1:
        for i in range(len(gold_list)):
            others = gold_list[:i] + gold_list[i + 1 :]
            em_sum += max(compute_exact(a, pred) for a in others)
            f1_sum += max(compute_f1(a, pred) for a in others)
    else:
        em_sum += max(compute_exact(a, pred) for a in gold_list)
        f1_sum += max(compute_f1(a, pred) for a in gold_list)
    return {"em": em_sum / max(1, len(gold_list)), "f1": f1_sum / max(1, len(gold_list))}


def process_results(doc, results):
    pred = results[0].strip().split("\n")[0]
    return compute_scores(doc_to_target(doc), pred)
