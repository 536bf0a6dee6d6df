"""Muon over leaves of any rank (optax's ``MuonDimensionNumbers``): a stack of experts is
each expert's Muon, a conv kernel's matrix against float64 Newton-Schulz written here,
the ways of naming the leaves agree, skip_zeros keeps an idle expert, and the refusals."""

from __future__ import annotations

import pytest
import torch
from step_checks import fresh_generator

import ftopt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D = ftopt.MuonDimensionNumbers
COEFFS = (3.4445, -4.7750, 2.0315)


def _randn(gen, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(DEVICE)


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_an_expert_stack_is_each_expert_s_muon(backend):
    """``(E, in, out)`` with ``D(1, 2)``: the same params, bit for bit, as the plain
    ``muon`` over the E experts as separate 2-D leaves (one batch of matrices either
    way); the 1-D leaf gets AdamW."""
    gen = fresh_generator()
    E = 4
    params = {"b": _randn(gen, 6), "experts": _randn(gen, E, 8, 6), "w": _randn(gen, 8, 6)}
    dims = {"b": None, "experts": D(1, 2), "w": D()}
    tx = ftopt.muon(1e-2, ns_dtype=torch.float32, weight_decay=0.1,
                    muon_weight_dimension_numbers=dims)
    plain = ftopt.muon(1e-2, ns_dtype=torch.float32, weight_decay=0.1)

    def split(tree):
        out = {"b": tree["b"], "w": tree["w"]}
        out.update({f"e{i}": tree["experts"][i].clone() for i in range(E)})
        return out

    p2, state, s2 = params, tx.init(params), None
    p2 = split(params)
    s2 = plain.init(p2)
    for _ in range(3):
        grads = {k: _randn(gen, *v.shape) for k, v in params.items()}
        params, state = ftopt.step(tx, params, grads, state, backend=backend)
        p2, s2 = ftopt.step(plain, p2, split(grads), s2, backend=backend)
        for i in range(E):
            assert torch.equal(params["experts"][i], p2[f"e{i}"]), i
        assert torch.equal(params["w"], p2["w"]) and torch.equal(params["b"], p2["b"])
    mu = state.inner_states["muon"].inner_state[0][0].mu["experts"]
    assert mu.shape == (E, 8, 6)


def _newton_schulz64(x: torch.Tensor, steps: int) -> torch.Tensor:
    """optax's iteration in float64 on one matrix (transposed when tall)."""
    tall = x.shape[0] > x.shape[1]
    y = x.T if tall else x
    y = y / (torch.linalg.matrix_norm(y) + 1e-8)
    for _ in range(steps):
        a, b, c = COEFFS
        gram = y @ y.T
        y = a * y + (b * gram + c * gram @ gram) @ y
    return y.T if tall else y


@pytest.mark.parametrize("consistent_rms", [None, 0.2])
def test_a_conv_kernel_against_float64(consistent_rms):
    """A kernel ``(out, in, kh, kw)`` with its reduction axes ``(1, 2, 3)`` and output
    axis 0 is the ``(in·kh·kw, out)`` matrix; one step without Nesterov orthogonalises
    the gradient itself, then scale_by_shape's factor uses fan_in = in·kh·kw."""
    gen = fresh_generator()
    dims = D((1, 2, 3), 0)
    tx = ftopt.chain(ftopt.scale_by_muon(nesterov=False, ns_dtype=torch.float32,
                                         weight_dimension_numbers=dims),
                     ftopt.scale_by_shape(consistent_rms, weight_dimension_numbers=dims))
    g = _randn(gen, 6, 3, 2, 2)
    u, _ = tx.update(g, tx.init(g), g)
    matrix = g.double().permute(1, 2, 3, 0).reshape(12, 6)
    fan_in, fan_out = 12, 6
    factor = (max(1.0, fan_out / fan_in) ** 0.5 if consistent_rms is None
              else max(fan_in, fan_out) ** 0.5 * consistent_rms)
    want = (factor * _newton_schulz64(matrix, 5)).reshape(3, 2, 2, 6).permute(3, 0, 1, 2)
    torch.testing.assert_close(u.double(), want, rtol=2e-5, atol=2e-6)


def test_the_ways_of_naming_leaves_agree():
    """A prefix tree, the full tree and a function of the updates give the same update;
    a leaf named None passes through as m̂."""
    gen = fresh_generator()
    params = {"stack": {"a": _randn(gen, 3, 5, 4), "b": _randn(gen, 2, 5, 4)},
              "vec": _randn(gen, 7)}
    grads = {"stack": {"a": _randn(gen, 3, 5, 4), "b": _randn(gen, 2, 5, 4)},
             "vec": _randn(gen, 7)}
    ways = [{"stack": D(-2, -1), "vec": None},
            {"stack": {"a": D(1, 2), "b": D(-2, 2)}, "vec": None},
            lambda tree: ftopt.tree.map(lambda x: D(-2, -1) if x.ndim == 3 else None, tree)]
    outs = []
    for dims in ways:
        tx = ftopt.scale_by_muon(ns_dtype=torch.float32, weight_dimension_numbers=dims)
        outs.append(tx.update(grads, tx.init(params), params)[0])
    for other in outs[1:]:
        assert all(torch.equal(x, y) for x, y in zip(ftopt.tree.leaves(outs[0]),
                                                      ftopt.tree.leaves(other)))
    plain = ftopt.scale_by_muon(ns_dtype=torch.float32)
    passed = plain.update(grads, plain.init(params), params)[0]
    assert torch.equal(outs[0]["vec"], passed["vec"])  # (m̂ as it is)
    assert not torch.equal(outs[0]["stack"]["a"], passed["stack"]["a"])  # (control)


@pytest.mark.parametrize("make", [ftopt.muon, ftopt.normuon])
@pytest.mark.parametrize("how", ["prefix", "function"])
def test_a_param_held_as_none_is_an_empty_subtree(make, how):
    """A frozen param held as None (an empty subtree, as optax reads it) beside named
    leaves: its update stays None and the others step as they do without it, bit for
    bit (the partition's labels once put a label where the params hold None)."""
    gen = fresh_generator()
    params = {"stack": _randn(gen, 3, 5, 4), "vec": _randn(gen, 7)}
    grads = [{"stack": _randn(gen, 3, 5, 4), "vec": _randn(gen, 7)} for _ in range(2)]
    dims = ({"stack": D(-2, -1), "vec": None} if how == "prefix" else
            lambda tree: ftopt.tree.map(lambda x: D(-2, -1) if x.ndim == 3 else None, tree))
    with_none = {"frozen": None, **dims} if how == "prefix" else dims
    runs = []
    for frozen in (False, True):
        tx = make(1e-2, ns_dtype=torch.float32,
                  muon_weight_dimension_numbers=with_none if frozen else dims)
        p = {"frozen": None, **params} if frozen else dict(params)
        state = tx.init(p)
        for g in grads:
            g = {"frozen": None, **g} if frozen else g
            u, state = tx.update(g, state, p)
            p = ftopt.apply_updates(p, u)
        if frozen:
            assert u["frozen"] is None and p["frozen"] is None
        runs.append(p)
    for name in ("stack", "vec"):
        assert torch.equal(runs[0][name], runs[1][name]), name
    assert not torch.equal(runs[0]["stack"], params["stack"])  # (control: it stepped)


@pytest.mark.parametrize("skip", [True, False])
def test_skip_zeros_keeps_an_idle_expert(skip):
    """An expert that saw no tokens (its gradient all zero) keeps its params and momentum
    bit for bit; without skip_zeros its momentum decays (the control)."""
    gen = fresh_generator()
    params = {"experts": _randn(gen, 4, 8, 6)}
    tx = ftopt.muon(1e-2, ns_dtype=torch.float32, skip_zeros=skip,
                    muon_weight_dimension_numbers=D(1, 2))
    state = tx.init(params)
    for _ in range(2):
        params, state = ftopt.step(tx, params, {"experts": _randn(gen, 4, 8, 6)}, state)
    grads = {"experts": _randn(gen, 4, 8, 6)}
    grads["experts"][2] = 0.0

    def mu(s):
        return s.inner_states["muon"].inner_state[0][0].mu["experts"][2].clone()

    before_p, before_mu = params["experts"][2].clone(), mu(state)
    params, state = ftopt.step(tx, params, grads, state)
    assert torch.equal(mu(state), before_mu) == skip
    assert torch.equal(params["experts"][2], before_p) == skip
    assert not torch.equal(params["experts"][1], before_p)


def test_refusals_name_the_leaf():
    gen = fresh_generator()
    params = {"b": _randn(gen, 6), "w": _randn(gen, 4, 5)}

    def update(dims):
        tx = ftopt.scale_by_muon(weight_dimension_numbers=dims)
        return tx.update(params, tx.init(params), params)

    with pytest.raises(ValueError, match=r"\['b'\].*rank 2"):
        update(D())
    with pytest.raises(ValueError, match=r"\['w'\].*distinct"):
        update({"b": None, "w": D(0, 0)})
    with pytest.raises(ValueError, match=r"\['w'\].*does not name axes"):
        update({"b": None, "w": D(0, 2)})
    with pytest.raises(TypeError, match="str"):
        update({"b": None, "w": "rows"})
    with pytest.raises(ValueError, match="does not fit"):
        update({"b": None, "v": D()})
