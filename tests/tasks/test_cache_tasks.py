"""Tasks where the cache is really used: retrieval, fidelity, behaviour drift, any text for ppl/fidelity,
any lm-eval task, and the lm-eval `kvq` model. Scoring on hand-made cases; end to end on the tiny model."""

from __future__ import annotations

import json
import logging
import math
import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers_models import REPO, compose, tiny_args

from kvq_lab.records.record import load_records
from kvq_lab.run.config import ConfigError, validate
from kvq_lab.run.runner import run
from kvq_lab.tasks import behavior as B
from kvq_lab.tasks import decode as D
from kvq_lab.tasks import retrieval as R
from kvq_lab.tasks.fidelity import compare, curve

TEST_TASKS = REPO / "tests" / "lm_eval_tasks"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _record(results_dir: Path) -> dict:
    (rec,) = load_records(results_dir)
    return rec


# --- retrieval: generator and scoring -------------------------------------------------------------------------


def test_retrieval_score_is_exact_match_of_the_first_number():
    assert R.score(" 71432.", "71432") and R.score(": 71432 is the key", "71432")
    assert not R.score(" 7143", "71432")  # a prefix of the answer is not the answer
    assert not R.score(" 714321", "71432")  # nor is a longer number
    assert not R.score(" 1. The key is 71432", "71432")  # the first number counts
    assert not R.score(" a magical key", "71432") and not R.score("", "71432")


@pytest.mark.parametrize("kind", R.KINDS)
def test_retrieval_generator_is_deterministic_per_seed(kind, tok):
    a = R.make_samples(tok, kind, 400, 3, 0.5, seed=7, max_new_tokens=12)
    assert a == R.make_samples(tok, kind, 400, 3, 0.5, seed=7, max_new_tokens=12)
    b = R.make_samples(tok, kind, 400, 3, 0.5, seed=8, max_new_tokens=12)
    assert [s.answer for s in a] != [s.answer for s in b]  # another seed, other numbers
    assert R.make_samples(tok, kind, 400, 2, 0.5, seed=7, max_new_tokens=12) == a[:2]  # sample i is stable
    for s in a:
        n = len(tok(s.prompt, add_special_tokens=False)["input_ids"])
        assert n == s.n_tokens and 400 - 12 - 40 <= n <= 400 - 12  # fills the budget, never exceeds it
        assert s.prompt.count(s.answer) == (2 if kind == "passkey" else 1)  # passkey: "The pass key is K. ... K is ..."
        assert s.prompt.startswith("<|im_start|>system")
        assert not s.prompt.rstrip().endswith(s.answer)  # the answer is in the haystack, not in the prefix


def test_retrieval_plain_prompt_is_the_chat_prompts_text_without_the_template(tok, monkeypatch):
    """task.prompt=plain (a base model): the same instruction, haystack, question and answer prefix as plain text,
    after the BOS only where the tokenizer adds one; the budget still holds."""
    (chat,) = R.make_samples(tok, "needle", 400, 1, 0.5, seed=3, max_new_tokens=12)
    (plain,) = R.make_samples(tok, "needle", 400, 1, 0.5, seed=3, max_new_tokens=12, prompt="plain")
    assert plain.answer == chat.answer and "<|im_start|>" not in plain.prompt
    assert plain.prompt.startswith(R.INSTRUCTION["needle"])  # SmolLM2's tokenizer adds no BOS
    question = "What is the special magic number for"
    assert plain.prompt.split(question)[1] == chat.prompt.split(question)[1].replace(
        "<|im_end|>\n<|im_start|>assistant\n", "\n\n"
    )
    assert len(tok(plain.prompt, add_special_tokens=False)["input_ids"]) == plain.n_tokens <= 400 - 12
    monkeypatch.setattr(R, "bos_to_add", lambda t: 0)  # a tokenizer that adds a BOS (Gemma's)
    (with_bos,) = R.make_samples(tok, "needle", 400, 1, 0.5, seed=3, max_new_tokens=12, prompt="plain")
    assert with_bos.prompt.startswith(tok.bos_token + R.INSTRUCTION["needle"])


