"""One source of truth for the knobs: the schema (`RunSchema`, built on `CacheKnobs`). The README's knob table is
generated from it, conf/config.yaml sets the same defaults where it names a knob (the schema supplies those it leaves
out), and every knob says what it means."""

from dataclasses import MISSING, fields
from pathlib import Path

import yaml

from kvq_lab.run import knob_table
from kvq_lab.run.config import SECTIONS, RunSchema

REPO = Path(__file__).resolve().parents[2]
CONFIG = yaml.safe_load((REPO / "conf" / "config.yaml").read_text())


def test_readme_knob_table_is_the_schemas():
    table = knob_table.readme_table((REPO / "README.md").read_text())
    assert table is not None, "README.md lost the knob table's markers"
    assert table == knob_table.markdown(), "README's knob table is stale: python -m kvq_lab.run.knob_table --write"


def test_every_knob_has_a_meaning_or_shares_a_row():
    names = {f.name for f in fields(RunSchema)}
    for f in fields(RunSchema):
        row = f.metadata.get("row")
        assert f.metadata.get("doc") or row, f"{f.name}: give knob(..., doc) or row=<the knob it shares a row with>"
        assert row is None or row in names, f"{f.name}: row={row!r} is not a knob"


def test_config_yaml_sets_the_schemas_defaults_where_it_sets_a_knob():
    groups = knob_table.group_defaults()
    top = {k: v for k, v in CONFIG.items() if k not in ("defaults", "hydra")}
    schema = {f.name: f for f in fields(RunSchema)}
    assert not set(top) - set(schema), f"conf/config.yaml sets keys the schema lacks: {sorted(set(top) - set(schema))}"
    for name, f in schema.items():
        if name in groups or name in SECTIONS and name not in top:
            assert name in groups, f"{name}: a section neither set in conf/config.yaml nor chosen by its defaults list"
            continue
        if name not in top:  # the schema supplies its default (a new knob need not be repeated there)
            continue
        if name in knob_table.ENV_DEFAULTS:
            assert "KVQ_DATA_DIR" in str(top[name])
        elif f.default is MISSING:
            want = f.default_factory()
            assert not want or top[name] == want or set(want) <= set(top[name]), name
        else:
            assert top[name] == f.default, f"conf/config.yaml: {name}: {top[name]!r}, the schema says {f.default!r}"
