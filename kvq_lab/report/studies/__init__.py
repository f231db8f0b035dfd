"""The studies: one module per experiments/<study>/ folder, which turns the study's committed records into its tables
and figures (`python -m kvq_lab.report <study>`; kvq_lab/report/__main__.py).

A study module exposes
- `MODELS`: the model(s) whose records it reads (`kvq_lab.report.study.read` filters by them), None for a study of
  benchmark records (`bench_runs`), which name no model;
- `records(folder) -> R`: its records, read through the one verified reader (`kvq_lab.report.study`) from `folder`
  (experiments/<study>; a study that also reads a sibling study's records finds it beside `folder`);
- `rows(R) -> pandas.DataFrame`: the study's numbers, one line per table row (`studies.frame`), for notebooks;
- `tables(R) -> {file name: text}`: each table, by its path relative to `folder` (empty for a figure-only study),
  formatted from the records as committed (each regenerates byte for byte: tests/report/test_studies_regenerate.py);
- optionally `figure(R, folder)`: writes its PNG(s) into `folder`, and `text(R) -> str`: what the command prints
  beside the files (a README's tables that no file holds).

A new study is one module here plus one line in STUDIES. Modules are imported only when their study is asked for
(STUDIES holds module paths): matplotlib, or the model a study loads, costs nothing to the others.
"""

from __future__ import annotations

import importlib
from types import ModuleType

_PKG = "kvq_lab.report.studies"
PAPER = f"{_PKG}.paper"  # the generic table beside the paper's numbers (kvq_lab.report.tables.make_report)

STUDIES: dict[str, str] = {  # study (its folder under experiments/) -> the module that makes its tables
    "backend_agreement": f"{_PKG}.backend_agreement",
    "behavior": f"{_PKG}.behavior",
    "bits": PAPER,
    "cache_speed": f"{_PKG}.cache_speed",
    "fidelity": f"{_PKG}.fidelity",
    "field_methods": f"{_PKG}.field_methods",
    "formats": PAPER,
    "frontier": f"{_PKG}.frontier",  # its report per model (the search writes the same: kvq_lab/frontier/driver.py)
    "group_size": PAPER,
    "kivi_axis_table": f"{_PKG}.kivi_axis_table",
    "kivi_residual": PAPER,
    "llama_cpp_parity": f"{_PKG}.llama_cpp_parity",
    "long_context": f"{_PKG}.long_context",
    "methods": f"{_PKG}.methods",
    "mixed_precision": f"{_PKG}.mixed_precision",  # loads the model: the stored bytes of searched rows
    "policies": f"{_PKG}.policies",
    "recompute": f"{_PKG}.recompute",  # loads the model: the bytes each cache stores
    "rope_order": PAPER,
    "throughput": f"{_PKG}.throughput",
}


def load(study: str) -> ModuleType:
    """The module of `study`; KeyError naming the known ones for an unknown name."""
    if study not in STUDIES:
        raise KeyError(f"unknown study {study!r}; known: {', '.join(sorted(STUDIES))}")
    return importlib.import_module(STUDIES[study])
