"""benchmarks/compact_targets.py reads the GPU session's files into met / not met: each
threshold on its right side, and a missing section listed as not measured."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import compact_targets as ct  # noqa: E402


def _row(name, **kw):
    return dict(name=name, available=True, **kw)


def _results(of_copy_8, flash_ms, bf16_copy, call, cost, speedup):
    ours = "ftopt adam(state_bits=8) auto"
    single = {"rows": [_row(ours, ms=1.0, of_copy=of_copy_8),
                       _row("flashoptim FlashAdam (int8 states)", ms=flash_ms)]}
    layouts = {"tables": {"bf16 params, bf16 states: dense": {"rows": [
        _row("ftopt fused", of_copy=bf16_copy),
        _row("torch Adam fused (bf16 states)", call_vs_ftopt=call)]}},
        "summary": {f"{lay}: {kind}": {"cost_pct": cost, "speedup": speedup}
                    for lay in ct.SKIP_LAYOUTS for kind in ("dense", "sparse")}}
    return {"sections": {"eight_bit": {"single": single}, "layouts": layouts}}


def _met(rows):
    return {r["target"]: r["met"] for r in rows}


def test_thresholds_either_side():
    good = _met(ct.step_targets(_results(0.71, 1.21, 0.91, 2.01, 2.9, 1.26)))
    bad = _met(ct.step_targets(_results(0.69, 1.19, 0.89, 1.99, 3.1, 1.24)))
    measured = [t for t, m in good.items() if m is not None]
    assert len(measured) == 4 + 2 * len(ct.SKIP_LAYOUTS)
    assert all(good[t] for t in measured)
    assert not any(bad[t] for t in measured)
    # (the GPT-2 8-bit table and the 32-bit sections are absent: not measured)
    assert good["8-bit Adam, GPT-2: of copy"] is None
    assert good["32-bit Adam, GPT-2: of copy (no regression)"] is None


def test_skip_rows_from_the_ab_and_the_loop():
    ab = [dict(layout=lay, grads=g, variant=v, vs_off=(1.02 if g == "dense" else 0.78))
          for lay in ct.SKIP_LAYOUTS for g in ("dense", "sparse") for v in ("off", "watch")]
    loop = [dict(layout=lay, grads=g, median=(1 / 1.04 if g == "dense" else 1.30))
            for lay in ct.SKIP_LAYOUTS for g in ("dense", "sparse")]
    rows = ct.skip_targets(ab, loop)
    assert len(rows) == 2 * 2 * len(ct.SKIP_LAYOUTS)
    met = _met(rows)
    assert met["skip_zeros, fp32: dense, % over off (A/B)"] is True  # +2%
    assert met["skip_zeros, fp32: 90% zero rows, x off (A/B)"] is True  # 1.28x
    assert met["skip_zeros, fp32: dense, % over off (loop)"] is False  # +4%
    assert met["skip_zeros, fp32: 90% zero rows, x off (loop)"] is True  # 1.30x


def test_run_writes_the_targets_of_the_files_its_benchmarks_write(tmp_path, monkeypatch,
                                                                    capsys):
    """``--run DIR`` runs the three benchmarks into DIR and reads the files they write
    (each stood in for by the file name its script writes) into DIR/targets."""
    written = {"gpu_step.py": "gpu_results.json", "skip_watch_ab_gpu.py": "watch_ab.json",
               "skip_in_loop_gpu.py": "in_loop.json"}
    ab = [dict(layout=lay, grads=g, variant="watch", vs_off=1.01 if g == "dense" else 0.7)
          for lay in ct.SKIP_LAYOUTS for g in ("dense", "sparse")]
    loop = [dict(layout=lay, grads=g, median=1 / 1.05 if g == "dense" else 1.3)
            for lay in ct.SKIP_LAYOUTS for g in ("dense", "sparse")]
    contents = {"gpu_results.json": _results(0.8, 1.5, 0.95, 2.5, 1.0, 1.3),
                "watch_ab.json": ab, "in_loop.json": loop}
    ran = []

    def fake_run(cmd, check):
        script = pathlib.Path(cmd[1]).name
        assert (pathlib.Path(ct.HERE) / script).exists() and check
        name = written[script]
        assert name in (pathlib.Path(ct.HERE) / script).read_text()
        out = pathlib.Path(cmd[cmd.index("--out") + 1] if "--out" in cmd else cmd[2])
        out.mkdir(parents=True)
        (out / name).write_text(ct.json.dumps(contents[name]))
        ran.append(script)

    monkeypatch.setattr(ct.subprocess, "run", fake_run)
    monkeypatch.setattr(sys, "argv", ["compact_targets.py", "--run", str(tmp_path)])
    ct.main()
    assert ran == list(written)
    rows = ct.json.loads((tmp_path / "targets.json").read_text())
    met = _met(rows)
    assert met["bf16 params + states, GPT-2: of copy"] is True
    assert met["skip_zeros, fp32: dense, % over off (A/B)"] is True  # +1%
    assert met["skip_zeros, fp32: dense, % over off (loop)"] is False  # +5%
    assert "NOT met" in (tmp_path / "targets.md").read_text()
    assert "not met: skip_zeros" in capsys.readouterr().out
