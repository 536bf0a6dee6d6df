"""NorMuon (optax.contrib's ``normuon`` / ``scale_by_normuon``) against float64 math
written from its formula; a stack of experts is each expert's NorMuon; skip_zeros keeps
the momentum and params and lets the row moments advance; the presets; bad states are
refused before anything is written; checkpoints continue bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from step_checks import assert_state_dict_resumes, fresh_generator

import ftopt
from tests.test_matrix_optimizers import MuonRef

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D = ftopt.MuonDimensionNumbers
COEFFS = (3.4445, -4.7750, 2.0315)
SHAPES = {"w": (12, 10), "t": (5, 9), "b": (9,)}


def _tree(gen, shapes=SHAPES) -> dict:
    return {k: torch.randn(s, generator=gen).to(DEVICE) for k, s in shapes.items()}


def _ns64(x: torch.Tensor, coeffs=(COEFFS,) * 5, eps: float = 1e-8) -> torch.Tensor:
    """optax's Newton-Schulz in float64 on one matrix (transposed when tall)."""
    tall = x.shape[0] > x.shape[1]
    y = x.T if tall else x
    y = y / (torch.linalg.matrix_norm(y) + eps)
    for a, b, c in coeffs:
        gram = y @ y.T
        y = a * y + (b * gram + c * gram @ gram) @ y
    return y.T if tall else y


class NorMuonRef(MuonRef):
    """optax.contrib.normuon(lr, beta, beta2, eps, weight_decay, normuon_scale=s) in
    float64: 2-D leaves NorMuon then scale_by_shape, the others AdamW (nesterov, as optax
    passes it): Muon's reference with the matrix update replaced."""

    def __init__(self, lr, beta=0.95, beta2=0.95, eps=1e-8, wd=0.0, scale=0.2,
                 coeffs=(COEFFS,) * 5):
        super().__init__(lr, beta=beta, wd=wd, eps=eps)
        self.beta2, self.scale, self.coeffs, self.row_nu = beta2, scale, coeffs, {}

    def matrix(self, k, m_hat):
        o = _ns64(m_hat, self.coeffs, self.eps)
        nu = self.beta2 * self.row_nu.get(k, 0.0) + (1 - self.beta2) * (o * o).mean(-1)
        self.row_nu[k] = nu
        o_hat = o / (nu.sqrt()[:, None] + self.eps)
        m, n = m_hat.shape
        u = o_hat * self.scale * math.sqrt(m * n) / (o_hat.norm() + self.eps)
        return u * math.sqrt(max(1.0, n / m))


@pytest.mark.parametrize("case", [{}, {"beta2": 0.5, "normuon_scale": 0.7,
                                       "weight_decay": 0.05, "ns_coeffs": "dion"}])
