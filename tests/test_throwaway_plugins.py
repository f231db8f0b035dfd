"""A format that stores a table, a fitted transform, a task, a probe metric and a cache policy, each added as a
contributor would (tests/throwaway_plugins.py: one class and one registry line each), are found everywhere:
validation, accounting, calibration, a run's record, the experiment table (tests/throwaway_checks.py), and every
registry-driven test matrix. Both run in a fresh process so that the main session's registries stay as shipped."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
MATRICES = [
    "tests/quant/test_formats.py",
    "tests/quant/test_format_matrix.py",
    "tests/quant/test_transforms.py",
    "tests/tasks/test_task_matrix.py",
    "tests/probes/test_error_matrix.py",
    "tests/cache/test_policies.py",
]


def _pytest(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "throwaway_plugins", *args]
    return subprocess.run(cmd, cwd=TESTS.parent, capture_output=True, text=True, env=env, timeout=900)


NAMES = ("tw_table", "tw_scale", "tw_task", "tw_maxabs", "tw_tiers")


@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_every_registry_driven_matrix_covers_them():
    p = _pytest("--collect-only", *MATRICES)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for name in NAMES:
        assert name in p.stdout, f"no test matrix parametrizes over {name}"


@pytest.mark.slow
def test_the_matrices_pass_for_them():
    p = _pytest("-k", " or ".join(NAMES), *MATRICES)
    assert p.returncode == 0 and " passed" in p.stdout, p.stdout[-4000:] + p.stderr[-3000:]


@pytest.mark.slow
def test_they_are_found_by_validation_accounting_calibration_records_and_tables():
    p = _pytest("tests/throwaway_checks.py")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    assert "4 passed" in p.stdout
