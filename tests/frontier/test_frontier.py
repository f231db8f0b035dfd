"""The frontier search (kvq_lab/frontier/): enumeration counts bits before anything runs, keeps what fits a budget and
drops duplicates; the Pareto set, winners and Spearman on fixed inputs; the engine table's rows compose and name
tests that exist; the cost plan and the max_minutes cut; bad settings in one line before a load; a stage rerun after
a partial one runs only what is missing (the tiny random model)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from helpers_models import compose

from kvq_lab.common.errors import ConfigError
from kvq_lab.frontier import candidates as cands
from kvq_lab.frontier.costs import Rate, StagePlan, cut, plan_text
from kvq_lab.frontier.driver import Frontier, plain
from kvq_lab.models.files import ModelFacts
from kvq_lab.preflight import cache_config
from kvq_lab.preflight import frontier as settings
from kvq_lab.report import engines
from kvq_lab.report import frontier as select
from kvq_lab.report.rows import block_paired

REPO = Path(__file__).resolve().parents[2]
FACTS = ModelFacts(layers=2, heads=4, kv_heads=2, head_dim=64, hidden=128, context=2048)  # tiny_llama's shape
SOURCES = ["preset", "grid", "policy", "engine"]


@pytest.fixture(scope="module")
def base():
    from conftest import DATA_DIR  # the data_dir fixture's folder (module scope: enumerate once)

    c = plain(compose(["experiment=frontier", f"data_dir={DATA_DIR}"]))
    c["frontier"] = {}
    return c


@pytest.fixture(scope="module")
def enumerated(base):
    return cands.enumerate_candidates(base, FACTS, [3.0, 4.5], SOURCES, 512)


def test_bits_are_counted_before_any_run_as_a_run_counts_them(base, enumerated, tiny_model):
    """Enumeration reads the shape only; its count is what the loaded model's cache reports."""
    from kvq_lab.cache import QuantizedKVCache

    found, _ = enumerated
    by = {c.name: c for c in found}
    assert by["2bit_KC_VT"].bits == pytest.approx(3.0)
    assert by["llamacpp_q4_0"].bits == pytest.approx(4.5)
    model = tiny_model
    for name in ("2bit_KC_VT", "turboquant_mse_3b", "gear_2b", "mikv_int2_KC_VT", "nvfp4"):
        if name not in by:
            continue
        cache = cache_config(cands.apply(base, by[name].overrides))
        got = QuantizedKVCache.stored_bits(cache, 512, model)["cache/bits_total"]
        extra = 8 / 512 if cache.key_outliers else 0.0  # fitted key thresholds, counted before the fit
        assert by[name].bits == pytest.approx(got + extra, abs=1e-6), name


def test_only_candidates_within_a_budget_are_kept_and_the_rest_are_named(enumerated):
    found, notes = enumerated
    assert found and all(c.budgets and c.bits <= max(c.budgets) + 1e-9 for c in found)
    assert all(b >= c.bits - 1e-9 for c in found for b in c.budgets)
    assert any("8bit_KC_VT" in n and "over every budget" in n for n in notes)
    assert "fp16" not in {c.name for c in found}


def test_the_same_cache_twice_is_one_candidate(enumerated):
    found, _ = enumerated
    by = {c.name: c for c in found}
    assert "int_K2V2_KC_VT_G32" in by["2bit_KC_VT"].same_as  # the preset and its grid point: one cache
    assert "int_K2V2_KC_VT_G32" not in by
    labels = [c.label + str(c.overrides.get("policy")) for c in found]
    assert len(labels) == len(set(labels))


def test_the_cap_spans_the_sources(enumerated):
    found, _ = enumerated
    picked = cands.cap(found, 4, SOURCES)
    assert [c.source for c in picked][:3] == SOURCES[:3]  # the engine rows here are presets already: one cache


def test_searched_candidates_are_held_to_their_budget(base):
    found, _ = cands.enumerate_candidates(base, FACTS, [4.5], ["search"], 512)
    (c,) = found
    assert not c.exact and c.bits == 4.5
    assert c.overrides["precision"]["budget"] > 4.5  # the packed count adds the keys' fill buffer


def test_pareto_frontier_and_within_noise_retention():
    pts = [select.Point("a", 3.0, 0.30), select.Point("b", 3.5, 0.31), select.Point("c", 4.0, 0.10),
           select.Point("d", 4.5, 0.20), select.Point("e", 5.0, 0.05)]  # fmt: skip
    front, kept = select.pareto(pts)
    assert front == ["a", "c", "e"] and kept == []
    near = {("a", "b")}  # b is within noise of a; d is beaten by c beyond it
    front, kept = select.pareto(pts, lambda d, c: (d.name, c.name) not in near)
    assert front == ["a", "c", "e"] and kept == ["b"]
    assert select.winners(pts, [3.0, 4.5]) == {3.0: ("a", None), 4.5: ("c", "d")}


