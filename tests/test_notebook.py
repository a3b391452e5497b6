"""notebooks/walkthrough.ipynb runs top to bottom (analyze → apply → bench → tune → report).

Needs nbformat, nbclient and ipykernel (skipped without them). The committed notebook
carries no outputs.
"""

import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "walkthrough.ipynb"


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def test_walkthrough_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    assert 'os.environ["TRITON_INTERPRET"] = "1"' in code[0].source


def test_walkthrough_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("ADVISOR_CACHE_DIR", str(tmp_path / "cache"))  # ceilings measured afresh
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebook's work dir lands here
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=240, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    t0 = time.monotonic()
    client.execute()  # raises CellExecutionError, with the cell's traceback, on any error
    print(f"walkthrough ran in {time.monotonic() - t0:.1f} s")
    out = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert "max |fused - eager|" in out and "bucket <= 8 tokens" in out
    (report,) = tmp_path.glob("advisor-walkthrough-*/report.html")
    page = report.read_text(encoding="utf-8")
    assert page.count("<svg") == 3 and "Tuning history" in page and "rms_norm" in page
