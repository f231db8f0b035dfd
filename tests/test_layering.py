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
    g.add_import(importer="kvq_lab.kernels.cpu_kernel", imported="kvq_lab.cache.layers.packed")
    edges, _ = part_edges(g)
    assert ["kvq_lab.cache", "kvq_lab.kernels"] in cycles(edges)
    assert any({"kvq_lab.kernels.cpu_kernel", "kvq_lab.cache.layers.packed"} <= set(c) for c in cycles(module_edges(g)))

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


# --- capabilities, not names ------------------------------------------------------------------------------------------
# A check asks what a mode supports (`kvq_lab.cache.modes.Capabilities`), never compares its name, except in the mode's
# own module; the cache knows no task (a task declares the sequence it caches, `Task.cached_tokens`).
SCANNED = [*sorted((REPO / "kvq_lab").rglob("*.py")), REPO / "run.py", *sorted((REPO / "scripts").rglob("*.py"))]


def _strings(node) -> set[str]:
    """The string constants a comparison operand is made of: "x", or ("x", "y") / ["x"] / {"x"}."""
    import ast

    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def mode_name_comparisons(source: str, path: Path) -> list[str]:
    """`path:line` of every comparison with a mode's name (`x.mode == "packed"`, `"recompute" in modes`, `c.get("mode")
    != "simulated"`) outside that mode's own module (kvq_lab/cache/layers/<mode>.py)."""
    import ast

    from kvq_lab.cache.modes import MODES

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            names = set().union(*(_strings(o) for o in (node.left, *node.comparators))) & set(MODES)
            if names - {path.stem} or (names and path.parent != REPO / "kvq_lab" / "cache" / "layers"):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} compares {sorted(names)}")
    return found


def task_names_in(source: str, path: Path) -> list[str]:
    """`path:line` of every string constant in `source` that is a registered task's name (docstrings included)."""
    import ast

    from kvq_lab.plugins import TASKS

    tasks = set(TASKS)
    return [
        f"{path.relative_to(REPO)}:{n.lineno} names task {n.value!r}"
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in tasks
    ]


def test_no_mode_name_is_compared_outside_its_module():
    found = [hit for p in SCANNED for hit in mode_name_comparisons(p.read_text(), p)]
    assert not found, "ask a capability (CacheConfig.caps, kvq_lab.cache.modes), not the mode's name: " + str(found)


def test_the_cache_names_no_task():
    found = [hit for p in sorted((REPO / "kvq_lab" / "cache").rglob("*.py")) for hit in task_names_in(p.read_text(), p)]
    assert not found, "the cache knows no task (Task.cached_tokens declares what it caches): " + str(found)


def test_a_mode_or_task_name_is_caught():
    """The checks can fail: a mode compared by name in the runner, another mode's name in a mode module, and a task's
    name in the cache are each reported; a mode's own name in its module, and a default (`mode="packed"`), are not."""
    runner, packed, recompute = (
        REPO / "kvq_lab" / p for p in ("run/runner.py", "cache/layers/packed.py", "cache/layers/recompute.py")
    )
    assert mode_name_comparisons('if cfg.mode == "recompute":\n    pass\n', runner)
    assert mode_name_comparisons('x = c.get("mode") in ("packed", "simulated")\n', runner)
    assert mode_name_comparisons('ok = cfg.mode != "simulated"\n', packed)
    assert not mode_name_comparisons('ok = cfg.mode == "recompute"\n', recompute)
    assert not mode_name_comparisons('c = replace(cfg, mode="packed")\n', runner)
    accounting = REPO / "kvq_lab" / "cache" / "accounting.py"
    assert task_names_in('if t.get("name") in ("ppl", "fidelity"):\n    pass\n', accounting)


MAX_LINES = 400  # a module holds one role (STYLE habit 9): past this it is usually two; split it along the seam


def long_modules(paths: list[Path], root: Path = REPO, limit: int = MAX_LINES) -> list[str]:
    """'path: N lines' (relative to `root`) for each file over `limit` lines."""
    out = []
    for p in paths:
        n = len(p.read_text().splitlines())
        if n > limit:
            out.append(f"{p.relative_to(root)}: {n} lines")
    return out


def test_no_module_is_over_400_lines():
    found = long_modules(sorted((REPO / "kvq_lab").rglob("*.py")))
    assert not found, f"split these along a seam (one role per module, at most {MAX_LINES} lines): {found}"


def test_a_long_module_is_caught(tmp_path):
    """The check can fail: a file of 401 lines is reported, one of 400 is not."""
    long, short = tmp_path / "long.py", tmp_path / "short.py"
    long.write_text("x = 1\n" * (MAX_LINES + 1))
    short.write_text("x = 1\n" * MAX_LINES)
    assert long_modules([long, short], tmp_path) == [f"long.py: {MAX_LINES + 1} lines"]
