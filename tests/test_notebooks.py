"""The notebooks run top to bottom (their code cells, in order, in one namespace)."""

import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, capsys):
    cells = json.loads(path.read_text())["cells"]
    namespace: dict = {}
    for cell in cells:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{path.name}", "exec"), namespace)
    out = capsys.readouterr().out
    assert "untouched rows equal: True" in out and "used rows moved: True" in out


def test_there_is_a_notebook():
    assert NOTEBOOKS