def test_retrieval_depth_places_the_fact(tok):
    (start,) = R.make_samples(tok, "needle", 600, 1, 0.0, seed=1, max_new_tokens=12)
    (end,) = R.make_samples(tok, "needle", 600, 1, 1.0, seed=1, max_new_tokens=12)
    pos = lambda s: s.prompt.index(s.answer) / len(s.prompt)  # noqa: E731
    assert pos(start) < 0.2 < 0.8 < pos(end)
    assert R.depths(5, None) == [0.0, 0.25, 0.5, 0.75, 1.0] and R.depths(2, 0.3) == [0.3, 0.3]


def test_retrieval_too_small_a_budget_says_how_many_tokens(tok):
    with pytest.raises(ValueError, match="prompt alone needs"):
        R.make_sample(tok, "passkey", 20, 0.5, random.Random(0))


@torch.inference_mode()
def test_greedy_from_an_exact_prefill_equals_generate(tiny_model, tok):
    """The task's decode loop (exact prefill handed to the cache, then argmax steps) is greedy generation."""
    from kvq_lab.cache import CacheConfig, QuantizedKVCache
    from kvq_lab.quant.spec import QuantSpec

    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    ref = tiny_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    cfg = CacheConfig(QuantSpec(16, 32, "token"), QuantSpec(16, 32, "token"))
    cache = QuantizedKVCache.for_model(tiny_model, cfg)
    logits = D.prefill(tiny_model, cache, ids, exact=True)
    kv_before = [(k.clone(), v.clone()) for k, v in D.exact_prefill(tiny_model, ids)[0]]
    assert R.greedy(tiny_model, cache, logits, 10, eos=set()) == ref[0, 40:].tolist()
    assert D.exact_prefill(tiny_model, ids)[1] is logits  # memoized
    for (k, v), (k0, v0) in zip(D.exact_prefill(tiny_model, ids)[0], kv_before, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)  # decoding through the cache left the memo unchanged


