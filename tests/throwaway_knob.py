"""Run by tests/test_throwaway_knob.py in a fresh process whose `kvq_lab` is a copy of the package (the folder argv[1]):
add a throwaway cache knob, `tw_stride`, the way a contributor adds one, by editing the copy's knobs.py and config.py
and regenerating its README's knob table, then check that it is found everywhere a knob is read, with no other edit.
Prints "throwaway knob: ok". $KVQ_BASE_HASH: the config hash of the defaults, computed by the unedited package."""

import contextlib
import importlib.util
import io
import os
import sys
from pathlib import Path

ROOT = Path(sys.argv[1])
KNOB = "tw_stride"


def edit(rel: str, anchor: str, added: str) -> None:
    """Insert `added` after the one line of the copy's file `rel` that starts with `anchor` (stripped)."""
    p = ROOT / rel
    lines = p.read_text().splitlines(keepends=True)
    at = [i for i, line in enumerate(lines) if line.strip().startswith(anchor)]
    assert len(at) == 1, f"{rel}: anchor {anchor!r} found {len(at)} times (update tests/throwaway_knob.py's edits)"
    lines.insert(at[0] + 1, added)
    p.write_text("".join(lines))


# --- the contributor's edits ------------------------------------------------------------------------------------------
# 1. the knob, its default and meaning (kvq_lab/cache/knobs.py)
edit(
    "kvq_lab/cache/knobs.py",
    "sink_tokens: Any = knob(0,",
    f'    {KNOB}: Any = knob(1, "throwaway: every n-th token")\n',
)
# 2. the cache's field and its check (kvq_lab/cache/config.py)
edit("kvq_lab/cache/config.py", "sink_tokens: int = 0", f"    {KNOB}: int = 1\n")
edit(
    "kvq_lab/cache/config.py",
    "def __post_init__(self):",
    f"        if isinstance(self.{KNOB}, bool) or not isinstance(self.{KNOB}, int) or self.{KNOB} < 1:\n"
    f'            raise QuantConfigError(f"{KNOB}={{self.{KNOB}!r}} must be an integer >= 1")\n',
)

import kvq_lab  # noqa: E402  (the copy, edited)

assert Path(kvq_lab.__file__).resolve().is_relative_to(ROOT.resolve()), f"not the copy: {kvq_lab.__file__}"

# 3. the README's knob table, generated (`python -m kvq_lab.run.knob_table --write`)
from kvq_lab.run import knob_table  # noqa: E402

with contextlib.redirect_stdout(io.StringIO()):
    assert knob_table.main(["--write"]) == 0

# --- what follows from those three files ------------------------------------------------------------------------------
import pytest  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from kvq_lab.cache.knobs import CACHE_KNOBS, cache_config  # noqa: E402
from kvq_lab.common.errors import ConfigError  # noqa: E402
from kvq_lab.lmeval.cli import check_cli, check_model_args  # noqa: E402
from kvq_lab.run.config import build, config_hash, register_schema  # noqa: E402

register_schema()
with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):

    def run_config(*overrides: str):
        """The config `python run.py <overrides>` composes from the copy's conf/ and schema."""
        return compose(config_name="config", overrides=list(overrides))

    # the knobs build the cache with it, its default where not given
    assert KNOB in CACHE_KNOBS
    assert cache_config({KNOB: 3}).tw_stride == 3, "cache_config() did not pass the knob to CacheConfig"
    assert cache_config({}).tw_stride == 1

    # run.py: the schema composes it (conf/config.yaml does not name it) and the preflight builds the cache with it
    assert run_config().tw_stride == 1
    assert build(run_config(f"{KNOB}=4")).cache.tw_stride == 4, "the preflight's cache lost the knob"
    with pytest.raises(ConfigError) as e:  # refused before anything loads, in one line naming the knob and value
        build(run_config(f"{KNOB}=0"))
    assert str(e.value) == f"{KNOB}=0 must be an integer >= 1", str(e.value)

    # lm-eval's `--model kvq`: a model arg, checked on its command line (one line, exit status 2)
    assert check_model_args(pretrained="smollm2-135m", **{KNOB: 2})[0].tw_stride == 2, "lm-eval's cache lost it"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        check_cli(["lm_eval", "--model", "kvq", "--model_args", f"pretrained=smollm2-135m,{KNOB}=0", "--tasks", "x"])
    assert e.value.code == 2 and err.getvalue() == f"error: {KNOB}=0 must be an integer >= 1\n", err.getvalue()

    # the config hash: unchanged at the knob's default (the same as before the knob existed), changed when set
    base = config_hash(run_config())
    assert base == os.environ["KVQ_BASE_HASH"], f"a knob at its default moved the config hash: {base}"
    assert config_hash(run_config(f"{KNOB}=1")) == base
    assert config_hash(run_config(f"{KNOB}=2")) != base

# the schema's own tests (the README's table, conf/config.yaml's defaults, every knob's meaning), on the copy
spec = importlib.util.spec_from_file_location("copied_test_schema", ROOT / "tests" / "run" / "test_schema.py")
schema_tests = importlib.util.module_from_spec(spec)
spec.loader.exec_module(schema_tests)
assert schema_tests.REPO == ROOT, schema_tests.REPO
tests = [getattr(schema_tests, n) for n in dir(schema_tests) if n.startswith("test_")]
assert len(tests) == 3, [t.__name__ for t in tests]
for test in tests:
    test()
print(f"throwaway knob: ok (config hash of the defaults: {base})")
