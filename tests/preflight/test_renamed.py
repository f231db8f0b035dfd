"""Renamed knobs (`kvq_lab.common.spellings`): the old spelling is refused in one line naming the new one, from
run.py's command line, from a config that slips one past Hydra, and from lm-eval's `--model kvq`; and the run keys
of committed records are reproduced from their configs (the renamed fields hash under their old names)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from helpers_models import compose

from kvq_lab import preflight
from kvq_lab.common.errors import ConfigError
from kvq_lab.common.spellings import RENAMED, TASK_RENAMED, current
from kvq_lab.lmeval.cli import check_model_args
from kvq_lab.records.provenance import run_key
from kvq_lab.run.config import config_hash, validate

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "argv,line",
    [
        (["residual_length=32"], "residual_length is now spelled exact_window (same meaning, same values): "),
        (["-m", "mode=packed", "residual_length=0,128"], "exact_window=0,128"),
        (["+residual_length=32"], "exact_window=32"),
        (["task=ppl", "task.prefill=cache"], "task.prefill is now spelled task.prompt_forward (same values): "),
    ],
)
def test_an_old_spelling_on_the_command_line_names_the_new_one(argv, line):
    with pytest.raises(ConfigError) as e:
        preflight.check_overrides(argv)
    assert line in str(e.value) and "\n" not in str(e.value)


def test_run_py_refuses_an_old_spelling_in_one_line_before_anything_loads():
    out = subprocess.run(
        [sys.executable, str(REPO / "run.py"), "mode=packed", "residual_length=32"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert (
        out.stderr
        == "error: residual_length is now spelled exact_window (same meaning, same values): exact_window=32\n"
    )


def test_a_config_that_slips_past_hydra_is_refused_by_the_preflight(data_dir):
    with pytest.raises(ConfigError, match="^residual_length is now spelled exact_window"):
        validate(compose([f"data_dir={data_dir}", "mode=packed", "+residual_length=32"]))
    with pytest.raises(ConfigError, match="^task.prefill is now spelled task.prompt_forward"):
        validate(compose([f"data_dir={data_dir}", "task=ppl", "+task.prefill=exact"]))


def test_lm_eval_refuses_the_old_spelling_naming_the_new_one():
    with pytest.raises(ConfigError, match="^model arg residual_length is now spelled exact_window") as e:
        check_model_args(pretrained="smollm2-135m", mode="packed", residual_length=32)
    assert "\n" not in str(e.value)


def test_the_new_spellings_are_the_knobs():
    from kvq_lab.cache.knobs import CACHE_KNOBS
    from kvq_lab.plugins import TASKS

    assert set(RENAMED.values()) <= set(CACHE_KNOBS) and not set(RENAMED) & set(CACHE_KNOBS)
    for name in ("ppl", "fidelity", "retrieval"):  # the tasks that had `prefill`
        assert set(TASK_RENAMED.values()) <= set(TASKS[name].options)
        assert not set(TASK_RENAMED) & set(TASKS[name].options)


# Committed records, written before the rename (`residual_length`, `task.prefill` in their configs): their configs,
# read in today's spellings, give their config hash and run key again. Chosen across the knobs renamed: an exact window
# of 128 (packed), task.prefill=exact with the cache's prefill=exact or quantized, and plain simulated rows.
RECORDS = [
    "experiments/fidelity/runs/20261206-021812_fidelity_Kfp8e4m3-C32_Vfp8e4m3-T32_pac_R128_200866",
    "experiments/long_context/runs/20261206-035256_retrieval_K2b-C32_V2b-T32_pac_R128_6c2bb0",
    "experiments/policies/runs/20261206-055310_fidelity_K2b-C32_V2b-T32_sim_Pexact_24687f",
    "experiments/policies/runs/20261206-054702_coqa_turns_K2b-C32_V2b-T32_sim_Pquant_f6110d",
    "experiments/policies/runs/20261206-070703_retrieval_K4b-C32_V4b-T32_sim_Pexact_evict_8f151e",
    "experiments/kivi_axis_table/runs/20261205-130213_probe_K2b-C32_V2b-C32_sim_00f45c",
    "experiments/mixed_precision/runs/20261206-132452_ppl_K2b-C32_V2b-T32_sim_873255",
    "experiments/llama_cpp_parity/runs/20261205-115916_fidelity_Kq80-T32_Vq40-T32_sim_Kinterleave+had_Vhad64_030402",
]


@pytest.mark.parametrize("folder", RECORDS, ids=lambda f: f.rsplit("_", 1)[-1])
def test_committed_run_keys_are_reproduced_from_their_configs(folder):
    rec = json.loads((REPO / folder / "record.json").read_text())
    config = current(rec["config"])
    assert not set(RENAMED) & set(config)  # read in today's spellings, as a run now would write it
    cache = preflight.cache_config(config)
    if rec.get("cache_config"):
        cache = replace(cache, backend=rec["cache_config"]["backend"])  # the backend `auto` resolved to
    h = config_hash(config, cache)
    assert h == rec["config_hash"]
    if "run_key" in rec and "inputs" in rec:
        assert run_key(h, rec["inputs"]) == rec["run_key"]