@torch.inference_mode()
def test_prefill_memo_keeps_hitting_when_a_sweep_outgrows_it(tiny_model, monkeypatch):
    """Three prompts visited in turn, room for two: the first two stay memoized and hit on every later pass (an
    LRU memo would evict each prompt just before its next use and never hit)."""
    monkeypatch.setattr(D, "_PREFILLS", {})
    prompts = [torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    one = D._prefill_bytes(D.exact_prefill(tiny_model, prompts[0]))
    D._PREFILLS.clear()
    monkeypatch.setattr(D, "PREFILL_MEMO_BYTES", 2 * one)
    first = [D.exact_prefill(tiny_model, p)[1] for p in prompts]
    again = [D.exact_prefill(tiny_model, p)[1] for p in prompts]
    assert [a is b for a, b in zip(first, again, strict=True)] == [True, True, False]
    torch.testing.assert_close(first[2], again[2])  # recomputed, same values


def test_retrieval_runs_end_to_end_at_16_bits(tiny_model_dir, data_dir, tmp_path):
    args = tiny_args(tiny_model_dir, tmp_path, data_dir, task="retrieval") + [
        "quant=fp16",
        "task.context_tokens=256",
        "task.samples=2",
        "task.max_new_tokens=4",
    ]
    m = run(compose(args))
    assert m["retrieval/n"] == 2 and 0 <= m["retrieval/acc"] <= 100 and m["retrieval/prompt_tokens"] <= 252
    rec = _record(tmp_path)
    assert rec["inputs"]["data"]["source"] == "generated" and rec["inputs"]["data"]["seed"] == 0
    samples = json.loads((Path(rec["_path"]) / "samples.json").read_text())
    assert [s["depth"] for s in samples] == [0.0, 1.0] and all(len(s["target"]) == 7 for s in samples)
    m2 = run(compose(args + ["task.prompt_forward=cache", "limit=1"]))  # prefill through the cache: same 16-bit answers
    assert m2["retrieval/n"] == 1


@pytest.mark.slow  # the real SmolLM2 (~20 s): the prompt format is one the 16-bit model solves at short lengths
def test_smollm2_at_16_bits_finds_the_needle_at_512_tokens(data_dir, tmp_path):
    args = ["task=retrieval", "task.context_tokens=512", "task.samples=3", "quant=fp16", "logger=none"]
    m = run(compose([*args, f"results_dir={tmp_path}", f"data_dir={data_dir}", "resume_dirty=true"]))
    assert m["retrieval/acc"] == 100 and m["retrieval/n"] == 3


@pytest.mark.parametrize(
    "override, match",
    [
        ("task.kind=haystack", "task.kind='haystack'"),
        ("task.depth=1.5", "task.depth=1.5"),
        ("task.context_tokens=8192", "task.context_tokens = 8192 tokens, past model=.*.s 4096 positions"),
        ("task.context_tokens=100", r"task.context_tokens=100 must be an integer >= 140"),
        ("limit=20", "limit=20 but task.samples=10"),
        ("task.prompt=html", "task.prompt='html'; choose one of: chat, plain"),
    ],
)
def test_retrieval_bad_options_fail_before_load(override, match, tiny_model_dir, data_dir, tmp_path):
    with pytest.raises(ConfigError, match=match):
        validate(compose(tiny_args(tiny_model_dir, tmp_path, data_dir, task="retrieval") + [override]))


# --- fidelity -------------------------------------------------------------------------------------------------


def test_fidelity_compare_on_hand_made_distributions():
    p = torch.tensor([[0.7, 0.3], [0.5, 0.5]]).log()
    q = torch.tensor([[0.2, 0.8], [0.9, 0.1]]).log()
    kl, top1 = compare(p, q)
    expect = [0.7 * math.log(0.7 / 0.2) + 0.3 * math.log(0.3 / 0.8), 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(5)]
    assert torch.allclose(kl, torch.tensor(expect)) and top1.tolist() == [False, True]
    kl0, same = compare(p, p.clone())
    assert kl0.tolist() == [0.0, 0.0] and same.all()
    assert curve(torch.arange(8.0), bins=4) == ([0.5, 2.5, 4.5, 6.5], [0.5, 2.5, 4.5, 6.5])
    assert curve(torch.arange(3.0), bins=16) == ([0.0, 1.0, 2.0], [0.0, 1.0, 2.0])  # fewer positions than bins


def _fidelity_args(model_dir, results_dir, data_dir):
    return tiny_args(model_dir, results_dir, data_dir, task="fidelity") + [
        "task.context_tokens=32",
        "task.eval_tokens=16",
        "task.windows=2",
    ]


def test_fidelity_at_16_bits_is_exact_and_2_bits_is_not(tiny_model_dir, data_dir, tmp_path):
    m = run(compose(_fidelity_args(tiny_model_dir, tmp_path / "a", data_dir) + ["quant=fp16"]))
    assert m["fidelity/kl_mean"] == 0 and m["fidelity/kl_p99"] == 0 and m["fidelity/top1_agree"] == 1
    assert m["fidelity/ppl"] == m["fidelity/ref_ppl"] and m["fidelity/n_tokens"] == 32
    rec = _record(tmp_path / "a")
    assert (Path(rec["_path"]) / "fidelity_curve.png").is_file()
    assert len(rec["artifacts"]["fidelity_by_position"]["kl_mean"]) == 16
    q = run(compose(_fidelity_args(tiny_model_dir, tmp_path / "b", data_dir) + ["quant=2bit_KT_VT"]))
    assert q["fidelity/kl_mean"] > 1e-3 and q["fidelity/top1_agree"] < 1
    assert q["fidelity/ref_ppl"] == m["fidelity/ref_ppl"]  # the same reference


# --- any text for ppl and fidelity ----------------------------------------------------------------------------


def _text(n_words: int) -> str:
    rng = random.Random(0)
    words = "the river crossed a quiet village where old friends met to talk about distant hills".split()
    return " ".join(rng.choice(words) for _ in range(n_words)) + "\n"


@pytest.mark.parametrize("task", ["ppl", "fidelity"])
def test_a_text_file_is_a_source(task, tiny_model_dir, data_dir, tmp_path):
    f = tmp_path / "text.txt"
    f.write_text(_text(400), encoding="utf-8")
    args = tiny_args(tiny_model_dir, tmp_path / "res", data_dir, task=task)
    args += ["task.context_tokens=32", "task.eval_tokens=16", "task.windows=2", "task.source=file", f"task.path={f}"]
    m = run(compose(args))
    assert m[f"{task}/n_tokens"] == 32
    data = _record(tmp_path / "res")["inputs"]["data"]
    assert data["source"] == "file" and data["path"] == str(f) and len(data["sha256"]) == 64


def test_gsm8k_is_a_long_text_source(tiny_model_dir, data_dir, tmp_path):
    """task.source=gsm8k: the split's questions and answers in file order, its file hashed in the record; a bad split
    or a data folder without the file fails before load."""
    from kvq_lab.tasks.text import gsm8k_text

    text = gsm8k_text(data_dir, "test")
    first = json.loads((data_dir / "gsm8k" / "test.jsonl").read_text().splitlines()[0])
    assert text.startswith(f"Question: {first['question']}\nAnswer: {first['answer']}\n\nQuestion: ")
    assert text.count("Question: ") == 1319 and gsm8k_text(data_dir, "train", 2).count("Question: ") == 2
    args = tiny_args(tiny_model_dir, tmp_path / "res", data_dir, task="ppl")
    args += ["task.context_tokens=32", "task.eval_tokens=16", "task.windows=2", "task.source=gsm8k"]
    assert run(compose(args))["ppl/n_tokens"] == 32
    data = _record(tmp_path / "res")["inputs"]["data"]
    assert data["source"] == "local" and list(data["files"]) == ["gsm8k/test.jsonl"]
    with pytest.raises(ConfigError, match=r"^task.source=gsm8k reads task.split='dev'; choose one of: test, train"):
        validate(compose([*args, "task.split=dev"]))
    empty = tmp_path / "data"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"^data file gsm8k/test.jsonl under data_dir=.* not found"):
        validate(compose(tiny_args(tiny_model_dir, tmp_path, empty, task="ppl") + ["task.source=gsm8k"]))


