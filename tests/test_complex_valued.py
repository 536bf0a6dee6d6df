"""``split_real_and_imaginary`` (optax.contrib's): complex params stepped as pairs of real
ones, against torch.optim on complex params (which views them as real pairs) and the
inner transform on the split tree; each part a leaf of its own; skip_zeros of a complex
element with its control; real leaves untouched by the wrapper; a checkpoint round trip;
bad input; a complex least-squares fit. (Its params are complex, which the registry suites
do not draw: ``tests/registry.py::PARAMS_WRAPPERS`` sends it here.)"""

from __future__ import annotations

import io

import pytest
import torch

import ftopt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tree(gen, dtype=torch.complex64) -> dict:
    def draw(*shape):
        return torch.complex(torch.randn(*shape, generator=gen),
                             torch.randn(*shape, generator=gen)).to(dtype).to(DEVICE)
    real = torch.float64 if dtype == torch.complex128 else torch.float32
    return {"w": draw(6, 5), "b": draw(5), "r": torch.randn(4, generator=gen).to(real).to(DEVICE)}


def _split(tree: dict) -> dict:
    out = {}
    for k, v in tree.items():
        out[k] = (ftopt.SplitRealAndImaginaryArrays(v.real.contiguous(), v.imag.contiguous())
                  if v.is_complex() else v)
    return out


CASES = {
    "adam": (lambda: ftopt.adam(1e-2), lambda ps: torch.optim.Adam(ps, lr=1e-2)),
    "sgd_momentum": (lambda: ftopt.sgd(0.05, momentum=0.9, nesterov=True),
                     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True)),
    "rmsprop": (lambda: ftopt.rmsprop(1e-2, decay=0.99, eps=1e-8, eps_in_sqrt=False),
                lambda ps: torch.optim.RMSprop(ps, lr=1e-2, alpha=0.99, eps=1e-8)),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_matches_torch_optim_on_complex_params(name, dtype):
    make, make_torch = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    params = _tree(gen, dtype)
    tx = ftopt.split_real_and_imaginary(make())
    ps = [torch.nn.Parameter(v.clone()) for v in params.values()]
    opt = make_torch(ps)
    p, s = params, tx.init(params)
    inner = make()
    q, t = _split(params), inner.init(_split(params))
    for _ in range(10):
        grads = _tree(gen, dtype)
        p, s = ftopt.step(tx, p, grads, s)
        for x, k in zip(ps, params):
            x.grad = grads[k].clone()
        opt.step()
        # the inner transform on the split tree, bit for bit (eager, as ftopt.step runs
        # an eager wrapper's inner update)
        u, t = inner.update(_split(grads), t, q, backend="eager")
        q = ftopt.apply_updates(q, u)
    tol = 2e-6 if dtype == torch.complex64 else 1e-12
    for x, k in zip(ps, params):
        assert p[k].dtype == params[k].dtype and p[k].shape == params[k].shape
        torch.testing.assert_close(p[k], x.detach(), rtol=tol, atol=tol)
        if p[k].is_complex():
            assert torch.equal(p[k].real, q[k].real) and torch.equal(p[k].imag, q[k].imaginary)
        else:
            assert torch.equal(p[k], q[k])


def test_each_part_is_a_leaf_of_its_own():
    """A per-leaf transform sees the real and imaginary parts apart (optax's split)."""
    gen = torch.Generator().manual_seed(3)
    params = _tree(gen)
    grads = {k: 4 * v for k, v in _tree(gen).items()}
    grads["w"] = torch.complex(grads["w"].real, grads["w"].imag / 8)  # unequal parts
    tx = ftopt.split_real_and_imaginary(ftopt.clip_by_block_rms(0.5))
    u, _ = tx.update(grads, tx.init(params), params)
    for part in ("real", "imag"):
        x = getattr(grads["w"], part).double()
        want = x / torch.clamp(x.square().mean().sqrt() / 0.5, min=1.0)
        torch.testing.assert_close(getattr(u["w"], part).double(), want, rtol=1e-6, atol=0)
    whole = grads["w"].abs().square().double().mean().sqrt()  # (the control: not as one)
    assert not torch.allclose(u["w"].real.double(),
                              grads["w"].real.double() / (whole / 0.5), rtol=1e-3)


