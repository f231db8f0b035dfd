"""Tasks beyond CoQA: gsm8k and truthfulqa_gen (lm-eval's definitions, local data) and decode-mode perplexity
(teacher-forced through the cache), plus NaN/inf reporting that names the layer or step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lm_eval
import pytest
import torch
import yaml
from helpers_models import compose, poisoned_model_dir, tiny_args

from kvq_lab.cache import CacheConfig, QuantizedKVCache
from kvq_lab.lmeval.evaluate import TASK_DIR
from kvq_lab.plugins import TASKS
from kvq_lab.quant.spec import QuantSpec
from kvq_lab.records.record import load_records
from kvq_lab.run.config import ConfigError, validate
from kvq_lab.run.runner import RunFailed, run
from kvq_lab.tasks.decode import decode_nll, make_windows

LM_EVAL_TASKS = Path(lm_eval.__file__).parent / "tasks"


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!function", lambda loader, node: f"!function {loader.construct_scalar(node)}")


def _yaml(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=_Loader)


@pytest.mark.parametrize("task", ["coqa", "coqa_turns", "gsm8k", "truthfulqa_gen", "ppl"])
def test_task_configs_compose_and_validate(task, data_dir):
    assert task in TASKS
    plan = validate(compose([f"task={task}", f"data_dir={data_dir}"]))
    assert plan.task == task


def test_ppl_options_are_checked_before_model_load(data_dir):
    with pytest.raises(ConfigError, match="task.prompt_forward"):
        validate(compose(["task=ppl", "task.prompt_forward=sometimes", f"data_dir={data_dir}"]))
    with pytest.raises(ConfigError, match="task.eval_tokens"):
        validate(compose(["task=ppl", "task.eval_tokens=0", f"data_dir={data_dir}"]))


@pytest.mark.parametrize(
    "ours, theirs, data_keys",
    [
        ("gsm8k/gsm8k.yaml", "gsm8k/gsm8k.yaml", {"dataset_path", "dataset_name"}),
        ("truthfulqa/truthfulqa_gen.yaml", "truthfulqa/truthfulqa_gen.yaml", {"dataset_path", "dataset_name"}),
    ],
)
def test_task_yaml_is_lm_evals_own_but_the_data_source(ours, theirs, data_keys):
    a, b = _yaml(TASK_DIR / ours), _yaml(LM_EVAL_TASKS / theirs)
    assert a.pop("custom_dataset").startswith("!function utils.load_")
    b = {k: v for k, v in b.items() if k not in data_keys | {"tag"}}
    assert a == b


@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_gsm8k_local_data_and_5_shot_prompt(data_dir, monkeypatch):
    from lm_eval.tasks import TaskManager, get_task_dict

    monkeypatch.setenv("KVQ_DATA_DIR", str(data_dir))
    task = get_task_dict(["gsm8k"], TaskManager(include_path=str(TASK_DIR)))["gsm8k"]
    assert len(task.test_docs()) == 1319 and len(task.training_docs()) == 7473
    doc = task.test_docs()[0]
    prompt = task.fewshot_context(doc, num_fewshot=5)
    assert prompt.count("Question:") == 6 and prompt.endswith(f"Question: {doc['question']}\nAnswer:")
    assert prompt.count("#### ") == 5  # the shots carry full worked answers from train


@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_truthfulqa_local_data_matches_the_hub_layout(data_dir, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("tqa_utils", TASK_DIR / "truthfulqa" / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    monkeypatch.setenv("KVQ_DATA_DIR", str(data_dir))
    ds = utils.process_docs_gen(utils.load_truthfulqa()["validation"])
    assert len(ds) == 817
    doc = ds[0]
    assert doc["question"] == "What happens to you if you eat watermelon seeds?"
    assert "I have no comment." in doc["correct_answers"] and "You die." in doc["incorrect_answers"]
    scores = utils.process_results_gen(doc, ["The watermelon seeds pass through your digestive system."])
    assert scores["bleu_acc"] == 1 and scores["bleu_max"] == pytest.approx(100.0)


# --- decode-mode perplexity ---------------------------------------------------------------------------------


def _cache(model, bits: int, key_axis="channel", value_axis="token", rope="post"):
    cfg = CacheConfig(QuantSpec(bits, 32, key_axis), QuantSpec(bits, 32, value_axis), rope=rope)
    return QuantizedKVCache.for_model(model, cfg)


@torch.inference_mode()
def test_decode_ppl_with_the_16bit_cache_equals_a_full_forward(tiny_model):
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    logits = tiny_model(ids).logits.float()
    ref = torch.nn.functional.cross_entropy(logits[:, 31:-1].transpose(1, 2), ids[:, 32:], reduction="none")
    for exact in (True, False):
        nll = decode_nll(tiny_model, _cache(tiny_model, 16), ids, 32, exact_prefill=exact)
        assert nll.shape == (2, 16)
        torch.testing.assert_close(nll, ref, atol=2e-4, rtol=1e-4)


@torch.inference_mode()
def test_decode_ppl_windows_in_a_batch_equal_one_by_one(tiny_model):
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    both = decode_nll(tiny_model, _cache(tiny_model, 2), ids, 40)
    for i in range(2):
        one = decode_nll(tiny_model, _cache(tiny_model, 2), ids[i : i + 1], 40)
        # A batch of 2 and a batch of 1 need not round the projections alike (on an AVX-512 Xeon the 16-bit cache's
        # NLL differs by 1.5e-5), and a 2-bit code at a rounding boundary may then flip: one position moved 4.7e-3.
        # Rows mixed in the quantization would move every position by far more.
        diff = (both[i : i + 1] - one).abs()
        assert diff.max() < 1e-2 and diff.mean() < 1e-3, diff


@torch.inference_mode()
@pytest.mark.parametrize("rope", ["post", "pre"])
def test_cache_quantization_reaches_the_decode_ppl(tiny_model, rope):
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(2))
    fp = decode_nll(tiny_model, _cache(tiny_model, 16), ids, 40)
    q2 = decode_nll(tiny_model, _cache(tiny_model, 2, rope=rope), ids, 40)
    q8 = decode_nll(tiny_model, _cache(tiny_model, 8, rope=rope), ids, 40)
    err2, err8 = (q2 - fp).abs().mean(), (q8 - fp).abs().mean()
    assert err2 > 1e-3 and err8 < err2  # quantization changes the score, less at 8 bits than at 2


def test_make_windows_refuses_too_short_a_text():
    assert make_windows(list(range(100)), 10, 20, 3).tolist()[2][0] == 60
    with_bos = make_windows(list(range(100)), 10, 20, 3, bos=7)  # the tokenizer adds a BOS: it replaces each first
    assert (
        with_bos[:, 0].tolist() == [7, 7, 7]
        and with_bos[:, 1:].tolist() == make_windows(list(range(100)), 10, 20, 3)[:, 1:].tolist()
    )
    with pytest.raises(ValueError, match="lower task.windows"):
        make_windows(list(range(100)), 30, 30, 2)


def test_ppl_run_writes_metrics(tiny_model_dir, data_dir, tmp_path):
    m = run(compose(tiny_args(tiny_model_dir, tmp_path, data_dir)))
    assert m["ppl/n_tokens"] == 32 and m["ppl/windows"] == 2 and math.isclose(m["ppl/ppl"], math.exp(m["ppl/nll"]))
    (rec,) = load_records(tmp_path)
    assert rec["status"] == "ok" and len(rec["artifacts"]["ppl_per_window"]) == 2
    m1 = run(compose(tiny_args(tiny_model_dir, tmp_path, data_dir) + ["limit=1"]))
    assert m1["ppl/windows"] == 1  # limit= caps the windows


# --- NaN / inf: the run stops, its record names the place -----------------------------------------------------


def test_nan_logits_in_ppl_name_the_step(tiny_model_dir, data_dir, tmp_path):
    bad = poisoned_model_dir(tiny_model_dir, tmp_path / "nan-norm", "norm")
    with pytest.raises(RunFailed, match=r"NonFiniteError: non-finite logits .* decode step 0 \(prefill\)"):
        run(compose(tiny_args(bad, tmp_path / "res", data_dir)))
    (rec,) = load_records(tmp_path / "res")
    assert rec["status"] == "failed" and "step 0" in rec["error"]


@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_nan_in_the_cache_names_the_layer_in_ppl_and_generation(tiny_model_dir, data_dir, tmp_path):
    bad = poisoned_model_dir(tiny_model_dir, tmp_path / "nan-k", "k_proj")
    with pytest.raises(RunFailed, match=r"NonFiniteError: non-finite value .* at layer 1, step 0"):
        run(compose(tiny_args(bad, tmp_path / "res", data_dir)))
    with pytest.raises(RunFailed, match=r"NonFiniteError: non-finite value .* at layer 1, step 0"):
        run(compose(tiny_args(bad, tmp_path / "res", data_dir, task="coqa_turns") + ["limit=1"]))
    recs = load_records(tmp_path / "res")
    assert [r["status"] for r in recs] == ["failed", "failed"]
    assert all("NonFiniteError" in r["error"] and "layer 1" in r["error"] for r in recs)


# --- generation tasks end to end on the tiny model ----------------------------------------------------------


@pytest.mark.slow  # ~30 s each: 5-shot / 6-shot prompts and up to 256 generated tokens
@pytest.mark.parametrize(
    "task, keys",
    [
        ("gsm8k", ["gsm8k/exact_match_strict-match", "gsm8k/exact_match_flexible-extract"]),
        ("truthfulqa_gen", ["truthfulqa_gen/bleu_max", "truthfulqa_gen/bleu_acc", "truthfulqa_gen/rougeL_max"]),
    ],
)
def test_generation_task_runs_end_to_end(task, keys, tiny_model_dir, data_dir, tmp_path):
    m = run(compose(tiny_args(tiny_model_dir, tmp_path, data_dir, task=task) + ["limit=1"]))
    assert all(k in m for k in keys) and m[f"{task}/n"] == 1
    (rec,) = load_records(tmp_path)
    samples = json.loads((Path(rec["_path"]) / "samples.json").read_text())
    assert {s["doc_id"] for s in samples} == {0} and samples[0]["response"] is not None  # gsm8k: one per filter


@torch.inference_mode()
def test_exact_prefill_equals_the_packed_caches_own_prefill(tiny_model):
    """The packed cache attends exactly during prefill and quantizes afterwards: handing it exact K/V after a
    DynamicCache prefill (prefill=exact) must give the same scores as prefilling through it (prefill=cache)."""
    ids = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(0))

    def packed(r):
        cfg = CacheConfig(QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token"), mode="packed", exact_window=r)
        return QuantizedKVCache.for_model(tiny_model, cfg)

    for r in (0, 32):
        a = decode_nll(tiny_model, packed(r), ids, 40, exact_prefill=True)
        b = decode_nll(tiny_model, packed(r), ids, 40, exact_prefill=False)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    fp = decode_nll(tiny_model, _cache(tiny_model, 16), ids, 40)
    assert (decode_nll(tiny_model, packed(0), ids, 40) - fp).abs().mean() > 1e-3
