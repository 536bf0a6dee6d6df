"""``cautious`` (optax.contrib's) against float64 math written from its formula, optax's
own example, ``skip_zeros`` through it with its control, and its refusals."""

from __future__ import annotations

import pytest
import torch
from step_checks import fresh_generator

import ftopt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tree(gen, dtype=torch.float32) -> dict:
    return {"w": torch.randn(8, 6, generator=gen, dtype=torch.float64).to(DEVICE, dtype),
            "b": torch.randn(9, generator=gen, dtype=torch.float64).to(DEVICE, dtype)}


def _adam64(lr, b1, b2, eps):
    """Adam in float64 (p + u convention), one leaf: returns a step function."""
    def step(g, m, v, t):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mh, vh = m / (1 - b1 ** t), v / (1 - b2 ** t)
        return -lr * mh / (vh.sqrt() + eps), m, v
    return step


@pytest.mark.parametrize("eps", [1e-8, 1.0])
@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_cautious_adam_matches_float64(eps, backend):
    gen = fresh_generator()
    lr, b1, b2, adam_eps = 0.05, 0.9, 0.99, 1e-8
    tx = ftopt.cautious(ftopt.adam(lr, b1=b1, b2=b2, eps=adam_eps), eps=eps)
    params = _tree(gen)
    state = tx.init(params)
    ref = {n: p.double() for n, p in params.items()}
    m = {n: torch.zeros_like(p) for n, p in ref.items()}
    v = {n: torch.zeros_like(p) for n, p in ref.items()}
    adam = _adam64(lr, b1, b2, adam_eps)
    dropped = 0
    for t in range(1, 21):
        # (a gradient field that keeps turning, so momentum and gradient disagree)
        grads = {n: (p.double() - 0.3 * torch.randn(p.shape, generator=gen,
                                                     dtype=torch.float64).to(DEVICE)
                     ).to(p.dtype) for n, p in params.items()}
        updates, state = tx.update(grads, state, params, backend=backend)
        params = ftopt.apply_updates(params, updates)
        for n in ref:
            g = grads[n].double()
            u, m[n], v[n] = adam(g, m[n], v[n], t)
            keep = (u * g < 0).double()
            dropped += int((keep == 0).sum())
            ref[n] = ref[n] + u * keep * (keep.numel() / (keep.sum() + eps))
        for n in ref:
            torch.testing.assert_close(params[n].double(), ref[n], rtol=1e-5, atol=1e-6)
    assert dropped > 0  # (the control: the mask did drop elements)


def test_optax_s_example():
    """optax.contrib.cautious's docstring: adamw(0.1) on sum(x²) from [1, 2, 3]."""
    tx = ftopt.cautious(ftopt.adamw(learning_rate=0.1))
    params = torch.tensor([1.0, 2.0, 3.0], device=DEVICE)
    state = tx.init(params)
    seen = []
    for _ in range(5):
        updates, state = tx.update(2 * params, state, params)
        params = ftopt.apply_updates(params, updates)
        seen.append(f"{float((params ** 2).sum()):.2E}")
    assert seen == ["1.28E+01", "1.17E+01", "1.07E+01", "9.69E+00", "8.77E+00"]


def test_all_agreeing_is_the_base_optimizer_bit_for_bit():
    """Where every element moves against its gradient, ``n / (n + 1e-8)`` is 1 in fp32:
    the base optimizer's update, bit for bit."""
    gen = fresh_generator()
    params = _tree(gen)
    grads = {n: torch.where(g == 0, 1.0, g) for n, g in _tree(gen).items()}
    base = ftopt.sgd(0.1)
    tx = ftopt.cautious(base)
    u_base, _ = base.update(grads, base.init(params), params)
    u, _ = tx.update(grads, tx.init(params), params)
    assert all(torch.equal(u[n], u_base[n]) for n in u)


def test_the_condition_is_the_sign_not_an_underflowing_product():
    """An update and gradient whose fp32 product underflows to 0 still disagree in sign:
    kept (the formula's exact condition), while a NaN in the update stays NaN."""
    g = torch.tensor([1e-25, -1e-25, 1e-25, 2.0], device=DEVICE)
    tx = ftopt.cautious(ftopt.sgd(1e-15))  # (u = -1e-40, a denormal)
    u, _ = tx.update(g, tx.init(g.clone()), g.clone())
    assert (u[:3] * g[:3] == 0).all() and (u[:3] != 0).all()
    sgd = ftopt.sgd(1e-15)
    assert torch.equal(u, sgd.update(g, sgd.init(g), g)[0])
    nan = ftopt.cautious(ftopt.stateless(lambda up, p: up * float("nan")))
    out, _ = nan.update(g, nan.init(g), g)
    assert torch.isnan(out).all()


@pytest.mark.parametrize("skip", [True, False])
def test_skip_zeros_through_cautious(skip):
    """In a ``skip_zeros`` chain the base optimizer gets the chain's mask: params and
    states keep their bits where the gradient is zero. Control: without it, adam's
    moments there decay."""
    gen = fresh_generator()
    parts = [ftopt.cautious(ftopt.adam(0.05))] + [ftopt.skip_zeros()] * skip
    tx = ftopt.chain(*parts)
    params = _tree(gen)
    state = tx.init(params)
    for _ in range(3):  # (moments that are not zero)
        params, state = ftopt.step(tx, params, _tree(gen), state)
    grads = _tree(gen)
    zero = torch.rand(grads["w"].shape, generator=gen).to(DEVICE) < 0.4
    grads["w"] = torch.where(zero, 0.0, grads["w"])
    mu = state[0].base_optimizer_state[0].mu["w"].clone()
    new_p, new_state = ftopt.step(tx, params, grads, state)
    new_mu = new_state[0].base_optimizer_state[0].mu["w"]
    same_mu = torch.equal(new_mu[zero].view(torch.int32), mu[zero].view(torch.int32))
    same_p = torch.equal(new_p["w"][zero].view(torch.int32),
                         params["w"][zero].view(torch.int32))
    assert same_mu == skip
    assert same_p  # (a zero gradient never agrees: those params stay, either way)


def test_refusals_name_the_leaf():
    gen = fresh_generator()
    params = _tree(gen)
    grads = _tree(gen)
    with pytest.raises(ValueError, match=r"eps"):
        ftopt.cautious(ftopt.sgd(0.1), eps=-1.0)
    with pytest.raises(TypeError, match="CautiousState"):
        ftopt.cautious(ftopt.sgd(0.1)).update(grads, (), params)
    wrong = ftopt.cautious(ftopt.stateless(
        lambda u, p: {"w": u["w"][:2], "b": u["b"]}))
    with pytest.raises(ValueError, match=r"\['w'\].*shape \(8, 6\)"):
        wrong.update(grads, wrong.init(params), params)
    z = torch.randn(4, generator=gen, dtype=torch.complex64).to(DEVICE)
    tx = ftopt.cautious(ftopt.stateless(lambda u, p: u))
    with pytest.raises(TypeError, match=r"<root>|complex"):
        tx.update(z, tx.init(z), z)
