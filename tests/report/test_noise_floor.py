"""The noise floor of a row (kvq_lab/report/noise.py): a rerun pairs with its row only when it changed nothing but
rounding; its paired difference and flips are counted over the units both scored; a difference is beyond the floor
only when rounding alone would rarely give it."""

from __future__ import annotations

import json

import pytest

from kvq_lab.report.noise import Floor, beyond, noise_floor, rerun_changes


def record(tmp_path, name: str, f1: list[float], responses: list[str] | None = None, **config) -> dict:
    d = tmp_path / name
    d.mkdir()
    responses = responses or [f"a{i}" for i in range(len(f1))]
    samples = [
        {"doc_id": i, "f1": v, "em": v, "response": r} for i, (v, r) in enumerate(zip(f1, responses, strict=True))
    ]
    (d / "samples.json").write_text(json.dumps(samples))
    cfg = {"model": {"name": "smollm2-135m", "dtype": "float32"}, "task": {"name": "coqa_turns"}, "seed": 0}
    for k, v in config.items():
        if k == "dtype":
            cfg["model"] = {**cfg["model"], "dtype": v}
        else:
            cfg[k] = v
    env = {"git": "abc1234", "versions": {"torch": "2"}, "torch_threads": 1}
    return {"_path": str(d), "config": cfg, "cache": "K2b-C32_V2b-T32_sim", "env": env}


def test_a_permuted_rerun_is_paired_turn_by_turn(tmp_path):
    base = record(tmp_path, "base", [1.0, 0.0, 0.5, 0.5], ["x", "y", "z", "w"])
    rerun = record(tmp_path, "rerun", [0.0, 0.0, 0.5, 1.0], ["q", "y", "z", "v"], noise="permute:1")
    f = noise_floor(base, rerun)
    assert (f.n, f.flips) == (4, 2)
    assert f.diff == pytest.approx(-12.5)  # (-100 + 0 + 0 + 50) / 4 points of F1
    assert f.changes == ("noise none -> permute:1",)
    assert f.cell().startswith("-12.50 ± ") and f.cell().endswith(", 2/4 flip")


def test_knobs_missing_from_older_records_take_their_value_of_then(tmp_path):
    old = record(tmp_path, "old", [1.0, 0.0])  # made before noise and prefix_reuse existed
    again = record(tmp_path, "new", [1.0, 0.0], noise="none", prefix_reuse=False, batch_size=1)
    assert rerun_changes(old, again) == []
    reuse = record(tmp_path, "reuse", [1.0, 0.0], prefix_reuse=True, batch_size=8, dtype="float64")
    assert rerun_changes(old, reuse) == [
        "model.dtype float32 -> float64",
        "batch_size 1 -> 8",
        "prefix_reuse False -> True",
    ]
    reuse["env"] = {"git": "def5678", "versions": {"torch": "3"}, "torch_threads": 2}
    assert rerun_changes(old, reuse)[-3:] == ["commit", "libraries", "threads"]


@pytest.mark.parametrize(
    "change,message",
    [
        ({"limit": 20}, r"limit None vs 20"),
        ({"seed": 1}, r"seed 0 vs 1"),
        ({"task": {"name": "ppl"}}, r"task \{'name': 'coqa_turns'\} vs \{'name': 'ppl'\}"),
    ],
)
def test_a_rerun_of_something_else_is_refused(tmp_path, change, message):
    base = record(tmp_path, "base", [1.0])
    other = record(tmp_path, "other", [1.0], **change)
    with pytest.raises(ValueError, match="not a rounding-only rerun: " + message):
        noise_floor(base, other)


def test_another_cache_is_no_rerun(tmp_path):
    base, other = record(tmp_path, "a", [1.0]), record(tmp_path, "b", [1.0])
    other["cache"] = "K4b-T32_V4b-T32_sim"
    with pytest.raises(ValueError, match="cache 'K2b-C32_V2b-T32_sim' vs 'K4b-T32_V4b-T32_sim'"):
        rerun_changes(base, other)


def test_beyond_the_floor():
    floor = Floor(diff=-1.9, se=1.7, n=297, flips=224, changes=("prefix_reuse False -> True",))
    assert beyond(-16.5, 2.5, floor)  # far outside what rounding moves
    assert not beyond(-4.0, 1.2, floor)  # 3.3 SE of its own, but rounding alone moved F1 by 1.9 ± 1.7
    assert not beyond(-6.0, 3.2, floor)  # outside the floor, not outside its own spread
    wide = Floor(diff=-3.9, se=1.6, n=297, flips=237, changes=("noise none -> permute:1",))
    assert beyond(-6.0, 1.5, floor) and not beyond(-6.0, 1.5, [floor, wide])  # every floor counts
    assert not beyond(-6.0, 1.5, [])  # no floor measured: nothing is beyond it
