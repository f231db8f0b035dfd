"""Every saved study (conf/experiment/*.yaml) as a user runs it: every row of its sweep composes and validates on the
default model before any model loads (a row the default model cannot run is a broken study), and one row of each
runs end to end in a debug setting (the tiny random model, a few tokens), so a study whose settings no longer run is
found here, not by its next reader."""

import itertools
from pathlib import Path

import pytest
from helpers_models import compose
from omegaconf import OmegaConf

from kvq_lab.run.config import validate
from kvq_lab.run.runner import run

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))
# each task shrunk to a few tokens and documents (applied after the study's own settings)
DEBUG = {
    "ppl": ["++task.context_tokens=32", "++task.eval_tokens=16", "++task.windows=1"],
    "fidelity": ["++task.context_tokens=32", "++task.eval_tokens=16", "++task.windows=1"],
    "retrieval": ["++task.context_tokens=256", "++task.samples=1", "++task.max_new_tokens=4"],
    "behavior": ["++task.harmful=1", "++task.neutral=1", "++task.max_new_tokens=4"],
}
DEBUG_RUN = [
    "limit=1",
    "++calibration.tokens=256",
    "++calibration.chunk=128",
    "++precision.tokens=64",
    "probes.n_prompts=1",
    "probes.max_tokens=64",
    "probes.figures=false",
]


def rows(name: str) -> list[list[str]]:
    """The overrides of each row Hydra's basic sweeper makes of the study (its `hydra.sweeper.params` product)."""
    params = OmegaConf.load(REPO / "conf" / "experiment" / f"{name}.yaml").get("hydra", {}).get("sweeper", {})
    params = params.get("params") or {}
    values = [[f"{k}={v}" for v in str(vs).split(",")] for k, vs in params.items()]
    return [list(r) for r in itertools.product(*values)]


@pytest.mark.parametrize("name", EXPERIMENTS)
@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_every_row_validates_on_the_default_model(name, data_dir):
    for row in rows(name):
        plan = validate(compose([f"experiment={name}", *row, f"data_dir={data_dir}"]))
        assert plan.cfg.experiment_name == name, row


@pytest.mark.parametrize("name", EXPERIMENTS)
@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_a_row_runs_in_the_debug_setting(name, tiny_model_dir, data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KVQ_CALIBRATION_CACHE", str(tmp_path / "fits"))
    row = rows(name)[-1]  # the last row: the most quantized one in most studies
    base = [f"experiment={name}", *row, f"data_dir={data_dir}"]
    task = validate(compose(base)).task
    overrides = [
        *base,
        "model=hub",
        f"model.path={tiny_model_dir}",
        "model.head_dim=null",
        "logger=none",
        f"results_dir={tmp_path}",
        "resume_dirty=true",
        *DEBUG_RUN,
        *DEBUG.get(task, []),
    ]
    metrics = run(compose(overrides))
    assert metrics and all(not isinstance(v, float) or v == v for v in metrics.values()), metrics
    assert list((tmp_path / "runs").glob("*/record.json")), "the run wrote no record"