def test_skip_zeros_keeps_a_complex_element_whose_parts_are_both_zero():
    gen = torch.Generator().manual_seed(4)
    params = _tree(gen)
    for skip in (True, False):
        inner = ftopt.adam(1e-2)
        tx = ftopt.chain(ftopt.split_real_and_imaginary(inner), ftopt.skip_zeros()) \
            if skip else ftopt.split_real_and_imaginary(inner)
        p, s = params, tx.init(params)
        for step in range(3):
            grads = _tree(gen)
            if step == 2:
                grads["w"][0] = 0.0  # both parts zero
                grads["w"][1] = torch.complex(torch.zeros(5), torch.ones(5)).to(DEVICE)
            before, old = p, s
            p, s = ftopt.step(tx, p, grads, s)
        adam_old = (old[0] if skip else old).inner_state[0]
        adam_new = (s[0] if skip else s).inner_state[0]
        kept = torch.equal(p["w"][0], before["w"][0]) and all(
            torch.equal(getattr(new.mu["w"], part)[0], getattr(was.mu["w"], part)[0])
            and torch.equal(getattr(new.nu["w"], part)[0], getattr(was.nu["w"], part)[0])
            for new, was, part in ((adam_new, adam_old, "real"),
                                   (adam_new, adam_old, "imaginary")))
        assert kept == skip  # (without skip_zeros the same elements change: the control)
        # one part zero is not a zero complex gradient: stepped either way
        assert not torch.equal(p["w"][1].real, before["w"][1].real)
        assert not torch.equal(adam_new.nu["w"].real[1], adam_old.nu["w"].real[1])


def test_real_leaves_and_checkpoint_round_trip():
    gen = torch.Generator().manual_seed(5)
    params = _tree(gen)
    tx = ftopt.split_real_and_imaginary(ftopt.adamw(1e-2, weight_decay=0.1))
    plain = ftopt.adamw(1e-2, weight_decay=0.1)
    p, s = params, tx.init(params)
    r, t = {"r": params["r"]}, plain.init({"r": params["r"]})
    steps = [_tree(gen) for _ in range(5)]
    for g in steps[:3]:
        copies = {k: v.clone() for k, v in g.items()}
        p, s = ftopt.step(tx, p, g, s)
        r, t = ftopt.step(plain, r, {"r": g["r"]}, t)
        assert all(torch.equal(g[k], copies[k]) for k in g)  # (pure)
    assert torch.equal(p["r"], r["r"])  # a real leaf: the inner transform's own step
    buf = io.BytesIO()
    torch.save(s, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert isinstance(loaded, ftopt.SplitRealAndImaginaryState)
    a, b = (p, s), (p, loaded)
    for g in steps[3:]:
        a = ftopt.step(tx, a[0], g, a[1])
        b = ftopt.step(tx, b[0], g, b[1])
    assert all(torch.equal(a[0][k], b[0][k]) for k in params)


def test_bad_input():
    with pytest.raises(TypeError, match="split_real_and_imaginary: inner: expected a "
                                        "GradientTransformation"):
        ftopt.split_real_and_imaginary(ftopt.adam)
    params = _tree(torch.Generator().manual_seed(6))
    tx = ftopt.split_real_and_imaginary(ftopt.adam(1e-3))
    with pytest.raises(TypeError, match="expected a SplitRealAndImaginaryState"):
        tx.update(params, ftopt.adam(1e-3).init(_split(params)), params)
    with pytest.raises(RuntimeError, match="split_real_and_imaginary runs eagerly"):
        ftopt.step(tx, params, params, tx.init(params), backend="fused")
    with pytest.raises(TypeError, match=r"params at \['b'\]: expected a floating-point"):
        ftopt.adam(1e-3).init(params)  # (the control: complex params need the wrapper)


def test_complex_least_squares():
    """min ‖A z − y‖² over complex z: autograd's gradient descends as it is."""
    gen = torch.Generator().manual_seed(7)
    a = torch.complex(torch.randn(40, 8, generator=gen), torch.randn(40, 8, generator=gen))
    z_true = torch.complex(torch.randn(8, generator=gen), torch.randn(8, generator=gen))
    a, y = a.to(DEVICE), (a @ z_true).to(DEVICE)
    params = {"z": torch.zeros(8, dtype=torch.complex64, device=DEVICE)}
    tx = ftopt.split_real_and_imaginary(ftopt.adam(0.05))
    state = tx.init(params)

    def loss(p):
        return (a @ p["z"] - y).abs().square().mean()

    start = float(loss(params))
    for _ in range(400):
        grads = torch.func.grad(loss)(params)
        params, state = ftopt.step(tx, params, grads, state)
    assert float(loss(params)) < 1e-4 * start
    torch.testing.assert_close(params["z"].cpu(), z_true, rtol=0, atol=1e-2)
