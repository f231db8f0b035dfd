"""A record's `env.git`: the commit, `-dirty` only when a tracked file that can change what a run computes differs
(`kvq_lab.records.environment.counts_as_code`); a study rewriting its own outputs while it runs stays clean."""

from __future__ import annotations

import pytest

from kvq_lab.records.environment import _porcelain_paths, counts_as_code


@pytest.mark.parametrize(
    "path,code",
    [
        ("kvq_lab/quant/formats/iq4_nl.py", True),
        ("kvq_lab/kernels/c/decode.c", True),
        ("kvq_lab/lmeval/yaml/coqa/utils.txt", True),  # anything under the package
        ("conf/quant/llamacpp_iq4_nl.yaml", True),
        ("run.py", True),
        ("experiments/frontier/llama_cpp_check.py", True),  # a study's script
        ("scripts/gpu_check.sh", True),
        ("Makefile", True),
        ("pyproject.toml", True),
        ("experiments/frontier/frontier_gemma3-270m/plan.json", False),  # the driver rewrites it at its start
        ("experiments/frontier/frontier_gemma3-270m/report.md", False),
        ("experiments/frontier/frontier_gemma3-270m/frontier.png", False),
        ("experiments/llama_cpp_parity/checks/query_q8_0.json", False),
        ("README.md", False),
    ],
)
def test_what_counts_as_code(path, code):
    assert counts_as_code(path) is code


def test_porcelain_paths_read_renames_and_spaces():
    z = " M experiments/a b/plan.json\0R  new.py\0old.py\0M  README.md\0"
    assert _porcelain_paths(z) == ["experiments/a b/plan.json", "new.py", "old.py", "README.md"]
