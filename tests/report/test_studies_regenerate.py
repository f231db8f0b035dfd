"""Every committed study table is what its script makes from the study's committed records, byte for byte, read
through the one verified reader (kvq_lab/report/study.py); the agreement tables the KIVI axis README quotes come out
of agreement.py again; a table nobody regenerates fails the inventory test.

Each study script exposes `records()` (its records, verified, of its models) and `tables(records)` ({file name in
its folder: text}); scripts/make_table.py's studies go through `make_report`. The two scripts that need the real
model (the stored bytes of mixed_precision's searched rows and of recompute's caches) run in the slow test."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXP = REPO / "experiments"

SCRIPTS = {  # experiments/<script> -> the tables it writes, relative to its folder
    "behavior/make_table.py": ["table.md"],
    "fidelity/make_figure.py": ["table.md"],
    "fidelity/make_long_table.py": ["long_context_table.md"],
    "field_methods/table.py": ["table.md"],
    "kivi_axis_table/paired.py": ["paired.md"],  # paired differences with the noise floor beside each
    "llama_cpp_parity/table.py": ["table.md"],
    "long_context/make_table.py": ["table.md"],
    "long_context/make_probe_figure.py": ["probe_layers.md"],
    "methods/table.py": ["table.md"],
    "policies/make_table.py": ["table.md", "README.md"],  # the README's Result section holds the same tables
    "throughput/make_figure.py": ["table.md"],
}
MODEL_SCRIPTS = {"mixed_precision/table.py": ["table.md"], "recompute/table.py": ["table.md"]}
MAKE_TABLE = {  # table -> (experiment, --model) of scripts/make_table.py, as the study's README runs it
    "bits/table.md": ("bits", None),
    "formats/table.md": ("formats", None),
    "group_size/table.md": ("group_size", None),
    "kivi_residual/table.md": ("kivi_residual", None),
    "rope_order/table.md": ("rope_order", None),
    "kivi_axis_table/table.md": ("kivi_axis_table", "smollm2-135m"),
    "kivi_axis_table/gemma3-270m/table.md": ("kivi_axis_table", "gemma3-270m"),
}


def script(rel: str, monkeypatch):
    """experiments/<rel> as a module (its folder is no package), with the repo as the working directory."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts put the repo and scripts/ on it
    name = "study_" + rel.replace("/", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, EXP / rel)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def same(path: Path, text: str) -> None:
    committed = path.read_text()
    if committed != text:
        got, want = text.splitlines(), committed.splitlines()
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        pytest.fail(
            f"{path.relative_to(REPO)} is not what its records make now (line {first + 1}):\n"
            f"  committed:   {want[first] if first < len(want) else '<end>'}\n"
            f"  regenerated: {got[first] if first < len(got) else '<end>'}"
        )


@pytest.mark.parametrize("rel", sorted(SCRIPTS))
def test_a_study_script_regenerates_its_tables(rel, monkeypatch):
    mod = script(rel, monkeypatch)
    out = mod.tables(mod.records())
    assert sorted(out) == sorted(SCRIPTS[rel])
    for name, text in out.items():
        same((EXP / rel).parent / name, text)


@pytest.mark.parametrize("table", sorted(MAKE_TABLE))
def test_make_table_regenerates_its_studies(table, monkeypatch):
    from kvq_lab.report.tables import make_report

    monkeypatch.chdir(REPO)  # probe records are joined from experiments/*/ (kvq_lab.report.rows.probe_folders)
    experiment, model = MAKE_TABLE[table]
    md, _ = make_report(EXP / experiment, experiment, None, model=model)
    same(EXP / table, md + "\n")


@pytest.mark.slow
@pytest.mark.parametrize("rel", sorted(MODEL_SCRIPTS))
def test_the_tables_that_need_the_model_regenerate(rel, monkeypatch):
    mod = script(rel, monkeypatch)
    out = mod.tables(mod.records())
    assert sorted(out) == sorted(MODEL_SCRIPTS[rel])
    for name, text in out.items():
        same((EXP / rel).parent / name, text)