def test_paired_difference_and_best_per_band():
    m, se, n = block_paired([0.0] * 32, [1.0 + (i % 2) * 0.1 for i in range(32)])
    assert n == 32 and m == pytest.approx(1.05) and se == pytest.approx(0.0)
    errors, bits = {"a": 0.3, "b": 0.1, "c": 0.2, "d": math.nan}, {"a": 3, "b": 4, "c": 3, "d": 3}
    assert select.best_per_band(errors, bits, [3, 4], 2) == {3: ["c", "a"], 4: ["b", "c"]}


def test_the_report_names_each_engines_best_candidate_per_budget():
    """A user asks: at my budget, in my engine, which cache? Per budget, the ranked candidate of least KL among those
    each engine runs, with the setting that runs it (fixed records: b runs in llama.cpp and kvq_lab, c in kvq_lab only,
    d is over the 3-bit budget)."""
    from kvq_lab.report.studies import frontier as study

    def cand(name, bits, budgets, engines):
        return {"name": name, "source": "grid", "bits": bits, "exact": True, "budgets": budgets, "engines": engines}

    def rec(kl):
        pos = [kl + 0.001 * (i % 3) for i in range(32)]
        return {"metrics": {"fidelity/kl_mean": kl, "fidelity/top1_agree": 0.9},
                "artifacts": {"fidelity_by_position": {"kl_mean": pos, "top1_agree": [1.0] * 32}}}  # fmt: skip

    run, flags = "`python run.py mode=packed`", "`-ctk q4_0 -ctv q4_0 -fa on`"
    kvq, lcpp = f"kvq_lab packed cache: {run}", f"llama.cpp: {flags}"
    cs = [cand("b", 3.0, [3.0, 4.5], [lcpp, kvq]), cand("c", 2.5, [3.0, 4.5], [kvq]), cand("d", 4.5, [4.5], [kvq])]
    plan = {"model": "m", "settings": {"budgets": [3.0, 4.5]}, "candidates": cs}
    rank = {"b": rec(0.3), "c": rec(0.2), "d": rec(0.1)}
    a = study.analyse(plan, {}, rank, {})
    assert a["engines"] == {
        3.0: {"kvq_lab packed cache": ("c", run), "llama.cpp": ("b", flags)},
        4.5: {"kvq_lab packed cache": ("d", run), "llama.cpp": ("b", flags)},
    }


def test_each_recommended_llama_cpp_setting_is_checked_against_llama_cpp_with_its_floor():
    """The report's llama.cpp rows (b at both budgets) and the q8_0 cache of the same rotation (e, the kernel floor)
    are what experiments/frontier/llama_cpp_check.py runs; the table puts llama.cpp's KLD beside kvq_lab's, raw and
    with the floor (llama.cpp's q8_0 less kvq_lab's), against the parity study's band (fixed records and logs)."""
    from kvq_lab.report.studies import frontier as study

    def cand(name, bits, budgets, engines):
        return {"name": name, "source": "preset", "bits": bits, "exact": True, "budgets": budgets,
                "engines": engines, "overrides": {"format": name}}  # fmt: skip

    def rec(kl, n_ctx=None):
        pos = [kl + 0.001 * (i % 3) for i in range(32)]
        return {"metrics": {"fidelity/kl_mean": kl, "fidelity/top1_agree": 0.9}, "config": {"task": {"n_ctx": n_ctx}},
                "artifacts": {"fidelity_by_position": {"kl_mean": pos, "top1_agree": [1.0] * 32}}}  # fmt: skip

    q4, q8 = "llama.cpp: `-ctk q4_0 -ctv q4_0 -fa on` (same arithmetic; t)", "llama.cpp: `-ctk q8_0 -ctv q8_0 -fa on`"
    cs = [cand("b", 4.5, [4.5, 8.5], [q4]), cand("c", 2.5, [3.0, 4.5, 8.5], []), cand("e", 8.5, [8.5], [q8])]
    plan = {"model": "m", "settings": {"budgets": [3.0, 4.5, 8.5]}, "candidates": cs}
    stages = {"screen": {}, "rank": {"b": rec(0.3), "c": rec(0.2)}, "confirm": {}}  # e: not ranked, the floor only
    got = study.llama_cpp_settings(plan, stages)
    assert [(s.candidate, s.budgets, s.ctk, s.rotation, s.log(512)) for s in got] == [
        ("b", (4.5, 8.5), "q4_0", True, "512_q4_0_q4_0_rot.log"), ("e", (), "q8_0", True, "512_q8_0_q8_0_rot.log")
    ]  # fmt: skip
    assert got[0].overrides == {"format": "b"}
    logs = {"512_q4_0_q4_0_rot.log": {"kl_mean": 0.038}, "512_q8_0_q8_0_rot.log": {"kl_mean": 0.0040}}
    check = {"kvq": {"b": rec(0.030, 512), "e": rec(0.0001, 512)}, "logs": logs}
    rows = [line for line in study.llama_cpp_check(plan, stages, check).splitlines() if line.startswith("| ")][1:]
    # b: raw 0.030 vs 0.038 misses the band (0.0057); with the floor 0.0039, 0.0339 is within it
    assert rows == [
        "| 4.5, 8.5 | b | `-ctk q4_0 -ctv q4_0 -fa on` | 0.0380 | 0.0300 | no | 0.0039 | 0.0339 | yes |",
        "| (floor) | e | `-ctk q8_0 -ctv q8_0 -fa on` | 0.0040 | 0.0001 | no | 0.0039 | 0.0040 | by construction |",
    ]
    not_run = study.llama_cpp_check(plan, stages, {"kvq": {"b": rec(0.03, 512)}, "logs": {}})
    assert "| 4.5, 8.5 | b | `-ctk q4_0 -ctv q4_0 -fa on` | not run |" in not_run


