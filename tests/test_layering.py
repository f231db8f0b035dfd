"""Dependencies point one way (STYLE habit 8): the import-linter contracts in pyproject.toml hold, and kvq_lab's
import graph has no cycle, neither between its top-level parts nor between any two of its modules.

Each check is paired with an injected violation that it must report, so a contract that checks nothing fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: import-linter depends on tomli there
    import tomli as tomllib
try:
    import grimp  # import-linter's graph builder
except ImportError:  # the dev extra installs it; the fixture says so
    grimp = None

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def graph():
    if grimp is None:
        pytest.fail("import-linter is not installed: pip install -e '.[dev]' (or pip install import-linter)")
    return grimp.build_graph("kvq_lab", cache_dir=None, exclude_type_checking_imports=True)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan): every import cycle, one list per loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def module_edges(graph) -> dict[str, set[str]]:
    mods = {m for m in graph.modules if m.startswith("kvq_lab.")}
    return {m: {i for i in graph.find_modules_directly_imported_by(m) if i in mods} for m in mods}


def part_edges(graph) -> tuple[dict[str, set[str]], dict[tuple[str, str], str]]:
    """Imports between top-level parts of kvq_lab (kvq_lab.cache, kvq_lab.run.config, ...), with one example each."""
    edges: dict[str, set[str]] = {}
    example: dict[tuple[str, str], str] = {}
    for m, imported in module_edges(graph).items():
        a = ".".join(m.split(".")[:2])
        for i in imported:
            b = ".".join(i.split(".")[:2])
            if a != b:
                edges.setdefault(a, set()).add(b)
                example.setdefault((a, b), f"{m} -> {i}")
    return edges, example


def test_contracts_hold():
    """`lint-imports` with the contracts in pyproject.toml (the pipeline layers, the cache's roles, kernels free of
    transformers) exits 0."""
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.fail(f"no {exe}: install the dev extra, pip install -e '.[dev]'")
    r = subprocess.run([str(exe), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


def test_no_cycle_between_parts(graph):
    edges, example = part_edges(graph)
    loops = cycles(edges)
    detail = [[example[(a, b)] for a in loop for b in loop if (a, b) in example] for loop in loops]
    assert not loops, f"import cycles between parts of kvq_lab: {detail}"


def test_no_cycle_between_modules(graph):
    """Stricter: no two modules import each other, even inside one package (a registry importing its plugins)."""
    assert not cycles(module_edges(graph))


def test_an_upward_import_is_caught(graph):
    """The checks can fail: a kernel importing the cache breaks the pipeline layers and makes a cycle."""
    g = grimp.build_graph("kvq_lab", cache_dir=None, exclude_type_checking_imports=True)  # a fresh graph to break
    g.add_import(importer="kvq_lab.kernels.cpu_kernel", imported="kvq_lab.cache.packed")
    edges, _ = part_edges(g)
    assert ["kvq_lab.cache", "kvq_lab.kernels"] in cycles(edges)
    assert any({"kvq_lab.kernels.cpu_kernel", "kvq_lab.cache.packed"} <= set(c) for c in cycles(module_edges(g)))

    contract = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    present = {m.split(".")[1] for m in graph.modules if m.startswith("kvq_lab.")}
    layers = []
    for spec in contract["layers"]:
        tails = {t.strip().strip("()") for t in spec.split("|")} & present  # optional "(x)" layers may be absent
        if tails:
            layers.append(tails)
    assert not graph.find_illegal_dependencies_for_layers(layers, containers={"kvq_lab"})  # as shipped
    broken = g.find_illegal_dependencies_for_layers(layers, containers={"kvq_lab"})
    assert {(d.importer, d.imported) for d in broken} == {("kvq_lab.kernels", "kvq_lab.cache")}
