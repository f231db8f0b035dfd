"""A throwaway cache knob, added as a contributor would, touches at most 3 non-test files: the knob, its default and
meaning (kvq_lab/cache/knobs.py), the cache's field and its check (kvq_lab/cache/config.py), and the README's knob
table (generated: `python -m kvq_lab.run.knob_table --write`). The run schema, lm-eval's model args, the preflight, the
config hash and conf/config.yaml follow from those with no edit (tests/throwaway_knob.py checks each).

The knob is added to a copy of the package in a temporary folder, in a fresh process whose `kvq_lab` is the copy. The
test fails if the knob needed a fourth file: the copy's changed files are listed, and the checks fail where a file
left unedited would have needed a line for the knob."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_models import compose

from kvq_lab.run.config import config_hash

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
COPIED = ("kvq_lab", "conf", "README.md")  # what a knob could need to touch
TOUCHED = ["README.md", "kvq_lab/cache/config.py", "kvq_lab/cache/knobs.py"]  # at most 3 non-test files


def _files(root: Path) -> dict[str, bytes]:
    out = {}
    for top in COPIED:
        p = root / top
        for f in [p] if p.is_file() else sorted(p.rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts and f.suffix not in (".pyc", ".so"):
                out[str(f.relative_to(root))] = f.read_bytes()
    return out


@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_a_new_cache_knob_touches_at_most_three_files(tmp_path, data_dir):
    copy = tmp_path / "tree"
    for top in COPIED:
        src = REPO / top
        if src.is_dir():
            shutil.copytree(src, copy / top, ignore=shutil.ignore_patterns("__pycache__", "*.so", "build"))
        else:
            shutil.copy2(src, copy / top)
    (copy / "tests" / "run").mkdir(parents=True)
    shutil.copy2(TESTS / "run" / "test_schema.py", copy / "tests" / "run")  # the schema's tests, run on the copy
    before = _files(copy)
    env = {**os.environ, "PYTHONPATH": str(copy), "KVQ_DATA_DIR": str(data_dir)}
    env["KVQ_BASE_HASH"] = config_hash(compose([]))  # the unedited package's hash of the defaults
    p = subprocess.run(
        [sys.executable, str(TESTS / "throwaway_knob.py"), str(copy)],
        capture_output=True, text=True, env=env, cwd=copy, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0 and "throwaway knob: ok" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]
    after = _files(copy)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert changed == TOUCHED, f"a new cache knob touched {len(changed)} non-test files: {changed}"
