"""The format knobs (`format`, `key_format`, `value_format`, and `key_bits`/`value_bits` defaulting to the format's
width): bad input fails in one line before any model loads, labels and hashes say what the cache is."""

from __future__ import annotations

import pytest
from helpers_models import compose

from kvq_lab.quant.formats import FORMATS
from kvq_lab.quant.spec import QuantSpec
from kvq_lab.run.config import ConfigError, cache_config, config_hash, validate

FOUR_BIT = r" \| ".join(n for n in sorted(FORMATS) if 4 in FORMATS[n].supported_bits)  # every 4-bit format
BAD = [
    (["format=fp8_e4m3", "key_bits=2"], r"^format=fp8_e4m3 takes 8 bits; key_bits=2 conflicts: drop key_bits"),
    (
        ["format=fp8_e5m2", "bits=4"],
        rf"^format=fp8_e5m2 takes 8 bits; bits=4 conflicts: drop bits, .*format={FOUR_BIT}$",
    ),
    (["value_format=fp8_e4m3", "value_bits=3"], r"^value_format=fp8_e4m3 takes 8 bits; value_bits=3 conflicts"),
    (["format=fp4"], rf"^format='fp4' is not a registered code format; allowed: {', '.join(sorted(FORMATS))}$"),
    (["key_format=nf4"], r"^key_format='nf4' is not a registered code format"),
    (["format=int", "value_format=lut"], r"^format=int and value_format=lut disagree; set one of them$"),
    (["format=3"], r"^format=3 must be a format name"),
    (["format=lut", "bits=6"], r"^bits=6 is not supported; choose one of: 1, 2, 3, 4, 5, 8, 16"),
    (["format=lut", "bits=5"], r"^format=lut takes 1, 2, 3, 4, 8 bits; bits=5 conflicts: .*format=q5_0 \| q5_1$"),
    (["bits=5"], r"^format=int takes 1, 2, 3, 4, 8 bits; bits=5 conflicts: .*, or a format with 5 bits: format=q5_0"),
    (["key_bits=5"], r"^key_format=int takes 1, 2, 3, 4, 8 bits; key_bits=5 conflicts: .*key_format=q5_0 \| q5_1$"),
    (["format=fp8_e4m3", "mode=packed", "exact_window=20"], r"exact_window=20 must be a multiple"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_validate_rejects(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        validate(compose([*overrides, "model.path=/no/such/model"]))  # the cache is checked before the model
    assert "\n" not in str(e.value)


def test_bits_default_to_the_formats_width():
    c = cache_config(compose([]))
    assert (c.key, c.value) == (QuantSpec(2, 32, "channel"), QuantSpec(2, 32, "token"))  # as before the knobs
    c = cache_config(compose(["format=fp8_e4m3"]))
    assert (c.key.format, c.key.bits, c.value.format, c.value.bits) == ("fp8_e4m3", 8, "fp8_e4m3", 8)
    c = cache_config(compose(["format=fp8_e5m2", "bits=8"]))  # the width it takes, spelled out: fine
    assert c.key.bits == c.value.bits == 8
    c = cache_config(compose(["key_format=lut", "value_format=fp8_e4m3", "key_bits=4"]))
    assert (c.key.format, c.key.bits, c.value.format, c.value.bits) == ("lut", 4, "fp8_e4m3", 8)
    c = cache_config(compose(["key_format=fp8_e4m3"]))  # the other tensor keeps int at its default width
    assert (c.key.bits, c.value.format, c.value.bits) == (8, "int", 2)
    c = cache_config(compose(["format=q5_1", "bits=5"]))  # 5 bits: llama.cpp's q5 types take it, int does not
    assert (c.key.format, c.key.bits, c.value.format, c.value.bits) == ("q5_1", 5, "q5_1", 5)
    c = cache_config(compose(["key_format=q5_0"]))
    assert (c.key.bits, c.value.format, c.value.bits) == (5, "int", 2)


def test_labels_are_unchanged_for_int_and_name_other_formats():
    label = lambda *o: cache_config(compose(list(o))).label()  # noqa: E731
    assert label() == "K2b-C32_V2b-T32_sim"
    assert label("format=int", "bits=4") == label("bits=4") == "K4b-C32_V4b-T32_sim"
    assert label("format=fp8_e4m3", "key_axis=token") == "Kfp8e4m3-T32_Vfp8e4m3-T32_sim"
    assert label("key_format=fp8_e5m2", "mode=packed", "exact_window=32") == "Kfp8e5m2-C32_V2b-T32_pac_R32"
    assert label("format=lut", "bits=3") == "Klut3b-C32_Vlut3b-T32_sim"
    assert label("format=fp8_e4m3", "bits=16") == "K16b_V16b_sim"
    lut = QuantSpec(2, 32, "token", "lut", (0.0, 0.1, 0.5, 1.0))
    assert lut.short().startswith("lut2b.") and lut.short() != QuantSpec(2, 32, "token", "lut").short()


@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_hash_follows_the_cache(data_dir):
    h = lambda *o: config_hash(compose([*o, f"data_dir={data_dir}"]))  # noqa: E731
    assert h() == h("format=int") == h("key_format=int", "value_format=int") == h("key_bits=2", "value_bits=2")
    assert h("format=fp8_e4m3") == h("key_format=fp8_e4m3", "value_format=fp8_e4m3", "bits=8")
    assert h("format=fp8_e4m3") != h("format=fp8_e5m2") != h()
    assert h("format=fp8_e4m3", "bits=16") == h("bits=16")  # 16 bits quantizes nothing, whatever the format


def test_format_run_validates(data_dir):
    plan = validate(compose(["format=fp8_e4m3", "mode=packed", "exact_window=32", f"data_dir={data_dir}"]))
    assert plan.cache.label() == "Kfp8e4m3-C32_Vfp8e4m3-T32_pac_R32"


@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_cli_names_both_knobs_in_one_line(tmp_path):
    from helpers_models import run_cli

    p, _ = run_cli("format=fp8_e4m3", "key_bits=2", f"results_dir={tmp_path}")
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: format=fp8_e4m3 takes 8 bits; key_bits=2 conflicts")


def test_mxfp4_with_backend_auto_warns_once_that_it_takes_the_pytorch_path(monkeypatch, recwarn, tmp_path):
    """The C kernel cannot read mxfp4 (its E8M0 scale reads as fp32): `backend=auto` resolves to torch before the
    load, says so once as the README promises, and the record names the backend that runs. Before, the run resolved
    `auto` to torch silently and the warning of the layers' backend selection never came."""
    from kvq_lab.cache.routing import backends
    from kvq_lab.kernels import cpu_kernel

    if cpu_kernel.build_error() is not None:
        pytest.skip("the C kernel does not build here: auto takes the PyTorch path for every format")
    monkeypatch.setattr(backends, "_WARNED", set())
    overrides = ["quant=mxfp4", "mode=packed", "logger=none", f"results_dir={tmp_path}", "task=ppl"]
    with pytest.warns(UserWarning, match=r"^backend=auto: the \w+ kernels cannot read format=mxfp4; the packed cache "):
        plan = validate(compose(overrides))
    assert plan.cache.backend == "torch"
    n = len(recwarn)
    validate(compose(overrides))
    assert len(recwarn) == n  # once per process
