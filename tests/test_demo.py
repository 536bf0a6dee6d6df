"""The demo (``python -m ftopt demo``): a short run writes its table and loss curves, and
says so when matplotlib is missing."""

from __future__ import annotations

import pytest

from ftopt import __main__ as cli
from ftopt import demo

pytestmark = pytest.mark.usefixtures("one_thread")


def test_demo_writes_table_and_png(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the PNG needs matplotlib (.[test])")
    assert cli.main(["demo", "--steps", "10", "--no-progress", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in (tmp_path / "results.md").read_text().splitlines()
            if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + 7  # the header and one row per optimizer
    assert rows[1].startswith("| adamw |") and rows[1] in out
    assert (tmp_path / "losses.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "best:" in out and "ftopt plan (donated step)" in out


def test_demo_without_matplotlib_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(demo, "Figure", None)
    demo.main(["--steps", "10", "--no-progress", "--out", str(tmp_path)])
    assert "not drawn (matplotlib is not installed" in capsys.readouterr().out
    assert (tmp_path / "results.md").exists() and not (tmp_path / "losses.png").exists()


def test_unknown_command_prints_usage(capsys):
    assert cli.main([]) == 2 and cli.main(["train"]) == 2
    assert "usage: python -m ftopt" in capsys.readouterr().err
