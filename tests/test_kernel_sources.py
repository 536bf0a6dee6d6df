"""``FTOPT_KERNEL_SOURCES``: a folder of hand-edited kernels, each named as the generated
source it replaces (``ftopt_<key>.py``), runs in the real step in place of it, with a
warning; kernels it does not name are generated as before."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from step_checks import fresh_generator

import ftopt
from ftopt.lowering import codegen, kernel_files, launch

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
    gen = fresh_generator()
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
    assert new and new <= set(kernel_files._MODULES)
    try:
        for key in new:
            name = f"ftopt_{key}.py"
            with open(os.path.join(kernel_files._CACHE_DIR, name)) as f:
                source = f.read()
            assert "tl.store(p_out + offs, " in source
            # the edit: every stored param zero
            edited = source.replace("tl.store(p_out + offs, ", "tl.store(p_out + offs, 0.0 * ")
            (tmp_path / name).write_text(edited)
            del kernel_files._MODULES[key]
        _clear_launch_caches()
        monkeypatch.setattr(kernel_files, "_SOURCES", str(tmp_path))
        with pytest.warns(UserWarning, match="FTOPT_KERNEL_SOURCES"):
            got, _ = _step(params, grads)
        assert torch.equal(got["w"], torch.zeros_like(got["w"]))
        assert not torch.equal(want["w"], torch.zeros_like(want["w"]))  # (the control)
        # A folder without the kernel's name: the generated kernel, no warning.
        for key in new:
            del kernel_files._MODULES[key]
        _clear_launch_caches()
        monkeypatch.setattr(kernel_files, "_SOURCES", str(tmp_path / "none"))
        again, _ = _step(params, grads)
        assert torch.equal(again["w"], want["w"])
    finally:  # (no edited kernel stays compiled for the tests after this one)
        for key in new:
            kernel_files._MODULES.pop(key, None)
        _clear_launch_caches()