def test_bad_text_sources_fail_before_load(tiny_model_dir, data_dir, tmp_path):
    base = tiny_args(tiny_model_dir, tmp_path, data_dir) + ["task.source=file"]
    with pytest.raises(ConfigError, match="does not exist"):
        validate(compose([*base, f"task.path={tmp_path / 'missing.txt'}"]))
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 ".encode("latin-1") * 200)
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 3\)"):
        validate(compose([*base, f"task.path={latin}"]))
    short = tmp_path / "short.txt"
    short.write_text(_text(20), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"has \d+ tokens; 2 windows of 32\+16 need 96"):
        validate(compose([*base, f"task.path={short}"]))
    with pytest.raises(ConfigError, match="needs task.path"):
        validate(compose(base))
    with pytest.raises(ConfigError, match="task.source='web'"):
        validate(compose(tiny_args(tiny_model_dir, tmp_path, data_dir) + ["task.source=web"]))


def test_a_hub_dataset_is_a_source(tiny_model_dir, data_dir, tmp_path, monkeypatch):
    """task.source=hf goes through datasets.load_dataset (replaced here: no network in tests)."""
    import datasets

    from kvq_lab.tasks import text

    calls = []

    def fake(dataset, config, split):
        calls.append((dataset, config, split))
        return datasets.Dataset.from_dict({"text": [_text(100) for _ in range(4)], "id": [0, 1, 2, 3]})

    monkeypatch.setattr(text, "load_hub_rows", fake)
    monkeypatch.setattr(text, "_HUB", {})
    args = tiny_args(tiny_model_dir, tmp_path, data_dir) + [
        "task.source=hf",
        "task.dataset=wikitext",
        "task.dataset_config=wikitext-2-raw-v1",
    ]
    m = run(compose(args))
    assert m["ppl/n_tokens"] == 32 and calls[0] == ("wikitext", "wikitext-2-raw-v1", "test")
    assert _record(tmp_path)["inputs"]["data"]["datasets"] == ["wikitext/wikitext-2-raw-v1:test"]
    with pytest.raises(ConfigError, match="task.text_field='body' is not a column .* its columns: text, id"):
        validate(compose([*args, "task.text_field=body"]))


