"""Bad input fails fast: one line naming the key, the value and what is allowed; no traceback, no model load."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers_models import compose, run_cli

from kvq_lab.run.config import ConfigError, validate

REPO = Path(__file__).resolve().parents[2]


def cfg_with(*overrides):
    return compose(list(overrides))


BAD = [
    (["key_axis=chanel"], r"key_axis='chanel'.*token, channel"),
    (["value_axis=head"], r"value_axis='head'.*token, channel"),
    (["bits=6"], r"bits=6 .*1, 2, 3, 4, 5, 8, 16"),
    (["bits=5"], r"format=int takes 1, 2, 3, 4, 8 bits; bits=5 conflicts: .*format=q5_0 \| q5_1"),  # not int's
    (["bits=0"], r"bits=0 .*1, 2, 3, 4, 5, 8, 16"),
    (["key_bits=7"], r"key_bits=7"),
    (["group_size=48"], r"group_size.*48.*does not divide head_dim=64.*\[1, 2, 4, 8, 16, 32, 64\]"),
    (["group_size=0"], r"group_size=0 must be an integer >= 1"),
    (["exact_window=-1"], r"exact_window=-1 must be an integer >= 0"),
    (["sink_tokens=-4"], r"sink_tokens=-4 must be an integer >= 0"),
    (["mode=packed", "exact_window=20"], r"exact_window=20 must be a multiple of the key group size 32"),
    (["exact_window=128"], r"exact_window=128 applies to mode=packed only"),
    (["rope=middle"], r"rope='middle'.*post, pre"),
    (["mode=fake"], r"mode='fake'.*simulated, packed"),
    (["prefill=maybe"], r"prefill='maybe' is not allowed; choose exact, quantized or null"),
    (["mode=recompute", "prefill=quantized"], r"prefill=quantized with mode=recompute"),
    (["skip_layers=odd"], r"skip_layers=odd is not allowed; choose none, sliding_window or a list"),
    (["skip_layers=[0,-2]"], r"skip_layers=\[0,-2\] is not allowed"),
    (["skip_layers=sliding_window"], r"skip_layers=sliding_window: model=smollm2-135m has no sliding-window layers"),
    (["skip_layers=[0,30]"], r"skip_layers=\[0, 30\]: model=smollm2-135m has 30 decoder layers \(0..29\)"),
    (["skip_layers=[1]", "precision=search", "precision.budget=3"], r"precision=search sets every layer's bits"),
    (["mode=recompute", "skip_layers=[1]"], r"skip_layers with mode=recompute"),
    (["policy=evict", "probe=true"], r"policy=evict's tiers and dropped tokens are not modelled there"),
    (["policy=mikv", "policy.keep=1.5"], r"policy.keep=1.5 must be a fraction in \(0, 1\]"),
    (["policy=evict", "mode=packed", "prefill=quantized"], r"policy=evict splits the prompt after its forward"),
    (["limit=0"], r"limit=0 must be an integer >= 1 or null"),
    (["task.name=squad"], r"task.name='squad' is not a known task"),
    (["model.path=./no/such/model"], r"model.path='./no/such/model' does not exist"),
    (["data_dir=/no/such/dir"], r"data_dir='/no/such/dir' is not a folder"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_validate_rejects(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_with(*overrides))


def test_missing_data_file_names_file_and_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"coqa/coqa-validation.first20.lm_eval.jsonl under data_dir=.*KVQ_DATA_DIR"):
        validate(cfg_with(f"data_dir={tmp_path}"))


def test_defaults_are_valid(data_dir):
    plan = validate(cfg_with(f"data_dir={data_dir}"))
    assert plan.cache.label() == "K2b-C32_V2b-T32_sim"
    assert plan.task == "coqa_turns"


@pytest.mark.parametrize("group", ["quant", "experiment", "task", "model", "calibration", "precision"])
def test_a_misspelled_preset_fails_instead_of_running_the_defaults(group):
    """Every config group refuses a name it does not hold (an `optional` group would silently run the defaults: a
    record of a config nobody asked for)."""
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match=f"Could not find '{group}/no_such_preset'"):
        compose([f"{group}=no_such_preset"])


@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_every_config_composes(data_dir, tmp_path):
    """Every option of every config group composes against the schema and validates, given what it needs
    (`calibration=file` a text, `precision=search` a budget); `precision=file` without its file refuses in one line
    naming the setting.
    (conf/experiment/ rows: tests/run/test_experiments.py.)"""
    text = tmp_path / "notes.txt"
    text.write_text("The cache stores keys and values. " * 400)
    needs = {
        ("calibration", "file"): [f"calibration.path={text}"],
        ("model", "hub"): ["model.path=HuggingFaceTB/SmolLM2-135M-Instruct"],
        ("precision", "search"): ["precision.budget=4.5"],
    }
    refuses = {("precision", "file"): "precision.path"}
    groups = sorted(p.name for p in (REPO / "conf").iterdir() if p.is_dir() and p.name not in ("hydra", "experiment"))
    seen = 0
    for group in groups:
        key = "+storage@_global_" if group == "storage" else group  # storage presets are applied by experiments
        for name in sorted(p.stem for p in (REPO / "conf" / group).glob("*.yaml")):
            overrides = [f"{key}={name}", f"data_dir={data_dir}", *needs.get((group, name), [])]
            if (group, name) in refuses:
                with pytest.raises(Exception, match=refuses[group, name]):
                    validate(cfg_with(*overrides))
            elif group == "model":
                cfg_with(*overrides)  # composes; its files are checked when it is the one run (tests/run/test_trust.py)
            else:
                validate(cfg_with(*overrides))
            seen += 1
    assert seen >= 30 and {"calibration", "logger", "model", "policy", "precision", "quant", "storage", "task"} <= set(
        groups
    )


@pytest.mark.parametrize(
    "args,needle",
    [
        (["key_axis=chanel"], "key_axis='chanel'"),
        (["bits=5"], "bits=5"),
        (["task=nosuchtask"], "nosuchtask"),
        (["model=nosuchmodel"], "nosuchmodel"),
        (["key_axs=channel"], "key_axs"),
    ],
)
@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_cli_fails_fast_without_traceback(args, needle, tmp_path):
    p, dt = run_cli(*args, f"results_dir={tmp_path}")
    assert p.returncode != 0
    assert needle in p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    assert dt < 60, dt
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # nothing ran


@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_cli_our_errors_are_one_line(tmp_path):
    p, _ = run_cli("value_axis=head", f"results_dir={tmp_path}")
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert lines == ["error: value_axis='head' is not allowed; choose one of: token, channel"]


def test_probe_settings_are_checked_before_the_run(data_dir):
    with pytest.raises(ConfigError, match=r"probes: unknown probe setting\(s\) \['n_promts'\]"):
        validate(cfg_with("probe=true", "+probes.n_promts=3", f"data_dir={data_dir}"))


def test_config_hash_is_the_cache_not_the_spelling(data_dir):
    from kvq_lab.run.config import config_hash

    d = f"data_dir={data_dir}"
    assert config_hash(cfg_with("bits=2", d)) == config_hash(cfg_with("key_bits=2", "value_bits=2", d))
    assert config_hash(cfg_with("quant=2bit_KC_VT", d)) == config_hash(cfg_with(d))
    assert config_hash(cfg_with("bits=3", d)) != config_hash(cfg_with(d))
    assert config_hash(cfg_with("results_dir=elsewhere", "experiment_name=x", d)) == config_hash(cfg_with(d))
    assert config_hash(cfg_with("probe=true", d)) != config_hash(cfg_with(d))


def test_the_cache_fields_left_out_of_the_hash_at_their_defaults_are_those_hashes_were_written_without():
    """`CACHE_DEFAULTS` is derived (every CacheConfig field but `HASHED_ALWAYS`, at its dataclass default); it must keep
    holding exactly the list once written by hand, or committed config hashes and run keys would change."""
    from kvq_lab.run.config import CACHE_DEFAULTS, HASHED_ALWAYS

    by_hand = {"key_outliers": 0.0, "value_outliers": 0.0, "key_outlier_thresholds": None, "layers": ()}
    by_hand |= {"recompute_rank": None, "key_residual": (), "value_residual": (), "skip_layers": (), "prefill": None}
    by_hand |= {"policy": "kivi", "policy_options": (), "head_bits": ()}
    assert {k: CACHE_DEFAULTS.get(k, "absent") for k in by_hand} == by_hand
    assert all(type(CACHE_DEFAULTS[k]) is type(v) for k, v in by_hand.items())  # 0.0, not 0
    assert set(HASHED_ALWAYS).isdisjoint(CACHE_DEFAULTS) and "residual_length" not in CACHE_DEFAULTS