@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_normuon_matches_float64_reference(backend, case):
    gen = fresh_generator()
    kw = dict(case)
    preset = kw.pop("ns_coeffs", None)
    tx = ftopt.normuon(0.02, ns_dtype=torch.float32, **kw,
                       **({} if preset is None else {"ns_coeffs": preset}))
    ref = NorMuonRef(0.02, beta2=kw.get("beta2", 0.95), wd=kw.get("weight_decay", 0.0),
                     scale=kw.get("normuon_scale", 0.2),
                     coeffs=(COEFFS,) * 5 if preset is None
                     else ftopt.transforms.muon.NS_COEFFS_PRESETS[preset])
    params = _tree(gen)
    ref_params = {k: v.double() for k, v in params.items()}
    state = tx.init(params)
    for _ in range(8):
        grads = _tree(gen)
        params, state = ftopt.step(tx, params, grads, state, backend=backend)
        ref_params = ref.step(ref_params, grads)
    for k in params:
        assert torch.allclose(params[k].double(), ref_params[k], rtol=1e-4, atol=1e-5), k
    rows = state.inner_states["muon"].inner_state[0][2].row_nu
    assert rows["w"].shape == (12,) and rows["t"].shape == (5,)


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_an_expert_stack_is_each_expert_s_normuon(backend):
    """``(E, in, out)`` with ``D(1, 2)``: each expert's rows and Frobenius norm its own,
    bit for bit the plain ``normuon`` over the E experts as separate 2-D leaves."""
    gen = fresh_generator()
    E = 3
    params = {"experts": torch.randn(E, 8, 6, generator=gen).to(DEVICE),
              "w": torch.randn(8, 6, generator=gen).to(DEVICE)}
    tx = ftopt.normuon(1e-2, ns_dtype=torch.float32,
                       muon_weight_dimension_numbers={"experts": D(1, 2), "w": D()})
    plain = ftopt.normuon(1e-2, ns_dtype=torch.float32)

    def split(tree):
        return {"w": tree["w"], **{f"e{i}": tree["experts"][i].clone() for i in range(E)}}

    state, p2 = tx.init(params), split(params)
    s2 = plain.init(p2)
    for _ in range(3):
        grads = {k: torch.randn(v.shape, generator=gen).to(DEVICE) for k, v in params.items()}
        params, state = ftopt.step(tx, params, grads, state, backend=backend)
        p2, s2 = ftopt.step(plain, p2, split(grads), s2, backend=backend)
        for i in range(E):
            assert torch.equal(params["experts"][i], p2[f"e{i}"]), i
        assert torch.equal(params["w"], p2["w"])
    rows = state.inner_states["muon"].inner_state[0][2].row_nu
    assert rows["experts"].shape == (E, 8)


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_skip_zeros_keeps_momentum_and_params(backend):
    """Rows of zero gradient: params and Muon's momentum bit for bit as they were, the
    update 0 there; the row moments advance (a reduction, SPEC §3). The control: without
    skip_zeros those params and momenta move."""
    gen = fresh_generator()
    results = {}
    for skip in (False, True):
        g0 = torch.Generator().manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
        tx = ftopt.chain(ftopt.scale_by_normuon(ns_dtype=torch.float32),
                         ftopt.add_decayed_weights(0.1), ftopt.scale_by_learning_rate(0.05))
        if skip:
            tx = ftopt.chain(ftopt.skip_zeros(), tx)
        params = _tree(g0)
        state = tx.init(params)
        for _ in range(2):
            params, state = ftopt.step(tx, params, _tree(g0), state, backend=backend)
        grads = _tree(g0)
        grads["w"][3:6] = 0.0
        grads["w"][7, 2] = -0.0
        new_p, new_s = ftopt.step(tx, params, grads, state, backend=backend)
        results[skip] = (params, state, new_p, new_s, grads["w"] == 0)
    params, state, new_p, new_s, zero = results[True]
    inner = lambda s: s[1][0]  # noqa: E731
    assert torch.equal(new_p["w"][zero], params["w"][zero])
    assert torch.equal(inner(new_s)[0].mu["w"][zero], inner(state)[0].mu["w"][zero])
    assert bool((new_p["w"][~zero] != params["w"][~zero]).all())
    assert not torch.equal(inner(new_s)[2].row_nu["w"], inner(state)[2].row_nu["w"])
    params, state, new_p, new_s, zero = results[False]
    assert bool((new_p["w"][zero] != params["w"][zero]).all())
    assert bool((new_s[0][0].mu["w"][zero] != state[0][0].mu["w"][zero]).all())


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_a_bad_row_state_names_the_leaf_and_writes_nothing(backend):
    gen = fresh_generator()
    tx = ftopt.chain(ftopt.scale_by_normuon(ns_dtype=torch.float32),
                     ftopt.scale_by_learning_rate(0.05))
    params = _tree(gen)
    state = tx.init(params)
    rows = dict(state[0][2].row_nu)
    rows["t"] = torch.zeros(9, device=DEVICE)
    bad = (state[0][:2] + (ftopt.NorMuonState(rows),),) + state[1:]
    before = [x.clone() for x in ftopt.tree.leaves((params, bad))]
    with pytest.raises(ValueError, match=r"row_nu at \['t'\].*expected \(5,\)"):
        ftopt.step(tx, params, _tree(gen), bad, backend=backend, donate=True)
    assert all(torch.equal(a, b) for a, b in zip(before, ftopt.tree.leaves((params, bad))))
    with pytest.raises(TypeError, match="expected a NorMuonState"):
        ftopt.step(tx, params, _tree(gen), (state[0][:2] + (None,),) + state[1:],
                   backend=backend)


def test_presets_and_checks():
    """``ns_coeffs="dion"`` is optax's Dion rows, bit for bit; an unknown preset and bad
    hyperparameters are refused, naming them."""
    gen = fresh_generator()
    params, grads = _tree(gen), _tree(gen)
    rows = ftopt.transforms.muon.NS_COEFFS_PRESETS["dion"]
    outs = []
    for coeffs in ("dion", rows):
        tx = ftopt.normuon(1e-2, ns_coeffs=coeffs, ns_dtype=torch.float32)
        outs.append(ftopt.step(tx, params, grads, tx.init(params), backend="eager")[0])
    assert all(torch.equal(outs[0][k], outs[1][k]) for k in params)
    assert not torch.equal(outs[0]["w"], ftopt.step(
        tx := ftopt.normuon(1e-2, ns_dtype=torch.float32), params, grads, tx.init(params),
        backend="eager")[0]["w"])  # the control: the standard triple differs
    with pytest.raises(ValueError, match="unknown ns_coeffs preset 'nope'"):
        ftopt.scale_by_normuon(ns_coeffs="nope")
    with pytest.raises(ValueError, match="beta2"):
        ftopt.scale_by_normuon(beta2=1.0)
    with pytest.raises(ValueError, match="normuon_scale"):
        ftopt.normuon(1e-2, normuon_scale=-1.0)
    with pytest.raises(ValueError, match="scale_by_normuon: ns_steps"):
        ftopt.scale_by_normuon(ns_steps=0)


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_checkpoint_continues_bit_for_bit(backend):
    gen = fresh_generator()
    tx = ftopt.normuon(1e-2, ns_dtype=torch.float32, weight_decay=0.1)
    params = _tree(gen)
    grads = [_tree(gen) for _ in range(4)]
    assert_state_dict_resumes(tx, params, grads, 2, backend)