# --- behaviour drift ------------------------------------------------------------------------------------------


def test_refusal_rule_and_similarity_scores():
    assert B.is_refusal("I'm sorry, but I can't help with that.") and B.is_refusal("I CANNOT do this")
    assert B.is_refusal("I\u2019m unable to assist.")  # curly apostrophe
    assert not B.is_refusal("Sure, here is a script that scans ports:") and not B.is_refusal("As an example, ...")
    assert B.rouge_l("the cat sat on the mat", "the cat sat on the mat") == 1.0
    assert B.rouge_l("a b c", "x y z") == 0.0 and B.rouge_l("", "") == 1.0 and B.rouge_l("", "a") == 0.0
    assert math.isclose(B.rouge_l("the cat on the mat", "the cat sat on the mat"), 10 / 11)  # LCS 5; P 1, R 5/6
    assert B.common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2 and B.common_prefix([1, 2], [1, 2, 3]) == 2


def test_drift_counts_flips_and_agreement():
    class Tok:  # ids are characters
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    enc = lambda s: list(map(ord, s))  # noqa: E731
    ref = [enc("Sure, here it is."), enc("I cannot help."), enc("Paris.")]
    ans = [enc("I cannot help."), enc("I cannot help."), enc("Paris is it.")]
    m, rows = B.drift(Tok(), ans, ref)
    assert m["refusal_flips"] == 1 and math.isclose(m["flip_rate"], 100 / 3)
    assert math.isclose(m["refusal_rate"], 200 / 3) and math.isclose(m["ref_refusal_rate"], 100 / 3)
    assert math.isclose(m["identical"], 100 / 3) and rows[2]["prefix_tokens"] == 5 and rows[0]["prefix_tokens"] == 0


def test_behavior_runs_end_to_end(tiny_model_dir, data_dir, tmp_path, caplog):
    args = tiny_args(tiny_model_dir, tmp_path / "a", data_dir, task="behavior") + [
        "task.harmful=2",
        "task.neutral=2",
        "task.max_new_tokens=6",
        "batch_size=2",
    ]
    with caplog.at_level(logging.WARNING, logger="kvq_lab"):
        m = run(compose([*args, "quant=fp16"]))
    for s in B.SETS:
        assert m[f"behavior/{s}/identical"] == 100 and m[f"behavior/{s}/rouge_l"] == 1
        assert m[f"behavior/{s}/refusal_flips"] == 0 and m[f"behavior/{s}/n"] == 2
    assert m["behavior/harmful/ref_refusals"] == 0 and "refuses 0 of 2 harmful prompts" in caplog.text
    rec = _record(tmp_path / "a")
    assert "refuses 0 of 2" in rec["artifacts"]["notice"]
    args[3] = f"results_dir={tmp_path / 'b'}"
    q = run(compose([*args, "quant=2bit_KT_VT"]))
    assert min(q["behavior/harmful/identical"], q["behavior/neutral/identical"]) < 100


def test_behavior_bad_options_fail_before_load(tiny_model_dir, data_dir, tmp_path):
    base = tiny_args(tiny_model_dir, tmp_path, data_dir, task="behavior")
    with pytest.raises(ConfigError, match="task.harmful=600 but advbench/harmful_behaviors.csv has 520 rows"):
        validate(compose([*base, "task.harmful=600"]))
    with pytest.raises(ConfigError, match="task.max_new_tokens=0"):
        validate(compose([*base, "task.max_new_tokens=0"]))


