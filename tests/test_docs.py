"""The README's Layout names the tree as it is: every path it lists exists (a fresh clone included: results/ is
tracked through its README)."""

from __future__ import annotations

import re
import subprocess

from helpers_models import REPO

PATH = re.compile(r"(?<![\w/.`-])((?:[\w.-]+/)+(?:[\w.-]+\.(?:py|c|yaml|md|sh))?|[\w-]+\.(?:py|c|yaml|md|sh|toml))")


def layout_paths() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    found = []
    for line in block.splitlines():
        head = line[:18].strip()  # the first column: the path the line describes
        if head:
            found.append(head)
        found += [m for m in PATH.findall(line[18:]) if m.startswith(("kvq_lab/", "results/", "scripts/"))]
    return found


def test_every_path_the_layout_names_exists():
    paths = layout_paths()
    assert {"run.py", "conf/", "kvq_lab/cache/", "experiments/", "results/", "tests/"} <= set(paths)
    assert [p for p in paths if not (REPO / p).exists()] == []


def test_every_top_level_folder_the_layout_names_is_in_git():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    top = {p.split("/")[0] for p in layout_paths() if "/" in p}
    assert [t for t in sorted(top) if not any(f.startswith(t + "/") for f in tracked)] == []
    assert "results/README.md" in tracked
