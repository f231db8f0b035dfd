"""One preflight: run.py, a sweep's rows and lm-eval's `--model kvq` run the same checks, in the
same order, and a bad value gets the same one line from each, before any model loads."""

from __future__ import annotations

import pytest
from helpers_models import compose

from kvq_lab import preflight
from kvq_lab.common.errors import ConfigError
from kvq_lab.lmeval.cli import check_model_args
from kvq_lab.run.config import build


def test_lm_eval_runs_the_run_checks_in_their_order():
    """LMEVAL is RUN less the run's own settings: a subsequence, never a reordering."""
    order = [preflight.RUN.index(c) for c in preflight.LMEVAL]
    assert order == sorted(order)
    assert {c.__name__ for c in preflight.RUN} - {c.__name__ for c in preflight.LMEVAL} == {
        "known_keys", "precision", "calibration", "run_values", "search_settings", "logger", "probes", "task",
        "features", "run_config", "task_options", "positions", "task_inputs", "prompt",
    }  # fmt: skip


# one bad value per stage of the list: a knob, the device, the model's head dim, its layer count
SAME = [
    ({"value_axis": "head"}, "value_axis=head"),
    ({"bits": 6}, "bits=6"),
    ({"device": "tpu"}, "device=tpu"),
    ({"group_size": 48}, "group_size=48"),
    ({"skip_layers": [0, 30]}, "skip_layers=[0,30]"),
]


@pytest.mark.parametrize("model_args, override", SAME, ids=[o for _, o in SAME])
def test_the_same_bad_value_is_the_same_line_from_run_and_lm_eval(model_args, override):
    with pytest.raises(ConfigError) as run_error:
        build(compose([override]))
    with pytest.raises(ConfigError) as lm_eval_error:
        check_model_args("smollm2-135m", **model_args)
    assert str(lm_eval_error.value) == str(run_error.value)
    assert "\n" not in str(run_error.value)


def test_the_preflight_resolves_what_the_run_reads():
    """A good config passes every check and comes back as the contract the layers below read."""
    run = build(compose(["bits=4", "task=ppl"]))
    cache, name, _ = check_model_args("smollm2-135m", bits=4)
    assert run.cache.backend != "auto" and cache.backend == run.cache.backend
    assert run.model_source == name and run.facts.layers == 30
