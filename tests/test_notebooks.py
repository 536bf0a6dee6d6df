"""The notebooks run top to bottom, and are kept in git without outputs.

Each notebook's code cells run in order in one namespace, in this process (no kernel to
start: a few seconds each on a CPU), with matplotlib's non-interactive backend, so
``plt.show()`` draws and discards. The notebooks check their own claims with ``assert``
(a failing one fails here); the printed lines named below are checked too. Stored
notebooks must validate against the nbformat schema (cell ids included) and hold no
outputs or execution counts: run them in Jupyter to see the plots, and clear the outputs
before committing (``jupyter nbconvert --clear-output --inplace notebooks/*.ipynb``).
"""

from __future__ import annotations

import json
import pathlib
import warnings

import pytest

ROOT = pathlib.Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Lines each notebook prints when what it shows holds.
PRINTS = {
    "quickstart.ipynb": ["untouched rows equal: True", "used rows moved: True"],
    "skip_zeros.ipynb": ["untouched rows equal: True", "their states are still zero: True",
                         "untouched rows equal in SparseAdam too: True"],
    "torch_func.ipynb": ["finite difference", "member 0, vmapped vs alone"],
    "eight_bit_and_memory.ipynb": ["8-bit states", "per parameter"],
    "porting.ipynb": ["ported step count: 30", "back in torch: step 70"],
    "matrix_optimizers.ipynb": ["final loss of each below half its first",
                                "normuon row moments"],
    "from_optax.ipynb": ["learning rate now 0.003", "per-example clipped accuracy",
                         "names found: True"],
}

pytestmark = pytest.mark.usefixtures("one_thread")


def _code_cells(path: pathlib.Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"]
            if c["cell_type"] == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, capsys, monkeypatch):
    matplotlib = pytest.importorskip("matplotlib", reason="the notebooks plot (.[test])")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.chdir(path.parent)
    namespace: dict = {"__name__": "__main__"}
    try:
        for index, source in enumerate(_code_cells(path)):
            exec(compile(source, f"{path.name} (code cell {index})", "exec"), namespace)
    finally:
        plt.close("all")
    out = capsys.readouterr().out
    for line in PRINTS[path.name]:
        assert line in out, f"{path.name} did not print {line!r}; it printed:\n{out}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
    nbformat = pytest.importorskip("nbformat", reason="the notebook checks need nbformat")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # MissingIDFieldWarning and the like fail here
        notebook = nbformat.reads(path.read_text(), as_version=4)
        nbformat.validate(notebook)
    for index, cell in enumerate(notebook.cells):
        assert cell.get("id"), f"{path.name}: cell {index} has no id"
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name}: code cell {index} holds outputs; clear them before committing")


def test_every_notebook_is_checked():
    assert {p.name for p in NOTEBOOKS} == set(PRINTS)
