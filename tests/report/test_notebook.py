"""notebooks/kivi_axis_table.ipynb runs top to bottom on a fixture results folder and shows table and figure."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from helpers_records import axis_table_results
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "kivi_axis_table.ipynb"


@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    results = axis_table_results(tmp_path / "results")
    monkeypatch.setenv("KVQ_RESULTS_DIR", str(results))
    monkeypatch.setenv("KVQ_FIGURE_DIR", str(tmp_path))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "\n".join(str(o.get("data", {}).get("text/markdown", "")) + str(o.get("text", "")) for o in outputs)
    assert "6 settings of 'kivi_axis_table'" in text and "| 2bit (K-C, V-T) |" in text and "| 63.53 |" in text
    assert any("image/png" in o.get("data", {}) for o in outputs)
    assert (tmp_path / "kivi_axis_table.png").exists()
