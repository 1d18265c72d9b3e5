"""Both notebooks run top to bottom in a fresh kernel; their cells assert on results they compute
independently (e.g. a single-process torch reference), so a wrong answer fails here as an error does."""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["quickstart.ipynb", "muon.ipynb"])
def test_notebook_runs_without_errors(name, tmp_path):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    # "python3" is the kernel of the interpreter running the tests (jupyter_client maps it to
    # sys.executable), so the notebook sees the same environment and hpf as the tests.
    client = NotebookClient(notebook, kernel_name="python3", timeout=180,
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on the first failure
    errors = [o for cell in notebook.cells for o in cell.get("outputs", []) if o.output_type == "error"]
    assert not errors
