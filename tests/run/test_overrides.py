"""run.py's command line checked before Hydra runs (`kvq_lab.run.overrides`): an unknown key or an option no config
group has is refused in one line naming a close spelling or the choices; what composes passes untouched."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvq_lab.common.errors import ConfigError
from kvq_lab.run.overrides import check_composition

CONF = Path(__file__).resolve().parents[2] / "conf"


@pytest.mark.parametrize(
    "argv,line",
    [
        (["bitz=2"], "bitz is not a kvq_lab setting; did you mean bits?"),
        (
            ["experiment=frontier", "frontier.budget=[3]"],
            "frontier.budget is not a kvq_lab setting; did you mean frontier.budgets?",
        ),  # fmt: skip
        (["task=ppl", "task.zzz=1"], "task.zzz is not a kvq_lab setting; see the `task` section for the settings"),
        (["model=smolm2"], "model=smolm2: no such option in conf/model/; did you mean smollm2-135m?"),
        (["-m", "quant=llamacpp_q4_0,llamacpp_q4_x"], "quant=llamacpp_q4_x: no such option in conf/quant/; did you"),
        (["quant=zzzzzz"], "quant=zzzzzz: no such option in conf/quant/; choose one of 2bit_KC_VC, "),
        (["quant=null"], "quant=null: a config group takes an option's name; leave quant= out for its default"),
        (["-m", "bits=2,4", "zqxw=1,2"], "zqxw is not a kvq_lab setting; see conf/config.yaml for the settings"),
    ],
)
def test_what_hydra_would_refuse_is_one_line_with_the_fix(argv, line):
    with pytest.raises(ConfigError) as e:
        check_composition(argv, CONF)
    assert str(e.value).startswith(line) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["bits=2", "key_axis=channel"],
        ["-m", "experiment=llama_cpp_parity", "task.n_ctx=512,2048", "quant=llamacpp_q4_0,llamacpp_iq4_nl_had"],
        ["experiment=frontier", "frontier.budgets=[3,4.5]", "model=gemma3-270m"],
        ["+residual_length=32"],  # appended keys: the preflight's `known_keys` refuses them, with the schema in hand
        ["hydra/launcher=submitit_slurm", "hydra.job.chdir=false"],  # Hydra's own: left to Hydra
        ["--cfg", "job", "nonsense=1"],  # a flag that changes what Hydra does: left to Hydra
    ],
)
def test_what_composes_passes(argv):
    check_composition(argv, CONF)
