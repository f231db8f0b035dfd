"""kvq_lab's import graph read from its source with `ast`, every import counted: module level, inside functions, and
under `if TYPE_CHECKING:` (an annotation names a type, so the module that defines it is a dependency all the same).

Two promises (STYLE habit 8): no import circle between kvq_lab's modules, and no module of a lower
layer imports a higher one, in the layer order of pyproject.toml's first import-linter contract. `lint-imports` and
tests/test_layering.py check the runtime graph (grimp's); this one also sees what grimp is told to skip.
Each check is paired with an injected violation it must report."""

from __future__ import annotations

import ast
from pathlib import Path

from test_layering import cycles

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: import-linter depends on tomli there
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of kvq_lab: dotted name -> (file, whether it is a package's __init__)."""
    found = {}
    for p in sorted((REPO / "kvq_lab").rglob("*.py")):
        parts = list(p.relative_to(REPO).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (p, package)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the kvq_lab modules it imports anywhere in its source (`from pkg import name` is `pkg.name` where
    that is a module, else `pkg`; relative imports resolved)."""
    mods = modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for m, (path, package) in mods.items():
        here = m.split(".") if package else m.split(".")[:-1]
        out = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out |= {owner(a.name) for a in node.names if a.name.split(".")[0] == "kvq_lab"}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
                if base.split(".")[0] != "kvq_lab":
                    continue
                out |= {owner(f"{base}.{a.name}") if f"{base}.{a.name}" in mods else owner(base) for a in node.names}
        graph[m] = out - {None, m}
    return graph


def layers() -> list[set[str]]:
    """The top-level parts of kvq_lab, top layer first, from pyproject.toml's pipeline contract."""
    contract = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    assert contract["containers"] == ["kvq_lab"], contract["name"]
    return [{t.strip().strip("()") for t in spec.split("|")} for spec in contract["layers"]]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """`a -> b` for every import of a part by a part of a lower layer, or by an independent part of the same layer
    (`run | report`); imports inside one part are that part's own contract's business."""
    rank = {part: i for i, layer in enumerate(layers()) for part in layer}
    bad = []
    for a, imported in sorted(graph.items()):
        pa = a.split(".")[1] if "." in a else None
        for b in sorted(imported):
            pb = b.split(".")[1] if "." in b else None
            if pa is None or pb is None or pa == pb:
                continue
            if rank[pa] >= rank[pb]:
                bad.append(f"{a} -> {b}")
    return bad


def test_every_part_has_a_layer():
    placed = set().union(*layers())
    parts = {m.split(".")[1] for m in modules() if "." in m}
    assert parts <= placed, f"parts of kvq_lab in no layer of pyproject.toml's contract: {sorted(parts - placed)}"


def test_no_import_cycle_counting_type_only_imports():
    loops = cycles(import_graph())
    assert not loops, "import cycles (type-only and function-level imports counted): " + "; ".join(
        " <-> ".join(loop) for loop in loops
    )


def test_no_lower_layer_imports_a_higher_one():
    bad = upward_imports(import_graph())
    assert not bad, "imports up the layers (pyproject.toml's pipeline contract): " + ", ".join(bad)


def test_a_type_only_import_upward_is_caught():
    """The checks can fail: the task registry naming the run config's old home under TYPE_CHECKING (the circle
    before the contract moved down) is a cycle and an upward import; a function-level import counts the same."""
    graph = import_graph()
    graph["kvq_lab.tasks"] = graph["kvq_lab.tasks"] | {"kvq_lab.run.config"}
    assert any({"kvq_lab.tasks", "kvq_lab.run.config"} <= set(c) for c in cycles(graph))
    assert "kvq_lab.tasks -> kvq_lab.run.config" in upward_imports(graph)
    graph = import_graph()
    graph["kvq_lab.common.errors"] = graph["kvq_lab.common.errors"] | {"kvq_lab.lmeval.cli"}
    assert "kvq_lab.common.errors -> kvq_lab.lmeval.cli" in upward_imports(graph)


def test_the_graph_sees_every_kind_of_import():
    """Relative, function-level and TYPE_CHECKING imports of the real tree are in the graph."""
    graph = import_graph()
    assert "kvq_lab.tasks" in graph["kvq_lab.tasks.ppl"]  # `from . import Task` in kvq_lab/tasks/ppl.py
    assert "kvq_lab.contract" in graph["kvq_lab.tasks.ppl"]  # under TYPE_CHECKING there
    assert "kvq_lab.plugins" in graph["kvq_lab.run.config"]  # inside a function
