"""SOAP (optax.contrib's ``soap`` / ``scale_by_soap``) against float64 math written from
its formula; skip_zeros keeps the params where the gradient is zero (its control);
bad states are refused before anything is written; checkpoints continue bit for bit."""

from __future__ import annotations

import pytest
import torch
from step_checks import assert_state_dict_resumes, fresh_generator

import ftopt
from ftopt.transforms import soap

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Each preconditioned axis sees at least as many columns as its length, so every factor
# has full rank from the first step and its eigenbasis is unique (up to signs, which the
# update does not depend on); "r" is preconditioned on its first axis only
# (max_precond_dim 8).
SHAPES = {"sq": (8, 8), "cube": (3, 4, 5), "r": (6, 10), "b": (7,)}
LETTERS = "abcdefgh"


def _tree(gen, shapes=SHAPES) -> dict:
    return {k: torch.randn(s, generator=gen).to(DEVICE) for k, s in shapes.items()}


def _rotate(x: torch.Tensor, q: list, back: bool) -> torch.Tensor:
    """Each axis i with a basis Q_i multiplied by Q_iᵀ (into the basis) or Q_i (back)."""
    for i, b in enumerate(q):
        if b is None:
            continue
        src = LETTERS[:x.dim()]
        dst = src.replace(src[i], "z")
        pair = f"{src[i]}z" if not back else f"z{src[i]}"
        x = torch.einsum(f"{src},{pair}->{dst}", x, b)
    return x


class SoapRef:
    """optax.contrib.soap(lr, b1, b2, eps=eps, weight_decay=wd, precondition_frequency=f,
    max_precond_dim=d) in float64, each leaf on its own."""

    def __init__(self, lr, b1=0.95, b2=0.95, eps=1e-8, wd=0.0, frequency=10, max_dim=8):
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, b1, b2, eps, wd
        self.frequency, self.max_dim = frequency, max_dim
        self.t, self.state = 0, {}

    def _axes(self, shape):
        return [False] if len(shape) == 1 else [n <= self.max_dim for n in shape]

    def step(self, params, grads):
        self.t += 1
        out = {}
        for k, p in params.items():
            g, p = grads[k].double(), p.double()
            on = self._axes(g.shape)
            st = self.state.setdefault(k, {
                "m": torch.zeros_like(g), "v": torch.zeros_like(g),
                "gg": [torch.zeros(n, n, dtype=g.dtype, device=g.device) if f else None
                       for n, f in zip(g.shape, on)], "q": [None] * len(on)})
            gg = [None if f is None else self.b2 * f + (1 - self.b2) * (
                g.movedim(i, 0).reshape(g.shape[i], -1)
                @ g.movedim(i, 0).reshape(g.shape[i], -1).T)
                for i, f in enumerate(st["gg"])]
            if self.t == 1:
                st["q"] = [None if f is None else torch.linalg.eigh(f)[1].flip(1) for f in gg]
                st["gg"] = gg
                out[k] = p - self.lr * (self.wd * p)
                continue
            q, n = st["q"], self.t - 1
            r = _rotate(g, q, back=False)
            st["m"] = self.b1 * st["m"] + (1 - self.b1) * r
            st["v"] = self.b2 * st["v"] + (1 - self.b2) * r * r
            u = _rotate(st["m"] / (st["v"].sqrt() + self.eps), q, back=True)
            u = u * (1 - self.b2 ** n) ** 0.5 / (1 - self.b1 ** n)
            st["gg"] = gg
            if n % self.frequency == 0:
                new_q, v = list(q), st["v"]
                for i, b in enumerate(q):
                    if b is None:
                        continue
                    est = torch.diagonal(b.T @ gg[i] @ b)
                    order = torch.argsort(est, descending=True)
                    v = v.index_select(i, order)
                    new_q[i] = torch.linalg.qr(gg[i] @ b[:, order])[0]
                st["m"] = _rotate(_rotate(st["m"], q, back=True), new_q, back=False)
                st["v"], st["q"] = v, new_q
            out[k] = p - self.lr * (u + self.wd * p)
        return out


@pytest.mark.parametrize("case", [{}, {"b1": 0.8, "b2": 0.9, "weight_decay": 0.05,
                                       "precondition_frequency": 2}])
