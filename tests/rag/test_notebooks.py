"""The example notebooks run top to bottom in a real Jupyter kernel, and are committed without outputs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "examples" / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks_and_they_are_stripped():
    assert {p.stem for p in NOTEBOOKS} >= {"retrieval-experiments", "permissions", "answer-quality"}
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: outputs committed"


@pytest.fixture(scope="module")
def notebook_home(tmp_path_factory, model_cache):
    """One data directory for every notebook (the second ingest only checks what changed)."""
    home = tmp_path_factory.mktemp("notebook-home")
    (home / "models").symlink_to(model_cache, target_is_directory=True)
    return home


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_without_errors(path, notebook_home, monkeypatch):
    monkeypatch.setenv("LABRAG_NOTEBOOK_HOME", str(notebook_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    nb = nbformat.read(path, as_version=4)
    # A cell that raises fails the run (CellExecutionError names the cell and the traceback).
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute(env=dict(os.environ))
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    # the plots came out as images, the tables as HTML
    if path.stem == "retrieval-experiments":
        assert sum("image/png" in o.get("data", {}) for o in outputs) == 2
    assert any("text/html" in o.get("data", {}) for o in outputs)
