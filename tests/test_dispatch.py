"""The core finds its backends through ftopt.dispatch, by role; a backend that cannot be
imported (no Triton) leaves its role empty with the reason, and every entry point still
runs eagerly."""

from __future__ import annotations

import pytest
import torch

import ftopt
from ftopt import dispatch


@pytest.fixture
def no_fused_backend():
    saved = dispatch._MODULES["fused"]
    dispatch.install("fused", "ftopt_no_such_backend")
    yield
    dispatch.install("fused", saved)


def test_a_backend_that_cannot_be_imported_says_why(no_fused_backend):
    assert dispatch.backend("fused") is None
    assert "ftopt_no_such_backend" in dispatch.missing("fused")


def test_steps_and_updates_run_eagerly_without_the_fused_backend(no_fused_backend):
    tx = ftopt.adamw(1e-2, weight_decay=0.1, skip_zeros=True)
    gen = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(6, 4, generator=gen)}
    grads = {"w": torch.randn(6, 4, generator=gen)}
    state = tx.init(params)
    new, _ = ftopt.step(tx, params, grads, state)
    updates, _ = tx.update(grads, state, params)
    assert torch.equal(new["w"], ftopt.apply_updates(params, updates)["w"])
    with pytest.raises(RuntimeError, match="cannot fuse: the fused backend cannot be imported"):
        ftopt.step(tx, params, grads, state, backend="fused")
    with pytest.raises(RuntimeError, match="update.backend='fused'. cannot fuse"):
        tx.update(grads, state, params, backend="fused")


def test_the_installed_backends():
    from ftopt.chunked import entry as chunked
    from ftopt.lowering import entry as fused
    from ftopt.lowering import op

    assert dispatch.backend("fused") is fused and dispatch.missing("fused") is None
    assert dispatch.backend("chunked") is chunked and dispatch.backend("compile") is op
    assert dispatch.backend("no-such-role") is None
    assert dispatch.missing("no-such-role") == "no no-such-role backend is installed"
