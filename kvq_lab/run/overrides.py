"""run.py's command line composed once before Hydra's own run, so that what Hydra would refuse in several lines (an
unknown key, an option no config group has) is refused in one line that names the value and the fix.

`check_composition(argv, conf)`: every value of a group override (`quant=a,b`) must be a file of that group in
`conf/`, a top-level key a field of `RunSchema`; where a key names a section's setting (`task.n_ctx`), the overrides,
a sweep's first value each, are composed with Hydra's compose API against `config.yaml` and a refusal is turned into
a `ConfigError`. Hydra's own overrides (`hydra.*`, `hydra/...`) and command lines with flags other than
`-m`/`--multirun` (`--cfg`, `-cn`, `--help`, ...) are left to Hydra. The messages are the preflight's
(`not_a_setting`, `did_you_mean`).
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from kvq_lab.common.errors import ConfigError
from kvq_lab.preflight import did_you_mean, not_a_setting

PASS_FLAGS = {"-m", "--multirun"}  # flags that leave composition as it is


def _options(group: Path) -> list[str]:
    return sorted(p.relative_to(group).with_suffix("").as_posix() for p in group.rglob("*.yaml"))


def _choices(name: str, options: list[str]) -> str:
    near = did_you_mean(name, options)
    if near:
        return near
    shown = ", ".join(options[:12]) + (f", ... ({len(options)} in all)" if len(options) > 12 else "")
    return f"choose one of {shown}"


def _unknown_key(key: str, composed_without) -> str:
    """One line for `key` that is not in the config: close spellings among its siblings where composition allows."""
    parent = key.rpartition(".")[0]
    siblings: list[str] = []
    try:
        node = composed_without()
        for part in parent.split(".") if parent else []:
            node = node[part]
        siblings = [str(k) for k in node.keys()]
    except Exception:  # noqa: BLE001 - the suggestion is a courtesy; the refusal stands without it
        pass
    return not_a_setting(key, siblings, f"the `{parent}` section" if parent else "conf/config.yaml")


def check_composition(argv: list[str], conf: Path) -> None:
    """Raise ConfigError (one line) where Hydra would refuse argv's overrides; return quietly otherwise. Group options
    and top-level keys are checked against conf/ and `RunSchema` directly; Hydra composes the command line (about a
    second) only when a dotted key (`task.n_ctx=...`) asks for a section's settings."""
    if any(a.startswith("-") and a not in PASS_FLAGS for a in argv):
        return
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from kvq_lab.run.config import RunSchema, register_schema

    lines = [a for a in argv if "=" in a and not a.lstrip("+~").startswith("hydra")]
    try:
        parsed = OverridesParser.create().parse_overrides(lines)
    except Exception:  # noqa: BLE001 - a syntax error: Hydra's own message says where
        return
    known = [f.name for f in fields(RunSchema)]
    first: list[str] = []
    nested = False
    for o in parsed:
        key = o.get_key_element()
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
        group = conf / o.key_or_group
        if group.is_dir() and not o.is_delete():
            options = _options(group)
            for v in values:
                if v == "null":
                    raise ConfigError(f"{o.key_or_group}=null: a config group takes an option's name; leave "
                                      f"{o.key_or_group}= out for its default, or {_choices(v, options)}")  # fmt: skip
                if v not in options:
                    raise ConfigError(f"{o.key_or_group}={v}: no such option in conf/{o.key_or_group}/; "
                                      f"{_choices(v, options)}")  # fmt: skip
        elif "." in o.key_or_group:
            nested = True
        elif o.key_or_group not in known and not o.is_add() and not o.is_delete():
            raise ConfigError(not_a_setting(o.key_or_group, known))  # the preflight's `known_keys` says the same
        first.append(f"{key}={values[0]}" if o.is_sweep_override() else o.input_line)
    if not nested:
        return
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    register_schema()  # config.yaml's defaults name it (run.py registers it too; storing it twice is harmless)

    def composed(overrides: list[str]):
        with initialize_config_dir(config_dir=str(conf.resolve()), version_base=None):
            return compose(config_name="config", overrides=overrides)

    try:
        composed(first)
    except ConfigCompositionException as e:
        text = str(e)
        m = re.match(r"Could not (?:override|append to) '([^']+)'", text)
        if m:
            key = m.group(1)
            without = [f for f in first if not _sets(f, key)]
            raise ConfigError(_unknown_key(key, lambda: composed(without))) from None
        raise ConfigError(" ".join(text.split("\n")[0].split())) from None
    except Exception as e:  # noqa: BLE001 - Hydra would fail the same way, with a stack trace
        raise ConfigError(f"{' '.join(argv)}: {' '.join(str(e).split(chr(10))[0].split())}") from None


def _sets(override: str, key: str) -> bool:
    return override.lstrip("+~").split("=", 1)[0] == key
