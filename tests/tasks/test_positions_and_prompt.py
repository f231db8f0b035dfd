"""Knobs that do what they say, on every task (`kvq_lab.plugins.TASKS`, driven by the registry):

- a sequence longer than the model's positions is refused before the load, in one line, by one check
  (`Task.check_positions`, fed by each task's `positions`): before, task=ppl with 9000 context tokens and
  task=fidelity's chunks of 16384 tokens ran on SmolLM2's 8192 positions and recorded `ok`;
- `policy=fakequant` (KIVI Table 1) quantizes the prompt on every task, the record says so (`prefill`), and a task
  that runs no prompt through the cache (task=probe) refuses it: before, task.prompt_forward=exact handed the cache
  exact K/V and the record said fakequant (SmolLM2 ppl 20.68, the exact-prefill number, where the quantized prompt gives
  22.73)."""

from __future__ import annotations

import pytest
import torch
import yaml
from helpers_models import REPO, compose, tiny_args

from kvq_lab.cache import QuantizedKVCache
from kvq_lab.cache.knobs import cache_config
from kvq_lab.common.errors import ConfigError
from kvq_lab.plugins import TASKS
from kvq_lab.records.record import load_records
from kvq_lab.run.config import validate
from kvq_lab.run.runner import run
from kvq_lab.tasks import decode as D

SMOLLM2_POSITIONS = 8192


# -- positions -------------------------------------------------------------------------------------------------------
def _defaults(name: str, **options) -> dict:
    """The task's options as conf/task/<name>.yaml sets them ({"name": name} for a task without one), `options`
    over them."""
    path = REPO / "conf" / "task" / f"{name}.yaml"
    return {**(yaml.safe_load(path.read_text()) if path.is_file() else {"name": name}), **options}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_a_task_with_bounded_sequences_refuses_one_past_the_models_positions(name):
    """Each task says how long its sequences get from its options; one position short of that is refused in one
    line naming the settings, exactly enough passes."""
    conf = _defaults(name)
    need = TASKS[name].positions(conf)
    if need is None:
        return  # lm-eval's tasks: their prompts are cut to lm-eval's max_length
    n, settings = need
    TASKS[name].check_positions(conf, n, "model=m")
    with pytest.raises(ConfigError, match=f"^task={name}: .* = {n} tokens, past model=m's {n - 1} positions") as e:
        TASKS[name].check_positions(conf, n - 1, "model=m")
    assert settings in str(e.value) and "\n" not in str(e.value)


SMOLLM2_TOO_LONG = [
    (["task=ppl", "task.source=gsm8k", "task.context_tokens=9000", "task.windows=1"], "9000 \\+ 512 = 9512"),
    (["task=fidelity", "task.source=gsm8k", "task.protocol=chunks", "task.n_ctx=16384"], "task.n_ctx = 16384"),
    # on the default text (CoQA's stories), shorter than either: the positions are refused before the text is read
    (["task=ppl", "task.context_tokens=9000", "task.windows=1"], "9000 \\+ 512 = 9512"),
    (["task=fidelity", "task.protocol=chunks", "task.n_ctx=16384"], "task.n_ctx = 16384"),
    (["task=fidelity", "task.source=gsm8k", "task.context_tokens=8000", "task.windows=1"], "8000 \\+ 512 = 8512"),
    (["task=retrieval", "task.context_tokens=9000"], "task.context_tokens = 9000"),
    (["task=probe", "task.max_tokens=16384"], "task.max_tokens = 16384"),
    (["task=behavior", "task.max_new_tokens=9000"], "task.max_new_tokens \\(besides the prompt\\) = 9000"),
]


@pytest.mark.parametrize("overrides,shown", SMOLLM2_TOO_LONG, ids=[" ".join(o) for o, _ in SMOLLM2_TOO_LONG])
def test_smollm2_refuses_sequences_past_its_8192_positions_before_load(overrides, shown, data_dir, tmp_path):
    cfg = compose([*overrides, "logger=none", f"data_dir={data_dir}", f"results_dir={tmp_path}"])
    past = f"{shown} tokens, past model=smollm2-135m's {SMOLLM2_POSITIONS} positions"
    with pytest.raises(ConfigError, match=past) as e:
        validate(cfg)
    assert "\n" not in str(e.value)
    assert not tmp_path.joinpath("runs").exists()


def test_a_tiny_models_own_positions_bound_its_runs(tiny_model_dir, data_dir, tmp_path):
    """The positions come from the model's files (the tiny Llama's config.json: 4096), not from SmolLM2's."""
    args = tiny_args(tiny_model_dir, tmp_path, data_dir)
    validate(compose([*args, "task.context_tokens=4000", "task.eval_tokens=96", "task.windows=1"]))
    with pytest.raises(ConfigError, match=r"4000 \+ 97 = 4097 tokens, past model=.*'s 4096 positions"):
        validate(compose([*args, "task.context_tokens=4000", "task.eval_tokens=97", "task.windows=1"]))


