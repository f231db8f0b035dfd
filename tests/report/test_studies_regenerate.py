"""Every committed study table is what `python -m kvq_lab.report <study>` makes from the study's committed records, byte
for byte, read through the one verified reader (kvq_lab/report/study.py); the agreement tables the KIVI axis README
quotes come out of kvq_lab.report.agreement again; a table nobody regenerates fails the inventory test.

Each study is a module of kvq_lab/report/studies/ (registered in STUDIES) exposing `records(folder)` (its records,
verified, of its models) and `tables(records)` ({file name in its folder: text}). The two studies that need the real
model (the stored bytes of mixed_precision's searched rows and of recompute's caches) run in the slow test."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvq_lab.report.__main__ import main
from kvq_lab.report.studies import STUDIES, load

REPO = Path(__file__).resolve().parents[2]
EXP = REPO / "experiments"

TABLES = {  # study -> the tables it writes, relative to experiments/<study>/
    "backend_agreement": [],  # a figure only: the README quotes its numbers
    "behavior": ["table.md"],
    "bits": ["table.md"],
    "cache_speed": [],  # the README holds its tables (test_the_cache_speed_readme_holds_the_tables_its_records_make)
    "fidelity": ["table.md", "long_context_table.md"],
    "field_methods": ["table.md"],
    "formats": ["table.md"],
    "frontier": [  # per model searched: frontier_<model>/report.md, and llama_cpp_check/<model>/check.md
        "frontier_smollm2-135m/report.md",
        "frontier_gemma3-270m/report.md",
        "llama_cpp_check/smollm2-135m/check.md",
        "llama_cpp_check/gemma3-270m/check.md",
    ],
    "group_size": ["table.md"],
    "kivi_axis_table": ["table.md", "gemma3-270m/table.md", "paired.md"],  # paired.md: the noise floor beside each
    "kivi_residual": ["table.md"],
    "llama_cpp_parity": ["table.md"],
    "long_context": ["table.md", "probe_layers.md"],
    "methods": ["table.md"],
    "policies": ["table.md", "README.md"],  # the README's Result section holds the same tables
    "rope_order": ["table.md"],
    "throughput": ["table.md"],
}
MODEL_STUDIES = {"mixed_precision": ["table.md"], "recompute": ["table.md"]}  # they load the real model


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


def regenerate(study: str, names: list[str], monkeypatch) -> None:
    monkeypatch.chdir(REPO)  # probe records are joined from experiments/*/ (kvq_lab.report.rows.probe_folders)
    mod = load(study)
    out = mod.tables(mod.records(EXP / study))
    assert sorted(out) == sorted(names)
    for name, text in out.items():
        same(EXP / study / name, text)


@pytest.mark.parametrize("study", sorted(TABLES))
def test_a_study_regenerates_its_tables(study, monkeypatch):
    regenerate(study, TABLES[study], monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("study", sorted(MODEL_STUDIES))
def test_the_tables_that_need_the_model_regenerate(study, monkeypatch):
    regenerate(study, MODEL_STUDIES[study], monkeypatch)


# recompute's rows need no model; its bytes do
@pytest.mark.parametrize("study", sorted(TABLES) + ["recompute"])
def test_a_study_gives_its_rows_as_a_dataframe(study, monkeypatch):
    import pandas as pd

    monkeypatch.chdir(REPO)
    mod = load(study)
    df = mod.rows(mod.records(EXP / study))
    assert isinstance(df, pd.DataFrame) and len(df) > 0 and len(df.columns) > 1


def test_every_registered_study_is_checked_here():
    assert set(STUDIES) == set(TABLES) | set(MODEL_STUDIES)


def test_the_command_checks_lists_and_refuses(tmp_path, monkeypatch, capsys):
    """`--check` passes on the committed tables and names the one that differs (exit 1) without writing; `--list`
    names every study; an unknown study is one line naming the known ones, exit 2."""
    monkeypatch.chdir(REPO)
    assert main(["behavior", "--check"]) == 0
    shutil.copytree(EXP / "behavior", tmp_path / "behavior")
    table = tmp_path / "behavior" / "table.md"
    table.write_text(table.read_text().replace("|", "!", 1))
    assert main(["behavior", "--check", "--experiments", str(tmp_path)]) == 1
    assert str(table) in capsys.readouterr().err
    assert table.read_text().startswith("!")  # --check wrote nothing
    assert main(["--list"]) == 0
    assert capsys.readouterr().out.split() == sorted(STUDIES)
    assert main(["nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'nope'" in err[0] and "policies" in err[0]


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
    covered = {
        f"{study}/{name}" for group in (TABLES, MODEL_STUDIES) for study, names in group.items() for name in names
        if name != "README.md"
    }  # fmt: skip
    assert tables == covered, f"not regenerated: {sorted(tables - covered)}; gone: {sorted(covered - tables)}"


def test_agreement_tables_of_the_kivi_readme_regenerate():
    """kvq_lab.report.agreement's rows are the README's, model by model (it read Gemma's newer records of the same
    cache labels and reported 48/297 identical 16-bit answers where the README says 297/297)."""
    from kvq_lab.report import agreement as mod

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


def test_the_cache_speed_readme_holds_the_tables_its_records_make():
    mod = load("cache_speed")
    readme = (EXP / "cache_speed" / "README.md").read_text()
    for table in mod.readme_tables(mod.records(EXP / "cache_speed")):
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


def test_the_frontier_figure_is_drawn_per_model_by_the_study_protocol(tmp_path, monkeypatch):
    """`python -m kvq_lab.report frontier` calls `figure(records, folder)`: each searched model's frontier.png."""
    monkeypatch.chdir(REPO)
    mod = load("frontier")
    recs = mod.records(EXP / "frontier")
    mod.figure(recs, tmp_path)
    assert sorted(p.parent.name for p in tmp_path.glob("*/frontier.png")) == [f"frontier_{m}" for m in sorted(recs)]
