"""Every element of every fused output is written: new tensors start poisoned (NaN, or
an unlikely integer), and the fused results must still equal the eager ones.

Covers the non-donated step and ``tx.update`` (first call: the full path; later calls:
the cached tables and one output buffer per role), 16-bit params, norms, skip_zeros
(zero-gradient lanes must be written with their old values) and 8-bit states.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import ftopt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {"empty": (0,), "one": (1,), "scalar": (), "odd": (7, 5), "ragged": (1031,),
          "big": (3, 1500), "wide": (5000,)}

CHAINS = {
    "adamw": lambda: ftopt.adamw(0.01, weight_decay=0.1),
    "lion": lambda: ftopt.lion(0.003),
    "lamb": lambda: ftopt.lamb(0.01, weight_decay=0.1),
    "clip_adam": lambda: ftopt.chain(ftopt.clip_by_global_norm(0.5), ftopt.adam(0.01)),
    "skip_adamw": lambda: ftopt.adamw(0.01, weight_decay=0.1, skip_zeros=True),
    "adam_8bit": lambda: ftopt.adam(0.01, state_bits=8),
    "skip_adam_8bit": lambda: ftopt.adam(0.01, state_bits=8, skip_zeros=True),
}


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "meta" or t.numel() == 0:
        return t
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(165 if t.dtype == torch.uint8 else -12345)


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty / empty_like return poisoned tensors (what the fused paths allocate
    their outputs with)."""
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _poison(empty_like(*a, **k)))


def _tree(gen, dtype):
    return {k: torch.randn(s, generator=gen).to(dtype).to(DEVICE) for k, s in SHAPES.items()}


def _grads(gen, dtype):
    g = _tree(gen, dtype)
    g["odd"][2] = 0.0
    g["ragged"][::3] = -0.0
    g["wide"][:2048] = 0.0  # whole 8-bit blocks and kernel blocks without a gradient
    return g


def _assert_close(fused, eager, what):
    paths, got, _ = ftopt.tree.flatten_with_paths(fused)
    _, want, _ = ftopt.tree.flatten_with_paths(eager)
    assert len(got) == len(want)
    for path, a, b in zip(paths, got, want):
        if isinstance(a, torch.Tensor) and a.numel():
            assert not (a.isnan().any() if a.is_floating_point() else False), (what, path)
            if a.is_floating_point():
                tol = 1e-5 if a.dtype == torch.float32 else 4 * torch.finfo(a.dtype).eps
                err = (a.double() - b.double()).abs().max() / b.double().abs().max().clamp(
                    min=1e-30)
                assert err <= tol, (what, path, float(err))
            else:
                assert torch.equal(a, b), (what, path)


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CHAINS))
def test_fused_outputs_are_fully_written(name, dtype):
    """Each call compared with the eager one on the same inputs; the next call gets the
    fused outputs back (as a functional loop does: the cached path)."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    tx = CHAINS[name]()
    params = _tree(gen, dtype)
    state = tx.init(params)
    for i in range(3):
        grads = _grads(gen, dtype)
        u_f, us_f = tx.update(grads, state, params, backend="fused")
        u_e, us_e = tx.update(grads, state, params, backend="eager")
        _assert_close(u_f, u_e, f"update {i}")
        _assert_close(us_f, us_e, f"update state {i}")
        p_f, s_f = ftopt.step(tx, params, grads, state, backend="fused")
        p_e, s_e = ftopt.step(tx, params, grads, state, backend="eager")
        _assert_close(p_f, p_e, f"params {i}")
        _assert_close(s_f, s_e, f"state {i}")
        params, state = p_f, s_f