# -- policy=fakequant: the prompt quantized on every task ------------------------------------------------------------
def _prompt(name: str, options: dict, knobs: dict) -> str | None:
    return TASKS[name].prompt_prefill(_defaults(name, **options), cache_config({"bits": 2, **knobs}))


@pytest.mark.parametrize("name", sorted(n for n in TASKS if n != "probe"))
def test_fakequant_quantizes_the_prompt_on_every_task_that_runs_one(name):
    assert _prompt(name, {}, {"policy": "fakequant"}) == "quantized"
    assert _prompt(name, {}, {"prefill": "quantized"}) == "quantized"  # what prefill=quantized already meant


@pytest.mark.parametrize(
    "name,options,knobs,expected",
    [
        (
            "ppl",
            {},
            {},
            "exact",
        ),  # task.prompt_forward=exact hands a Table-1 (simulated) cache the exact K/V, as before
        ("ppl", {"prompt_forward": "cache"}, {}, "quantized"),
        ("ppl", {"protocol": "chunks"}, {}, "quantized"),  # llama.cpp's chunks: each a forward through the cache
        ("fidelity", {}, {"mode": "packed"}, "exact"),
        (
            "fidelity",
            {"prompt_forward": "cache"},
            {"mode": "packed"},
            "exact",
        ),  # the packed cache's prefill reads exact
        ("retrieval", {}, {}, "exact"),
        ("coqa_turns", {}, {}, "quantized"),
        ("coqa_turns", {}, {"mode": "packed"}, "exact"),
        ("probe", {}, {}, None),
    ],
)
def test_the_prompts_prefill_is_what_the_task_and_the_cache_make_it(name, options, knobs, expected):
    assert _prompt(name, options, knobs) == expected


def test_fakequant_is_refused_where_no_prompt_goes_through_the_cache(data_dir, tmp_path):
    cfg = compose(["task=probe", "policy=fakequant", "logger=none", f"data_dir={data_dir}", f"results_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="^policy=fakequant quantizes the prompt .*task=probe runs no prompt") as e:
        validate(cfg)
    assert "\n" not in str(e.value)


def test_a_fakequant_prefill_is_the_prompts_forward_through_the_cache(tiny):
    """decode.prefill with task.prompt_forward=exact: under fakequant the prompt's forward reads the quantized cache
    (the same logits and K/V as task.prompt_forward=cache), under kivi's simulated mode the exact K/V are handed
    over."""
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(1))

    def prefill(knobs: dict, exact: bool):
        cache = QuantizedKVCache.for_model(tiny, cache_config({"bits": 2, **knobs}))
        with torch.no_grad():
            return D.prefill(tiny, cache, ids, exact=exact), cache

    (fq, c1), (through, c2) = prefill({"policy": "fakequant"}, True), prefill({}, False)
    exact, _ = prefill({}, True)
    assert torch.equal(fq, through) and not torch.equal(fq, exact)
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(c1.layers, c2.layers, strict=True))


@pytest.mark.slow  # three runs on the tiny model: ~10-30 s
def test_a_fakequant_run_records_the_quantized_prompt_and_its_number(tiny_model_dir, data_dir, tmp_path):
    """task=ppl: policy=fakequant gives prefill=quantized's number, not the exact-prefill one, and says so."""
    args = tiny_args(tiny_model_dir, tmp_path, data_dir)
    fakequant = run(compose([*args, "policy=fakequant", "bits=2"]))
    quantized = run(compose([*args, "prefill=quantized", "bits=2"]))
    exact = run(compose([*args, "bits=2"]))
    assert fakequant["ppl/ppl"] == quantized["ppl/ppl"] != exact["ppl/ppl"]
    by_cache = {r["cache"]: r["prefill"] for r in load_records(tmp_path)}
    assert by_cache == {
        "K2b-C32_V2b-T32_sim_fakequant": "quantized",
        "K2b-C32_V2b-T32_sim_Pquant": "quantized",
        "K2b-C32_V2b-T32_sim": "exact",
    }


BAD_CHUNK_OPTIONS = [("task.n_ctx=abc", "task.n_ctx='abc' must be an integer >= "),
                     ("task.chunks=0", "task.chunks=0 must be an integer >= 1, or null")]  # fmt: skip


@pytest.mark.parametrize("task", ["ppl", "fidelity"])
@pytest.mark.parametrize("option,line", BAD_CHUNK_OPTIONS)
def test_chunk_options_are_checked_under_either_protocol(task, option, line, data_dir, tmp_path):
    """protocol=decode does not read n_ctx or chunks; a bad value is refused all the same, before any load."""
    for protocol in ("decode", "chunks"):
        cfg = compose([f"task={task}", option, f"task.protocol={protocol}", "logger=none", f"data_dir={data_dir}",
                       f"results_dir={tmp_path}"])  # fmt: skip
        with pytest.raises(ConfigError) as e:
            validate(cfg)
        assert str(e.value).startswith(line) and "\n" not in str(e.value)
