"""The README's knob table, generated from the schema (`RunSchema`: each knob's default and meaning), so the two cannot
drift apart; tests/run/test_schema.py checks the README holds exactly this table and conf/config.yaml the same defaults
where it names a knob.

    python -m kvq_lab.run.knob_table            # print the table
    python -m kvq_lab.run.knob_table --write    # replace the table in README.md (between its two marker comments)

Knobs that share a row (`knob(..., row=...)`) are listed together: `key_axis`, `value_axis`; `bits` / `key_bits`,
`value_bits` (a knob that sets both comes first). A config group (`model=`, `task=` ...) shows the default that
conf/config.yaml's defaults list picks.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import MISSING, fields
from pathlib import Path

from kvq_lab.run.config import RunSchema

REPO = Path(__file__).resolve().parents[2]
BEGIN = "<!-- knob table: generated from the schema by `python -m kvq_lab.run.knob_table --write` -->"
END = "<!-- end of knob table -->"
ENV_DEFAULTS = {"data_dir": "$KVQ_DATA_DIR"}  # conf/config.yaml reads these from the environment


def group_defaults(conf: Path = REPO / "conf") -> dict[str, str]:
    """The option conf/config.yaml's defaults list picks for each config group (`model: smollm2-135m`)."""
    import yaml

    out = {}
    for entry in yaml.safe_load((conf / "config.yaml").read_text())["defaults"]:
        if isinstance(entry, dict):
            for k, v in entry.items():
                if v is not None and not k.startswith(("override ", "optional ")):
                    out[k] = str(v)
    return out


def _shown(value) -> str:
    return "`" + (json.dumps(value) if not isinstance(value, str) else value) + "`"


def _default(f, groups: dict[str, str]) -> str:
    if f.name in ENV_DEFAULTS:
        return f"`{ENV_DEFAULTS[f.name]}`"
    if f.name in groups:
        return _shown(groups[f.name])
    if f.default is MISSING:  # a nested section (recompute, probes): its keys are in conf/config.yaml
        return "conf/config.yaml"
    return _shown(f.default)


def rows(conf: Path = REPO / "conf") -> list[tuple[str, str, str]]:
    """(knob cell, default cell, meaning) per README row, in the schema's order."""
    groups = group_defaults(conf)
    members: dict[str, list] = {}
    for f in fields(RunSchema):
        members.setdefault(f.metadata.get("row") or f.name, []).append(f)
    out = []
    for lead, fs in members.items():
        names = [f"`{f.name}=`" if f.name in groups else f"`{f.name}`" for f in fs]
        defaults = [_default(f, groups) for f in fs]
        if len(fs) > 1 and not lead.startswith("key_"):  # `bits` sets `key_bits` and `value_bits`
            knob = f"{names[0]} / {', '.join(names[1:])}"
            default = f"{defaults[0]} / {', '.join(defaults[1:])}"
        else:
            knob, default = ", ".join(names), ", ".join(defaults)
        out.append((knob, default, fs[0].metadata.get("doc", "")))
    return out


def markdown(conf: Path = REPO / "conf") -> str:
    lines = ["| knob | default | meaning |", "|---|---|---|"]
    lines += [f"| {k} | {d} | {m} |" for k, d, m in rows(conf)]
    return "\n".join(lines)


def readme_table(text: str) -> str | None:
    """The table between the README's markers, or None when they are missing."""
    m = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), text, re.S)
    return m.group(1).rstrip("\n") if m else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="replace the table in README.md")
    args = ap.parse_args(argv)
    table = markdown()
    if not args.write:
        print(table)
        return 0
    path = REPO / "README.md"
    text = path.read_text()
    if readme_table(text) is None:
        raise SystemExit(f"README.md lacks the markers {BEGIN!r} ... {END!r}: put them around the knob table")
    path.write_text(
        re.sub(re.escape(BEGIN) + r"\n.*?" + re.escape(END), lambda _: f"{BEGIN}\n{table}\n{END}", text, flags=re.S)
    )
    print("README.md: knob table written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