def test_spearman_on_fixed_inputs():
    from scipy.stats import spearmanr

    assert select.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert select.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    x, y = [1, 2, 2, 3, 5, 4], [2, 1, 3, 3, 6, 5]
    assert select.spearman(x, y) == pytest.approx(spearmanr(x, y).statistic)
    assert math.isnan(select.spearman([1, 2], [1, 2]))
    assert select.spread(list("abcdefg"), 3) == ["a", "d", "g"] and select.spread(list("ab"), "all") == ["a", "b"]


def test_every_engine_row_composes_and_names_a_test_that_exists(base):
    presets = dict(cands.presets())
    for row in engines.ROWS:
        assert row.match in (engines.SAME, engines.NEAREST), row
        assert row.match == engines.SAME or row.difference, f"{row.setting}: a nearest row states the difference"
        assert row.quant is None or row.quant in presets, row.quant
        c = cands.apply(base, {**presets.get(row.quant, {}), **row.knobs})
        cache_config(c).check_head_dim(64)
        path, name = row.test.split("::")
        assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), row.test


@pytest.mark.parametrize("architecture", ["llama", "gemma3", None])
def test_a_model_gets_the_llama_cpp_settings_of_its_architecture(base, architecture):
    """llama.cpp keeps a Llama key's channels in its own order (`llamacpp_*`, interleaved) and every other model's in
    transformers' (`ggml_*`): a model is told only the settings whose arithmetic its architecture gets (not known:
    all of them, each saying which models it is for)."""
    flags = {}
    for lines in cands.engine_settings(base, architecture).values():
        for line in lines:
            if line.startswith("llama.cpp:"):
                flags[line] = ("Llama-architecture models only" in line, "other than Llama" in line)
    named = {k: v for k, v in flags.items() if "(same arithmetic" in k}
    assert named
    if architecture is None:
        assert all(llama != other for llama, other in named.values())
        assert {llama for llama, _ in named.values()} == {True, False}
    else:
        assert not any(llama or other for llama, other in named.values())  # already filtered: no caveat
    presets = dict(cands.presets())
    rows = [row for row in engines.ROWS if row.engine == "llama.cpp" and row.runs_on(architecture)]
    keys = {
        row.setting: str(cands.apply(base, {**presets[row.quant], **row.knobs}).get("key_transform")) for row in rows
    }
    if architecture is not None:  # one cache per setting, its keys in the order llama.cpp keeps this architecture's
        assert len(keys) == len(rows) == 14
        assert all(("interleave" in k) == (architecture == "llama") for k in keys.values()), keys
        assert all(("hadamard" in k) == ("LLAMA_ATTN_ROT_DISABLE" not in s) for s, k in keys.items()), keys


