"""``FTOPT_KERNEL_SOURCES``: a folder of hand-edited kernels, each named as the generated
source it replaces (``ftopt_<key>.py``), runs in the real step in place of it, with a
warning; kernels it does not name are generated as before."""

from __future__ import annotations

import hashlib
import os
import pathlib
import sys
import warnings

import pytest
import torch

import ftopt
from ftopt.lowering import codegen, lanes, launch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import raw_select_edit  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _key(source: str) -> str:
    """The name codegen.compile_source gives a source's file (``ftopt_<key>.py``)."""
    return hashlib.sha256(source.encode()).hexdigest()[:24]


def _clear_launch_caches() -> None:
    for cache in (launch._kernel, launch._constants_cached):
        cache.cache_clear()


def _step(params, grads) -> tuple:
    tx = ftopt.sgd(0.1)
    return ftopt.step(tx, params, grads, tx.init(params), backend="fused")


def test_an_edited_kernel_runs_in_place_of_the_generated_one(monkeypatch, tmp_path):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    params = {"w": torch.randn(3000, generator=gen).to(DEVICE)}
    grads = {"w": torch.randn(3000, generator=gen).to(DEVICE)}
    new: set = set()  # the keys of the step's kernels (compiled now or before)
    real = codegen.compile_source

    def spy(source: str, name: str):
        new.add(_key(source))
        return real(source, name)

    _clear_launch_caches()
    monkeypatch.setattr(codegen, "compile_source", spy)
    want, _ = _step(params, grads)
    monkeypatch.setattr(codegen, "compile_source", real)
    assert new and new <= set(codegen._MODULES)
    try:
        for key in new:
            name = f"ftopt_{key}.py"
            with open(os.path.join(codegen._CACHE_DIR, name)) as f:
                source = f.read()
            assert "tl.store(p_out + offs, " in source
            # the edit: every stored param zero
            edited = source.replace("tl.store(p_out + offs, ", "tl.store(p_out + offs, 0.0 * ")
            (tmp_path / name).write_text(edited)
            del codegen._MODULES[key]
        _clear_launch_caches()
        monkeypatch.setattr(codegen, "_SOURCES", str(tmp_path))
        with pytest.warns(UserWarning, match="FTOPT_KERNEL_SOURCES"):
            got, _ = _step(params, grads)
        assert torch.equal(got["w"], torch.zeros_like(got["w"]))
        assert not torch.equal(want["w"], torch.zeros_like(want["w"]))  # (the control)
        # A folder without the kernel's name: the generated kernel, no warning.
        for key in new:
            del codegen._MODULES[key]
        _clear_launch_caches()
        monkeypatch.setattr(codegen, "_SOURCES", str(tmp_path / "none"))
        again, _ = _step(params, grads)
        assert torch.equal(again["w"], want["w"])
    finally:  # (no edited kernel stays compiled for the tests after this one)
        for key in new:
            codegen._MODULES.pop(key, None)
        _clear_launch_caches()


def test_selects_on_the_stored_words_keep_the_generated_kernels_bits(monkeypatch, tmp_path):
    """benchmarks/raw_select_edit.py's kernel shape (Adam's select kernel over bf16 params
    and states, its skip_zeros selects on the stored 16-bit words) steps as the generated
    kernel does, bit for bit: zeros, a NaN param, a NaN gradient, two steps."""
    monkeypatch.setattr(lanes, "BF16_CONVERT", True)  # (the GPU's conversions)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)

    def tree() -> dict:
        return {"a": torch.randn(3000, generator=gen).to(DEVICE, torch.bfloat16),
                "b": torch.randn(4096 + 700, generator=gen).to(DEVICE, torch.bfloat16)}

    params, first, grads = tree(), tree(), tree()
    grads["a"][::3] = 0.0
    grads["b"][:1000] = 0.0
    params["a"][5], grads["a"][6] = float("nan"), float("nan")
    sources: dict = {}
    real = codegen.compile_source

    def spy(source: str, name: str):
        sources[_key(source)] = source
        return real(source, name)

    def run() -> list:
        tx = ftopt.adam(1e-2, state_dtype=torch.bfloat16, skip_zeros=True)
        p, s = ftopt.step(tx, params, first, tx.init(params), backend="fused")
        p, s = ftopt.step(tx, p, grads, s, backend="fused")
        return ftopt.tree.leaves((p, s))

    _clear_launch_caches()
    monkeypatch.setattr(codegen, "compile_source", spy)
    want = run()
    monkeypatch.setattr(codegen, "compile_source", real)
    edited = {key: raw_select_edit.edit(src) for key, src in sources.items()}
    edited = {key: src for key, src in edited.items() if src is not None}
    assert edited, "no select kernel to edit"
    try:
        for key, src in edited.items():
            (tmp_path / f"ftopt_{key}.py").write_text(src)
            codegen._MODULES.pop(key, None)
        _clear_launch_caches()
        monkeypatch.setattr(codegen, "_SOURCES", str(tmp_path))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = run()
        assert any("FTOPT_KERNEL_SOURCES" in str(w.message) for w in caught)
        for a, b in zip(want, got):
            assert a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                                      b.reshape(-1).view(torch.uint8))
    finally:
        for key in sources:
            codegen._MODULES.pop(key, None)
        _clear_launch_caches()
