"""The fused backend's environment variables (ftopt.lowering.knobs): every one the package
reads is declared with its form and help, and a value not of its form is an error naming
the variable and the form, raised as ftopt is imported."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from ftopt.lowering import __main__ as listing
from ftopt.lowering import knobs

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FTOPT_")}
    environ.update(env, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=environ, cwd=ROOT, timeout=300)


def test_every_variable_the_package_reads_is_declared():
    assert listing.DECLARING  # imported: their declarations ran
    named = set()
    for path in (ROOT / "ftopt").rglob("*.py"):
        named |= set(re.findall(r"\bFTOPT_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert len(named) > 40
    assert named - set(knobs.KNOBS) == set(), "read without a declaration"
    assert set(knobs.KNOBS) - named == set()
    for knob in knobs.KNOBS.values():
        assert knob.help and knob.form, knob.name
    table = knobs.table()
    for name, knob in knobs.KNOBS.items():
        assert f"{name}  (default {knob.default!r}" in table


# (variable, a value not of its form, a fragment of the error)
BAD = [
    ("FTOPT_BLOCK", "abc", "a power of two"),
    ("FTOPT_BLOCK", "384", "384 is not a power of two"),
    ("FTOPT_NUM_WARPS", "0", "0 is not a power of two"),
    ("FTOPT_IN_PLACE_TILE", "512", "BLOCKxWARPS"),
    ("FTOPT_QUANT_TILE", "256x3", "3 is not a power of two"),
    ("FTOPT_IN_PLACE_MAXNREG", "fp32:56", "'fp32:56' is not LAYOUT=VALUE"),
    ("FTOPT_SPAN", "16bit=4", "'16bit' is not a layout"),
    ("FTOPT_SPAN", "16-bit=3", "N a power of two, comma-separated"),
    ("FTOPT_CARVE_WARPS", "8-bit=6", "6 is not a power of two"),
    ("FTOPT_SKIP_MODES", "fp32=selekt", "'selekt' not among"),
    ("FTOPT_SKIP_MODES", "16-bit states=split+in-place", "'in-place' not among"),
    ("FTOPT_FAST_MATH", "8bit", "'8bit' is not a layout"),
    ("FTOPT_SELECT_WORDS", "16-bit states,indexd", "'indexd' is not a layout"),
    ("FTOPT_SELECT_TILE", "16-bit states=512x2/x", "LAYOUT=BLOCKxWARPS/MAXNREG"),
    ("FTOPT_SELECT_TILE", "16-bit states=512by2", "LAYOUT=BLOCKxWARPS or"),
    ("FTOPT_SKIP_WATCH", "false", '"0" or "1"'),
    ("FTOPT_WATCH_PERIOD", "0", "below 1"),
    ("FTOPT_SPLIT_SELECT_ABOVE", "high", "a number"),
    ("FTOPT_PDL", "yes", "one of 'defer', 'all', '0'; unset"),
    ("FTOPT_QUANT_ENCODER", "lg2rcp", "'lg2-rcp', 'search'; unset"),
    ("FTOPT_NATIVE", "off", '"0" or "1"'),
]


def test_a_value_not_of_its_form_names_the_variable_and_the_form():
    """Each module re-imported under each bad value, in one process."""
    code = f"""
import importlib, json, os, sys
import ftopt.lowering.__main__ as listing
out = []
for name, value, _ in {BAD!r}:
    os.environ[name] = value
    try:
        for module in listing.DECLARING:
            importlib.reload(module)
        out.append(None)
    except ValueError as e:
        out.append(str(e))
    del os.environ[name]
print(json.dumps(out))
"""
    result = _run(code)
    assert result.returncode == 0, result.stderr
    errors = json.loads(result.stdout.strip().splitlines()[-1])
    for (name, value, fragment), error in zip(BAD, errors):
        assert error is not None, f"{name}={value!r} was taken"
        assert f"environment variable {name}={value!r}: expected" in error, error
        assert fragment in error, (fragment, error)
        assert f"unset, it is {knobs.KNOBS[name].default!r}" in error


def test_values_of_their_form_take_effect():
    """The control case: well-formed values set what they name."""
    code = """
import json
from ftopt.lowering import half_tiles, streams, tiles
print(json.dumps([tiles.BLOCK, tiles.IN_PLACE_TILE, tiles.SKIP_MODES["fp32"],
                  tiles.SKIP_MODES["8-bit"], sorted(tiles.FAST_MATH), tiles.WATCH,
                  tiles.SPLIT_SELECT_ABOVE, half_tiles.SELECT, streams.PDL]))
"""
    result = _run(code, FTOPT_BLOCK="1024", FTOPT_IN_PLACE_TILE="256x2",
                  FTOPT_SKIP_MODES="fp32=select,8-bit=split+select", FTOPT_FAST_MATH="",
                  FTOPT_SKIP_WATCH="0", FTOPT_SPLIT_SELECT_ABOVE="0.5",
                  FTOPT_SELECT_TILE="16-bit states=512x4/64,16-bit=256x2", FTOPT_PDL="0",
                  TRITON_INTERPRET="0")
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got == [1024, [256, 2], "select", "split+select", [], False, 0.5,
                   {"16-bit states": [512, 4, 64], "16-bit": [256, 2, 0]}, "0"]


@pytest.mark.parametrize("setting", ["FTOPT_SKIP_MODES=16-bit=selekt", "FTOPT_BLOCK=100"])
def test_importing_ftopt_under_a_bad_value_says_which_and_why(setting):
    """The variables are read as ftopt is imported (it imports the backend's tables), so a
    mistyped one stops the import, before any step, with the variable in the message."""
    name, value = setting.split("=", 1)
    result = _run("import ftopt", TRITON_INTERPRET="1", **{name: value})
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ValueError: environment variable {name}={value!r}: expected")
    assert _run("import ftopt", TRITON_INTERPRET="1").returncode == 0


def test_the_listing_runs_as_a_module():
    result = subprocess.run([sys.executable, "-m", "ftopt.lowering"], capture_output=True,
                            text=True, cwd=ROOT, timeout=300,
                            env={**os.environ, "FTOPT_BLOCK": "1024"})
    assert result.returncode == 0, result.stderr
    assert "FTOPT_BLOCK  (default " in result.stdout
    assert "set to '1024'" in result.stdout
    assert result.stdout.count("\nFTOPT_") + 1 == len(knobs.KNOBS)


def test_explain_prints_the_settings_in_effect():
    code = """
import torch, ftopt
print(ftopt.explain(ftopt.adam(1e-3), {"w": torch.randn(8)}, file=open("/dev/null", "w")))
"""
    result = _run(code, FTOPT_PDL="0", FTOPT_FAST_MATH="8-bit")
    assert result.returncode == 0, result.stderr
    assert ("fused backend settings from the environment (python -m ftopt.lowering): "
            "FTOPT_FAST_MATH='8-bit', FTOPT_PDL='0'") in result.stdout
    assert "settings from the environment" not in _run(code).stdout