@pytest.mark.parametrize("architecture", ["llama", "gemma3_text"])
def test_the_engine_source_gives_the_architectures_caches_under_names_of_their_own(base, architecture):
    """A Llama model's engine candidates are llama.cpp's interleaved caches (`llamacpp_*`), another model's the same
    blocks in transformers' order (`ggml_*`); no name stands for two caches (the engine row built from llamacpp_q4_0
    without `interleave` once took that preset's name, and the report gave one cache's KL to the other)."""
    facts = ModelFacts(**{**FACTS.__dict__, "architecture": architecture})
    got, _ = cands.enumerate_candidates(base, facts, [4.5, 8.5], ["preset", "engine"], 512)
    names = [c.name for c in got]
    assert len(names) == len(set(names))
    ids = {}
    for c in got:
        for n in [c.name, *c.same_as]:
            assert ids.setdefault(n, c) is c, f"{n} names two caches"
    engine = [c for c in got if c.source == "engine"]
    prefix = "llamacpp_" if architecture == "llama" else "ggml_"
    lcpp = [c for c in got if any(e.startswith("llama.cpp: ") for e in c.engines)]
    assert lcpp and all(n.startswith(prefix) for c in lcpp for n in [c.name, *c.same_as] if "@" not in n)
    assert all(not c.name.startswith("llamacpp_") for c in engine) or architecture == "llama"


def test_cost_plan_and_the_max_minutes_cut():
    rate = Rate(10.0)
    plan = [StagePlan("screen", 5, 2, rate), StagePlan("rank", 3, 1, Rate(40.0))]
    text = plan_text(plan, 3)
    assert "5 rows x 2 x 10.0 s (first guess) = 1.7 min" in text and "total    3.7 min" in text
    rate.add(30.0, 6)
    assert rate.measured and "5.0 s (measured)" in plan_text(plan, None)
    assert cut([("a", 5.0), ("b", 1.0), ("c", 3.0)], 4.5) == (["b", "c"], ["a"])
    assert cut([("a", 5.0)], None) == (["a"], [])


@pytest.mark.parametrize(
    "given, match",
    [
        ({"budgets": [0]}, r"frontier.budgets=0 must be a number > 0"),
        ({"budgets": [-3, 4]}, r"must be a number > 0"),
        ({"max_candidates": 0}, r"frontier.max_candidates=0 must be an integer > 0.5"),
        ({"budget": 3}, r"frontier.budget is not a frontier setting"),
        ({"sources": ["magic"]}, r"frontier.sources"),
    ],
)
def test_bad_settings_fail_in_one_line(given, match):
    with pytest.raises(ConfigError, match=match) as e:
        settings.settings(given)
    assert "\n" not in str(e.value)


def test_a_budget_below_every_candidate_and_an_unknown_model_fail_before_any_load(data_dir, monkeypatch):
    import kvq_lab.run.runner as runner

    monkeypatch.setattr(runner, "get_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ConfigError, match=r"frontier.budgets: 1 is below the smallest candidate") as e:
        Frontier(compose(["experiment=frontier", f"data_dir={data_dir}", "frontier.budgets=[1,4.5]"]))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="model.path"):
        Frontier(compose(["experiment=frontier", f"data_dir={data_dir}", "model=hub", "model.path=/no/such/model"]))


def test_a_partial_stage_runs_only_what_is_missing(tiny_model_dir, data_dir, tmp_path):
    args = [
        "experiment=frontier", "model=hub", f"model.path={tiny_model_dir}", "model.head_dim=null",
        f"data_dir={data_dir}", f"results_dir={tmp_path}", "resume_dirty=true", "frontier.budgets=[4.5]",
        "frontier.max_candidates=2", "frontier.stages=[screen]", "frontier.sources=[preset]",
        "frontier.screen.prompts=1", "frontier.screen.tokens=32",
    ]  # fmt: skip
    f = Frontier(compose(args))
    assert len(f.cands) == 2
    f.screen(["screen"])
    first = sorted((tmp_path / "runs").glob("*/record.json"))
    assert len(first) == 2 and set(f.records("screen")) == set(f.cands)
    kept, lost = first
    import shutil

    shutil.rmtree(lost.parent)  # a killed stage: one row's record never written
    g = Frontier(compose(args))
    g.screen(["screen"])
    second = sorted((tmp_path / "runs").glob("*/record.json"))
    assert len(second) == 2 and kept in second  # the finished row was not run again; the lost one was
    assert set(g.records("screen")) == set(f.cands)
    # a refresh (frontier.stages=[]) runs nothing: it enumerates again and rewrites the plan and report from the
    # records, keeping what the stages ran and the stages setting of the plan it replaces
    g.search()
    before = json.loads((g.dir / "plan.json").read_text())
    assert before["stages"]["screen"]["ran"] and before["settings"]["stages"] == ["screen"]
    h = Frontier(compose([a for a in args if not a.startswith("frontier.stages=")] + ["frontier.stages=[]"]))
    h.search()
    after = json.loads((h.dir / "plan.json").read_text())
    assert sorted((tmp_path / "runs").glob("*/record.json")) == second
    assert after["stages"]["screen"] == before["stages"]["screen"] and after["settings"]["stages"] == ["screen"]
    assert after["candidates"] == before["candidates"]