@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_soap_matches_float64_reference(backend, case):
    gen = fresh_generator()
    kw = {"precondition_frequency": 3, **case}
    tx = ftopt.soap(0.02, max_precond_dim=8, **kw)
    ref = SoapRef(0.02, b1=kw.get("b1", 0.95), b2=kw.get("b2", 0.95),
                  wd=kw.get("weight_decay", 0.0), frequency=kw["precondition_frequency"])
    params = _tree(gen)
    ref_params = {k: v.double() for k, v in params.items()}
    state = tx.init(params)
    for t in range(8):
        grads = _tree(gen)
        params, state = ftopt.step(tx, params, grads, state, backend=backend)
        ref_params = ref.step(ref_params, grads)
        for k in params:
            assert torch.allclose(params[k].double(), ref_params[k], rtol=1e-4, atol=1e-5), \
                (t, k, float((params[k].double() - ref_params[k]).abs().max()))
    soap_state = state[0]
    assert int(soap_state.count) == 8
    assert [tuple(x["cube"].shape) for x in soap_state.q] == [(3, 3), (4, 4), (5, 5)]
    assert [tuple(x["r"].shape) for x in soap_state.q] == [(6, 6), (0, 0), (0, 0)]


def test_first_step_builds_the_bases_and_moves_nothing():
    """Step 1: the update is zero (only the decay moves the params) and each Q is the
    factor's eigenbasis, largest eigenvalue first."""
    gen = fresh_generator()
    tx = ftopt.scale_by_soap(max_precond_dim=8)
    params, grads = _tree(gen), _tree(gen)
    u, state = tx.update(grads, tx.init(params), params)
    assert all(bool((x == 0).all()) for x in u.values())
    q, gg = state.q[0]["sq"], state.gg[0]["sq"]
    d = torch.diagonal(q.T @ gg @ q)
    assert bool((d[:-1] >= d[1:]).all())
    assert torch.allclose(q.T @ q, torch.eye(8, device=DEVICE), atol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_a_nan_factor_gets_a_nan_basis_not_an_error(backend):
    """LAPACK's ``eigh`` refuses a matrix with a NaN ("failed to converge"): a factor of
    a gradient holding a NaN gets a NaN basis and its leaf NaN updates, as a NaN makes
    any other state; the other leaf of its batch (same shape) keeps the basis and the
    step it has without the NaN beside it (the control). ``normalize`` of all-zero
    gradients (0/0) gives every leaf such factors (CPU fuzz seed 248)."""
    gen = fresh_generator()
    tx = ftopt.scale_by_soap(max_precond_dim=8)
    shapes = {"a": (8, 8), "b": (8, 8)}
    params, grads = _tree(gen, shapes), _tree(gen, shapes)
    bad = {**grads, "b": grads["b"].clone()}
    bad["b"][3, 4] = float("nan")
    _, state = ftopt.step(tx, params, bad, tx.init(params), backend=backend)
    _, clean = ftopt.step(tx, params, grads, tx.init(params), backend=backend)
    for axis, want in zip(state.q, clean.q):
        assert bool(axis["b"].isnan().all())
        assert torch.equal(axis["a"], want["a"])
    more = _tree(gen, shapes)
    new, _ = ftopt.step(tx, params, more, state, backend=backend)
    want, _ = ftopt.step(tx, params, more, clean, backend=backend)
    assert bool(new["b"].isnan().all())
    assert torch.equal(new["a"], want["a"]) and bool(new["a"].isfinite().all())
    zero = {k: torch.zeros_like(v) for k, v in grads.items()}
    chain = ftopt.chain(ftopt.normalize(), ftopt.scale_by_soap(max_precond_dim=8))
    _, state = ftopt.step(chain, params, zero, chain.init(params), backend=backend)
    assert all(bool(q.isnan().all()) for axis in state[1].q for q in axis.values())


def _largest_entries(q: torch.Tensor) -> torch.Tensor:
    """Each column's entry of the largest magnitude."""
    return torch.take_along_dim(q, q.abs().argmax(dim=0, keepdim=True), dim=0)[0]


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_every_basis_vector_has_its_largest_entry_positive(backend):
    """An eigenvector's (or QR column's) sign is arbitrary and LAPACK's flips at rounding
    level: each basis is signed, after ``eigh`` (step 1) and after each refinement (QR,
    every step here), and stays a basis of the factor. A tiny perturbation of a factor
    leaves its basis as it is. (Without the signing, about half the columns' largest
    entries are negative.)"""
    gen = fresh_generator()
    tx = ftopt.scale_by_soap(max_precond_dim=8, precondition_frequency=1)
    params = _tree(gen)
    state = tx.init(params)
    for step in range(3):
        _, state = ftopt.step(tx, params, _tree(gen), state, backend=backend)
        for i, axis in enumerate(state.q):
            for name, q in axis.items():
                if q.numel():
                    assert bool((_largest_entries(q) > 0).all()), (step, i, name)
                    assert torch.allclose(q.T @ q, torch.eye(len(q), device=DEVICE),
                                          atol=1e-5)
    f = state.gg[0]["sq"][None].double()
    nudged = f * (1 + 1e-9 * torch.randn(f.shape, generator=gen, dtype=f.dtype).to(DEVICE))
    nudged = (nudged + nudged.transpose(1, 2)) / 2
    assert torch.allclose(soap._eigenbasis(f), soap._eigenbasis(nudged), atol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_skip_zeros_keeps_the_params(backend):
    """Where the gradient is zero the update is zero and the param keeps its bits; the
    rotated states advance (they have no element of the param's own). The control:
    without skip_zeros those params move."""
    gen = fresh_generator()
    seed = int(torch.randint(2**31, (1,), generator=gen))
    moved = {}
    for skip in (False, True):
        g0 = torch.Generator().manual_seed(seed)
        tx = ftopt.soap(0.05, max_precond_dim=8, precondition_frequency=2,
                        weight_decay=0.1, skip_zeros=skip)
        params = _tree(g0)
        state = tx.init(params)
        for _ in range(3):
            params, state = ftopt.step(tx, params, _tree(g0), state, backend=backend)
        grads = _tree(g0)
        grads["sq"][2:4] = 0.0
        grads["cube"][1] = -0.0
        zero = {k: g == 0 for k, g in grads.items()}
        new_p, _ = ftopt.step(tx, params, grads, state, backend=backend)
        moved[skip] = {k: new_p[k][zero[k]] != params[k][zero[k]] for k in ("sq", "cube")}
        if skip:
            for k in ("sq", "cube"):
                assert not bool(moved[skip][k].any()), k
                assert bool((new_p[k][~zero[k]] != params[k][~zero[k]]).all()), k
    assert all(bool(moved[False][k].all()) for k in ("sq", "cube"))


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_a_bad_state_names_the_leaf_and_writes_nothing(backend):
    gen = fresh_generator()
    tx = ftopt.soap(0.05, max_precond_dim=8)
    params = _tree(gen)
    state = tx.init(params)
    q1 = dict(state[0].q[1])
    q1["cube"] = torch.zeros(5, 5, device=DEVICE)
    bad = (state[0]._replace(q=(state[0].q[0], q1, state[0].q[2])),) + state[1:]
    before = [x.clone() for x in ftopt.tree.leaves((params, bad))]
    with pytest.raises(ValueError, match=r"q\[1\] at \['cube'\].*expected \(4, 4\)"):
        ftopt.step(tx, params, _tree(gen), bad, backend=backend, donate=True)
    assert all(torch.equal(a, b) for a, b in zip(before, ftopt.tree.leaves((params, bad))))


def test_hyperparameters_are_checked():
    for kw, word in [({"b1": 1.0}, "b1"), ({"precondition_frequency": 0},
                                            "precondition_frequency"),
                     ({"max_precond_dim": 0}, "max_precond_dim"), ({"eps": -1.0}, "eps"),
                     ({"shampoo_beta": 1.5}, "shampoo_beta")]:
        with pytest.raises(ValueError, match=word):
            ftopt.scale_by_soap(**kw)
    with pytest.raises(TypeError, match="mu_dtype"):
        ftopt.scale_by_soap(mu_dtype=torch.int32)


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_checkpoint_continues_bit_for_bit(backend):
    gen = fresh_generator()
    tx = ftopt.soap(1e-2, max_precond_dim=8, precondition_frequency=2, weight_decay=0.1)
    params = _tree(gen)
    grads = [_tree(gen) for _ in range(6)]
    assert_state_dict_resumes(tx, params, grads, 3, backend)


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_a_donated_step_is_bit_identical(backend):
    """Donated (states written back into their buffers) or not, the same bits: the bases
    are stored row-major, as LAPACK does not return them, and a matrix product on other
    strides rounds otherwise (1-D leaves preconditioned, an axis too long to be)."""
    gen = fresh_generator()
    tx = ftopt.chain(ftopt.scale_by_soap(precondition_1d=True, precondition_frequency=2,
                                         max_precond_dim=9),
                     ftopt.scale_by_learning_rate(0.1))
    params = _tree(gen, {"a": (33,), "m": (6, 10), "c": (3, 4, 5)})
    grads = [_tree(gen, {"a": (33,), "m": (6, 10), "c": (3, 4, 5)}) for _ in range(5)]
    runs = []
    for donate in (False, True):
        p = ftopt.tree.map(torch.clone, params)
        state = tx.init(p)
        for g in grads:
            p, state = ftopt.step(tx, p, g, state, donate=donate, backend=backend)
        runs.append(ftopt.tree.leaves((p, state)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