# --- any lm-eval task; the `kvq` model of lm-eval's CLI ---------------------------------------------------------


def _lm_eval_args(model_dir, results_dir, data_dir, tasks: str):
    return tiny_args(model_dir, results_dir, data_dir, task="lm_eval") + [
        f"task.tasks={tasks}",
        f"task.include_path={TEST_TASKS}",
    ]


def test_lm_eval_task_generation_gets_the_cache_and_loglikelihood_warns(tiny_model_dir, data_dir, tmp_path, caplog):
    m = run(compose(_lm_eval_args(tiny_model_dir, tmp_path / "g", data_dir, "kvq_tiny_gen")))
    assert m["kvq_tiny_gen/n"] == 3 and m["lm_eval/generate_calls"] >= 1 and m["lm_eval/loglikelihood_requests"] == 0
    assert "exact_match" in "".join(m)
    with caplog.at_level(logging.WARNING, logger="kvq_lab"):
        m = run(compose(_lm_eval_args(tiny_model_dir, tmp_path / "l", data_dir, "kvq_tiny_mc")))
    assert m["kvq_tiny_mc/n"] == 3 and 0 <= m["kvq_tiny_mc/acc"] <= 1 and m["lm_eval/generate_calls"] == 0
    assert m["lm_eval/loglikelihood_requests"] == 9  # 3 docs x 3 choices
    assert caplog.text.count("never read a generation cache") == 1 and "kvq_tiny_mc" in caplog.text


def test_lm_eval_task_names_are_checked_before_load(tiny_model_dir, data_dir, tmp_path):
    with pytest.raises(ConfigError, match="'kvq_tiny_mx' is not an lm-eval task.*did you mean kvq_tiny_mc"):
        validate(compose(_lm_eval_args(tiny_model_dir, tmp_path, data_dir, "kvq_tiny_mx")))
    with pytest.raises(ConfigError, match="task.tasks=None: name an lm-eval task"):
        validate(compose(tiny_args(tiny_model_dir, tmp_path, data_dir, task="lm_eval") + ["task.tasks=null"]))
    assert validate(compose(tiny_args(tiny_model_dir, tmp_path, data_dir, task="lm_eval"))).task == "lm_eval"


def test_kvq_is_an_lm_eval_model_built_from_model_args(tiny_model_dir):
    from lm_eval.api.registry import get_model

    import kvq_lab.lmeval.cli as kl
    from kvq_lab.cache import QuantizedKVCache
    from kvq_lab.cache.routing.backends import resolve

    assert get_model("kvq") is kl.KvqLM
    lm = get_model("kvq").create_from_arg_string(
        f"pretrained={tiny_model_dir},key_axis=channel,value_axis=token,bits=2,mode=packed,exact_window=32",
        {"batch_size": 2, "max_batch_size": None, "device": None},
    )
    asked = kl.cache_from_args(
        {"key_axis": "channel", "value_axis": "token", "bits": 2, "mode": "packed", "exact_window": 32}
    )
    assert asked.backend == "auto" and lm.cache_config == replace(asked, backend=resolve(asked))  # the one that runs
    assert lm.cache_config.key.axis == "channel" and lm.cache_config.value.bits == 2 and lm.batch_size_per_gpu == 2
    cache = lm.make_cache()
    assert isinstance(cache, QuantizedKVCache) and cache.cfg == lm.cache_config
    default = kl.cache_from_args({})  # run.py's defaults for the knobs not given
    assert (default.key.axis, default.value.axis, default.key.bits) == ("channel", "token", 2)
    assert default.mode == "simulated"
    with pytest.raises(ConfigError, match="value_axis='head' is not allowed; choose one of: token, channel"):
        get_model("kvq").create_from_arg_string(f"pretrained={tiny_model_dir},value_axis=head")
    with pytest.raises(ConfigError, match="model arg 'windw' is not a kvq setting"):
        get_model("kvq").create_from_arg_string(f"pretrained={tiny_model_dir},windw=3")
    with pytest.raises(ConfigError, match="does not exist"):
        get_model("kvq").create_from_arg_string("pretrained=./no/such/model")