def test_every_committed_table_is_regenerated_here():
    """The inventory: every table committed under experiments/ is one of the above. What is left out is written by a
    tool run, not made from records: benchmark and profiler outputs (records/, profile/), the GPU check's outputs
    (experiments/kernels/), and the READMEs (their hand-written prose quotes the tables)."""
    files = subprocess.run(["git", "ls-files", "experiments"], capture_output=True, text=True, cwd=REPO, check=True)
    tables = {
        f.removeprefix("experiments/")
        for f in files.stdout.split()
        if f.endswith(".md") and not f.endswith("README.md")
        and not any(part in ("records", "profile", "kernels") for part in Path(f).parts)
    }  # fmt: skip
    covered = set(MAKE_TABLE) | {
        str(Path(rel).parent / name) for group in (SCRIPTS, MODEL_SCRIPTS) for rel, names in group.items()
        for name in names if name != "README.md"
    }  # fmt: skip
    assert tables == covered, f"not regenerated: {sorted(tables - covered)}; gone: {sorted(covered - tables)}"


def test_agreement_tables_of_the_kivi_readme_regenerate(monkeypatch):
    """agreement.py's rows are the README's, model by model (it read Gemma's newer records of the same cache labels
    and reported 48/297 identical 16-bit answers where the README says 297/297)."""
    mod = script("kivi_axis_table/agreement.py", monkeypatch)
    k = EXP / "kivi_axis_table"
    readme = (k / "README.md").read_text()
    for b in ("prefix_reuse", "batched"):
        rows = mod.table(k, k / b).splitlines()[2:]
        assert len(rows) == 6 and rows[0].startswith("| `K16b_V16b_sim` | 297/297 | 34.42 | 34.42 | +0.00 ± 0.00 |")
        for row in rows:
            assert row in readme, f"{b}: {row}"

    def cells(a, b):
        return [[c.strip() for c in row.strip("|").split("|")] for row in mod.table(a, b).splitlines()[2:]]

    against = zip(cells(k, k / "continuous"), cells(k / "prefix_reuse", k / "continuous"), strict=True)
    for a, r in against:  # one README table: the cache, then identical and paired F1 against each
        line = f"| {a[0]} | {a[1]} | {a[4]} | {r[1]} | {r[4]} |"
        assert line in readme, line


def test_the_cache_speed_readme_holds_the_tables_its_records_make(monkeypatch):
    mod = script("cache_speed/figure.py", monkeypatch)
    readme = (EXP / "cache_speed" / "README.md").read_text()
    for table in mod.readme_tables(mod.load()):
        assert table in readme, table.splitlines()[0]


# -- no committed file names a path of one machine ------------------------------------------------------------------
# A root only some machine has: a home, a workspace, a scratch or temporary folder. `(?<![\w.~-])`: not the tail of a
# relative path (experiments/tmp/...) or of a URL (https://host/home/...).
MACHINE_PATH = r"(?<![\w.~-])/(?:work|root|home|Users|tmp|mnt|scratch)/[\w.$-]"
# What may name one, and why. Sealed run records (`runs/<run>/`): their digest covers every byte, and they say where
# they ran (env, data_dir), which is what a record is for. Verbatim outputs of a tool run kept as evidence (benchmark
# records/ and profile/ folders, .log files, the GPU check's outputs): the command lines they quote are what ran.
EXEMPT_DIRS = ("runs", "records", "profile")
EXEMPT_FILES = {
    "scripts/gpu_check.sh": "runs on the GPU machine, whose Python it extends through a temporary folder there",
}


def exempt(path: str) -> bool:
    parts = Path(path).parts
    return (
        path in EXEMPT_FILES
        or any(d in parts[:-1] for d in EXEMPT_DIRS)
        or path.endswith(".log")
        or path.startswith("experiments/kernels/gpu_check/")
    )


def test_no_committed_file_names_a_path_of_one_machine():
    """Study commands use `../shared/data` and a relative `results_dir`; docs and scripts name no one's home,
    workspace or /tmp folder (they ran on one machine and must run on the next)."""
    import re

    pattern = re.compile(MACHINE_PATH)
    files = subprocess.run(["git", "ls-files", "-z"], capture_output=True, cwd=REPO, check=True).stdout.decode()
    found = []
    for f in filter(None, files.split("\0")):
        p = REPO / f
        if exempt(f) or not p.is_file():
            continue
        data = p.read_bytes()
        if b"\0" in data[:8192]:  # binary (PNG, Parquet)
            continue
        for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{f}:{n}: {line.strip()[:100]}")
    assert not found, "absolute paths of one machine (use ../shared/data, relative results_dir):\n" + "\n".join(found)
