"""Install: Triton is an optional dependency. Without it ftopt imports and steps eagerly,
and asking for a fused step says how to install it."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent

WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # as if Triton were not installed
import torch, ftopt
tx = ftopt.adamw(1e-2)
params = {"w": torch.randn(5, 3)}
state = tx.init(params)
new, state = ftopt.step(tx, params, {"w": torch.randn(5, 3)}, state)
assert int(state[0].count) == 1 and not torch.equal(new["w"], params["w"])
try:
    ftopt.step(tx, params, {"w": torch.randn(5, 3)}, state, backend="fused")
except RuntimeError as err:
    print(err)
else:
    raise AssertionError("a fused step without Triton ran")
"""


def test_steps_without_triton_and_says_how_to_install_it():
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True,
                            text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "pip install 'ftopt[gpu]'" in result.stdout, result.stdout


def test_triton_is_not_a_core_dependency():
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("triton") for d in project["dependencies"])
    extras = project["optional-dependencies"]
    assert any(d.startswith("triton") for d in extras["gpu"])
    assert any(d.startswith("triton") for d in extras["test"])  # the interpreter tests


def test_the_package_is_typed():
    """PEP 561: the marker ships in the package, so mypy and pyright read ftopt's hints."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    assert (ROOT / "ftopt" / "py.typed").is_file()
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "py.typed" in setuptools["package-data"]["ftopt"]
