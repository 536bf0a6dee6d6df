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


def test_cached_fused_calls_do_not_scan_for_dtensors(monkeypatch):
    """Once ``torch.distributed.tensor`` is imported, a step or update over the tables of
    an earlier one (their tensor check proves plain tensors) looks for no DTensor leaf;
    any other call does."""
    import torch.distributed.tensor  # noqa: F401 - what Trainer-style libraries import

    from ftopt import shards

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(5)
    params = {f"l{i}": torch.randn(5, generator=gen).to(device) for i in range(3)}
    grads = [{k: torch.randn(5, generator=gen).to(device) for k in params}
             for _ in range(2)]
    tx = ftopt.adam(1e-2)
    scans = []
    real = shards.any_dtensor
    monkeypatch.setattr(shards, "any_dtensor", lambda *t: scans.append(1) or real(*t))

    def scanned(call) -> int:
        scans.clear()
        call()
        return len(scans)

    state = tx.init(params)
    assert scanned(lambda: ftopt.step(tx, params, grads[0], state, backend="fused")) == 1
    assert scanned(lambda: ftopt.step(tx, params, grads[1], state, backend="fused")) == 0
    donated = [{k: v.clone() for k, v in params.items()}, tx.init(params)]

    def donated_step(g):
        donated[:] = ftopt.step(tx, *donated[:1], g, donated[1], donate=True,
                                backend="fused")
    assert scanned(lambda: donated_step(grads[0])) == 1
    assert scanned(lambda: donated_step(grads[1])) == 0  # new gradient tensors
    assert scanned(lambda: tx.update(grads[0], state, params, backend="fused")) == 1
    assert scanned(lambda: tx.update(grads[1], state, params, backend="fused")) == 0
    # Not the planned tree: the full path, after the scan.
    fewer = {k: params[k] for k in ("l0", "l1")}
    assert scanned(lambda: ftopt.step(tx, fewer, {k: grads[0][k] for k in fewer},
                                      tx.init(fewer), backend="fused")) == 1
    # The cached path computed what the full path does.
    want = ftopt.step(tx, params, grads[1], state, backend="eager")[0]
    got = ftopt.step(tx, params, grads[1], state, backend="fused")[0]
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)