def _with_plugin(site: Path, code: str) -> list[str]:
    """A Python command that sees this environment's packages but runs none of its .pth files (-S: whether or not
    setup.sh installed the plugin here), then starts as if `site` were a site-packages folder (its .pth files run),
    then runs `code`. The working directory (REPO) is on sys.path, for kvq_lab."""
    from kvq_lab.lmeval.plugin import site_dir

    boot = f"import site, sys; sys.path.append({str(site_dir())!r}); site.addsitedir({str(site)!r})"
    return [sys.executable, "-S", "-c", f"{boot}; {code}"]


def test_lm_eval_plugin_registers_kvq_lazily(tmp_path):
    """The .pth line and hook module that `python -m kvq_lab.lmeval.plugin register` installs: Python starts
    without importing kvq_lab (which would pin the package to the installed checkout for scripts run from another
    clone), lm-eval or torch, and lm-eval's registry then resolves `kvq` to KvqLM."""
    import subprocess

    from kvq_lab.lmeval import plugin as lm_eval_plugin

    pth = lm_eval_plugin.register(tmp_path)
    assert pth.read_text() == lm_eval_plugin.PTH_LINE
    code = (
        "heavy = [m for m in ('kvq_lab', 'lm_eval', 'torch') if m in sys.modules]; "
        "from lm_eval.api.registry import get_model; print(heavy, get_model('kvq').__module__)"
    )
    out = subprocess.run(_with_plugin(tmp_path, code), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "kvq_lab.lmeval.cli"]
    lm_eval_plugin.unregister(tmp_path)
    assert not any(tmp_path.iterdir())
    out = subprocess.run(_with_plugin(tmp_path, code), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "Attempted to load model 'kvq'" in out.stderr  # and without it, it is unknown


@pytest.mark.slow  # lm-eval's CLI in a subprocess indexes every task YAML (~30 s)
@pytest.mark.parametrize("command", ["kvq-lm-eval"])
def test_lm_eval_cli_runs_the_kvq_model(tiny_model_dir, tmp_path, command):
    """`kvq-lm-eval run ...` (lm-eval's CLI with kvq_lab.lmeval.cli imported first) runs the kvq model end to end.
    lm-eval's own `lm_eval run ...` (command="lm_eval": in a Python whose site-packages holds the plugin's .pth file,
    as scripts/setup.sh installs it) is the same CLI once `kvq` resolves, which test_lm_eval_plugin_registers_kvq_lazily
    checks; its ~30 s run is left out of the suite (add it to the parameters to run it)."""
    import subprocess

    from kvq_lab.lmeval import plugin as lm_eval_plugin

    args = ["run", "--model", "kvq", "--model_args",
            f"pretrained={tiny_model_dir},key_axis=channel,value_axis=token,bits=2", "--tasks", "kvq_tiny_gen",
            "--include_path", str(TEST_TASKS), "--output_path", str(tmp_path / "out")]  # fmt: skip
    if command == "kvq-lm-eval":
        cmd = [sys.executable, "-m", "kvq_lab.lmeval.cli", *args]
    else:
        lm_eval_plugin.register(tmp_path)
        cmd = _with_plugin(tmp_path, f"sys.argv = ['lm_eval', *{args!r}]; from lm_eval.__main__ import cli_evaluate; "
                           "cli_evaluate()")  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "kvq_tiny_gen" in out.stdout and "exact_match" in out.stdout
    (res,) = (tmp_path / "out").rglob("results_*.json")
    assert json.loads(res.read_text())["config"]["kvq_cache"] == "K2b-C32_V2b-T32_sim"
