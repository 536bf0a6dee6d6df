"""ftopt under ``torch.func`` (grad, vmap, functional_call) and plain autograd.

* Meta-gradients: ``torch.func.grad`` of a loss of the params after a few optimizer steps
  (the inner gradients depend on the params) w.r.t. the learning rate (a 0-d float64 tensor
  hyperparameter) and w.r.t. the initial params, against central finite differences in
  float64. Lion's direction is a sign (zero derivative), but its learning rate and weight
  decay still carry a gradient, so it is checked too.
* Plain autograd (``requires_grad`` params, grad mode on) through ``update`` +
  ``apply_updates`` and through ``ftopt.step`` gives the same gradients as ``torch.func``.
* ``torch.func.vmap`` over a stacked ensemble equals a Python loop over the members, for
  transforms with per-leaf and global norms (the norms must be per member).
* A ``functional_call`` + ``torch.func.grad`` training loop with ``ftopt.step`` trains a
  tiny MLP and tracks ``torch.optim.Adam``.
"""

from __future__ import annotations

import pytest
import torch
from step_checks import assert_vmap_matches_loop

import ftopt

F64 = torch.float64
SEED = 1234

# name -> factory(lr); every factory takes the learning rate as a 0-d tensor.
META = {
    "adam": lambda lr: ftopt.adam(lr),
    "adam_nesterov": lambda lr: ftopt.adam(lr, b1=0.8, nesterov=True),
    "adamw": lambda lr: ftopt.adamw(lr, weight_decay=0.1),
    "sgd_momentum": lambda lr: ftopt.sgd(lr, momentum=0.9),
    "sgd_nesterov": lambda lr: ftopt.sgd(lr, momentum=0.9, nesterov=True),
    "rmsprop": lambda lr: ftopt.rmsprop(lr, decay=0.9),
    "rmsprop_momentum": lambda lr: ftopt.rmsprop(lr, momentum=0.5, eps_in_sqrt=False),
    "lamb": lambda lr: ftopt.lamb(lr, weight_decay=0.05),
    "lion": lambda lr: ftopt.lion(lr, weight_decay=0.1),
    "ademamix": lambda lr: ftopt.ademamix(lr, b3=0.99, alpha=2.0, weight_decay=0.01),
    "clip_adam": lambda lr: ftopt.chain(ftopt.clip_by_global_norm(1.0), ftopt.adam(lr)),
}

SHAPES = {"w": (4, 3), "b": (3,), "s": ()}
INNER_STEPS = 3


def _tree(gen: torch.Generator, shapes=SHAPES, dtype=F64, scale=1.0):
    return {k: scale * torch.randn(s, generator=gen, dtype=dtype) for k, s in shapes.items()}


def _inner_grads(p, coef):
    """Gradient of sum(0.5*c*p**2 + cos(p)): depends on the params (a real meta-problem)."""
    return {k: coef[k] * v - torch.sin(v) for k, v in p.items()}


def _unroll(make, lr, p0, coef, target, use_step=False):
    tx = make(lr)
    state = tx.init(p0)
    p = p0
    for _ in range(INNER_STEPS):
        g = _inner_grads(p, coef)
        if use_step:
            p, state = ftopt.step(tx, p, g, state)
        else:
            u, state = tx.update(g, state, p)
            p = ftopt.apply_updates(p, u)
    return sum(((v - target[k]) ** 2).sum() for k, v in p.items())


def _problem(seed):
    gen = torch.Generator().manual_seed(seed)
    p0 = _tree(gen)
    coef = {k: torch.rand(s, generator=gen, dtype=F64) + 0.5 for k, s in SHAPES.items()}
    target = _tree(gen)
    direction = _tree(gen)
    lr = torch.tensor(0.05, dtype=F64)
    return p0, coef, target, direction, lr


def _close(a, b, rtol):
    a, b = float(a), float(b)
    assert abs(a - b) <= rtol * max(abs(b), 1e-3), (a, b)


@pytest.mark.parametrize("name", sorted(META))
def test_meta_gradient_matches_finite_differences(name):
    make = META[name]
    p0, coef, target, direction, lr = _problem(SEED)

    def loss(lr_, p_):
        return _unroll(make, lr_, p_, coef, target)

    d_lr, d_p = torch.func.grad(loss, argnums=(0, 1))(lr, p0)
    assert d_lr.dtype == F64 and d_lr.shape == ()
    assert set(d_p) == set(p0)
    for k in p0:
        assert d_p[k].shape == p0[k].shape and d_p[k].dtype == F64
        assert torch.isfinite(d_p[k]).all()

    h = 1e-6
    fd_lr = (loss(lr + h, p0) - loss(lr - h, p0)) / (2 * h)
    _close(d_lr, fd_lr, 1e-6)
    assert abs(float(d_lr)) > 1e-4  # the learning rate matters

    plus = {k: v + h * direction[k] for k, v in p0.items()}
    minus = {k: v - h * direction[k] for k, v in p0.items()}
    fd_dir = (loss(lr, plus) - loss(lr, minus)) / (2 * h)
    ad_dir = sum((d_p[k] * direction[k]).sum() for k in p0)
    _close(ad_dir, fd_dir, 1e-6)

    # A single coordinate as well (the scalar leaf), not only a direction.
    e = {k: torch.zeros_like(v) for k, v in p0.items()}
    e["s"] = torch.ones((), dtype=F64)
    fd_s = (loss(lr, {k: v + h * e[k] for k, v in p0.items()})
            - loss(lr, {k: v - h * e[k] for k, v in p0.items()})) / (2 * h)
    _close(d_p["s"], fd_s, 1e-6)


@pytest.mark.parametrize("name", ["adam", "lamb", "rmsprop", "sgd_momentum"])
def test_meta_gradient_float32_hyperparameter(name):
    """A float32 0-d learning-rate tensor also gets a gradient (checked loosely)."""
    make = META[name]
    p0, coef, target, _, _ = _problem(SEED + 1)
    p32 = {k: v.float() for k, v in p0.items()}
    c32 = {k: v.float() for k, v in coef.items()}
    t32 = {k: v.float() for k, v in target.items()}
    lr = torch.tensor(0.05)
    d_lr = torch.func.grad(lambda x: _unroll(make, x, p32, c32, t32))(lr)
    d_lr64 = torch.func.grad(lambda x: _unroll(make, x, p0, coef, target))(
        torch.tensor(0.05, dtype=F64))
    assert d_lr.dtype == torch.float32
    _close(d_lr, d_lr64, 1e-3)


@pytest.mark.parametrize("name", ["adam", "adamw", "lamb", "sgd_momentum", "rmsprop", "lion"])
def test_func_grad_values_equal_plain_eager(name):
    """The forward value under torch.func.grad equals the plain (no-transform) computation."""
    make = META[name]
    p0, coef, target, _, lr = _problem(SEED + 2)
    plain = _unroll(make, lr, p0, coef, target)
    _, value = torch.func.grad_and_value(lambda x: _unroll(make, x, p0, coef, target))(lr)
    # Same ops in float64; the step count is a tensor under torch.func, a host int outside.
    assert torch.allclose(value, plain, rtol=1e-12, atol=0), (float(value), float(plain))


@pytest.mark.parametrize("name", ["adam", "adamw", "lamb", "sgd_momentum", "rmsprop", "ademamix"])
@pytest.mark.parametrize("use_step", [False, True], ids=["update", "step"])
def test_plain_autograd_through_steps(name, use_step):
    make = META[name]
    p0, coef, target, _, lr = _problem(SEED + 3)
    d_lr_ref, d_p_ref = torch.func.grad(
        lambda a, b: _unroll(make, a, b, coef, target), argnums=(0, 1))(lr, p0)

    lr_leaf = lr.clone().requires_grad_(True)
    p_leaf = {k: v.clone().requires_grad_(True) for k, v in p0.items()}
    before = {k: v.detach().clone() for k, v in p_leaf.items()}
    with torch.enable_grad():
        loss = _unroll(make, lr_leaf, p_leaf, coef, target, use_step=use_step)
        grads = torch.autograd.grad(loss, [lr_leaf, *p_leaf.values()])
    assert torch.allclose(grads[0], d_lr_ref, rtol=1e-10, atol=1e-14)
    for g, k in zip(grads[1:], p_leaf):
        assert torch.allclose(g, d_p_ref[k], rtol=1e-10, atol=1e-14), k
    # The leaves themselves are untouched.
    for k, v in p_leaf.items():
        assert torch.equal(v.detach(), before[k])


def test_autograd_through_single_step_float32_params():
    """One adam step on fp32 params with requires_grad: d(sum p_new)/dp = 1 + d(update)/dp."""
    gen = torch.Generator().manual_seed(SEED + 4)
    p = torch.randn(5, 4, generator=gen).requires_grad_(True)
    tx = ftopt.adamw(0.1, weight_decay=0.5)
    state = tx.init({"p": p})
    with torch.enable_grad():
        g = {"p": p * 2.0}  # gradient that depends on p
        u, _ = tx.update(g, state, {"p": p})
        new_p = ftopt.apply_updates({"p": p}, u)["p"]
        (grad,) = torch.autograd.grad(new_p.sum(), p)
    assert new_p.requires_grad
    # Adam's first step is lr*sign(g) (up to eps), flat in g: only the decay term remains.
    expected = torch.full_like(p, 1.0 - 0.1 * 0.5)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5)


def test_func_grad_through_step_and_schedule():
    """A scheduled lr (count-dependent) under torch.func.grad w.r.t. the initial params."""
    p0, coef, target, direction, _ = _problem(SEED + 5)
    sched = ftopt.warmup_cosine_decay_schedule(0.0, 0.1, 2, 10, 0.01)

    def loss(p_):
        return _unroll(lambda lr: ftopt.adam(sched), None, p_, coef, target, use_step=True)

    d_p = torch.func.grad(loss)(p0)
    h = 1e-6
    plus = {k: v + h * direction[k] for k, v in p0.items()}
    minus = {k: v - h * direction[k] for k, v in p0.items()}
    fd = (loss(plus) - loss(minus)) / (2 * h)
    # The schedule's value is float32 (SPEC: a tensor count gives a float32 tensor), which
    # is a constant here; FD and AD see the same function.
    _close(sum((d_p[k] * direction[k]).sum() for k in p0), fd, 1e-5)


# --------------------------------------------------------------------------------- vmap

M = 4
VSHAPES = {"w": (6, 5), "b": (5,), "s": ()}

VMAP = {
    "adam": lambda: ftopt.adam(1e-2),
    "adamw": lambda: ftopt.adamw(1e-2, weight_decay=0.1),
    "sgd_momentum": lambda: ftopt.sgd(1e-2, momentum=0.9),
    "sgd_nesterov": lambda: ftopt.sgd(1e-2, momentum=0.9, nesterov=True),
    "ademamix": lambda: ftopt.ademamix(1e-2, b3=0.99, weight_decay=0.01),
    "lamb": lambda: ftopt.lamb(1e-2, weight_decay=0.1),
    "lars": lambda: ftopt.lars(0.1, weight_decay=0.01),
    "lion": lambda: ftopt.lion(1e-2),
    "rmsprop": lambda: ftopt.rmsprop(1e-2),
    "adagrad": lambda: ftopt.adagrad(1e-2),
    "clip_global_sgd": lambda: ftopt.chain(ftopt.clip_by_global_norm(1.0), ftopt.sgd(0.1)),
    "clip_param_ratio": lambda: ftopt.chain(
        ftopt.scale_by_adam(), ftopt.clip_by_param_norm_ratio(0.01),
        ftopt.scale_by_learning_rate(0.1)),
    "adam_skip_zeros": lambda: ftopt.adam(1e-2, skip_zeros=True),
    "adamw_skip_zeros": lambda: ftopt.adamw(1e-2, weight_decay=0.1, skip_zeros=True),
    "lamb_skip_zeros": lambda: ftopt.lamb(1e-2, weight_decay=0.1, skip_zeros=True),
    "clip_skip_zeros": lambda: ftopt.chain(ftopt.clip_by_global_norm(0.5), ftopt.trace(0.9),
                                           ftopt.scale_by_learning_rate(0.1),
                                           ftopt.skip_zeros()),
    "adam_schedule": lambda: ftopt.adam(ftopt.warmup_cosine_decay_schedule(0.0, 0.1, 2, 10)),
}


def _ensemble(seed):
    gen = torch.Generator().manual_seed(seed)
    # Members at very different scales: any norm mixed across members shows up.
    scales = torch.tensor([0.01, 1.0, 10.0, 100.0])
    params = {k: torch.randn((M, *s), generator=gen) * scales.view(-1, *[1] * len(s))
              for k, s in VSHAPES.items()}
    grads_seq = []
    for _ in range(3):
        g = {k: torch.randn((M, *s), generator=gen) * scales.view(-1, *[1] * len(s))
             for k, s in VSHAPES.items()}
        g["w"][torch.rand(g["w"].shape, generator=gen) < 0.3] = 0.0  # exact zeros
        g["w"][1] = 0.0  # one member's whole leaf has zero gradient
        grads_seq.append(g)
    return params, grads_seq


@pytest.mark.parametrize("name", sorted(VMAP))
def test_vmap_ensemble_equals_loop(name):
    params, grads_seq = _ensemble(SEED + 10)
    p = assert_vmap_matches_loop(VMAP[name](), params, grads_seq, 1e-6, 1e-7)
    # The params really moved (the test can fail by doing nothing).
    assert not torch.equal(p["b"], params["b"])


@pytest.mark.parametrize("name", ["adam_skip_zeros", "lamb_skip_zeros", "clip_skip_zeros"])
def test_vmap_skip_zeros_keeps_zero_grad_elements(name):
    tx = VMAP[name]()
    params, grads_seq = _ensemble(SEED + 11)
    g = grads_seq[0]
    state = torch.func.vmap(tx.init)(params)
    u, new_state = torch.func.vmap(lambda g_, s_, p_: tx.update(g_, s_, p_))(g, state, params)
    new_p = ftopt.apply_updates(params, u)
    zero = g["w"] == 0
    assert zero.any() and (~zero).any()
    assert torch.equal(new_p["w"][zero], params["w"][zero])
    assert not torch.equal(new_p["w"][~zero], params["w"][~zero])
    for old, new in zip(ftopt.tree.leaves(state), ftopt.tree.leaves(new_state)):
        if old.is_floating_point() and old.shape == params["w"].shape:
            assert torch.equal(new[zero], old[zero])


def test_vmap_norms_are_per_member():
    """clip_by_global_norm under vmap clips each member to its own norm."""
    params, grads_seq = _ensemble(SEED + 12)
    tx = ftopt.clip_by_global_norm(1.0)
    g = grads_seq[0]
    u, _ = torch.func.vmap(lambda g_, s_: tx.update(g_, s_))(g, torch.func.vmap(tx.init)(params))
    norms = torch.sqrt(sum(v.reshape(M, -1).pow(2).sum(1) for v in u.values()))
    raw = torch.sqrt(sum(v.reshape(M, -1).pow(2).sum(1) for v in g.values()))
    expected = torch.minimum(raw, torch.ones(M))
    torch.testing.assert_close(norms, expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------- functional_call training


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 16)
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def test_functional_call_training_loop_matches_torch_adam():
    torch.manual_seed(SEED + 20)
    model = _MLP()
    x = torch.randn(64, 4)
    y = torch.sin(x.sum(1, keepdim=True)) + 0.1 * x[:, :1] ** 2

    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    ref_model = _MLP()
    ref_model.load_state_dict(model.state_dict())

    def loss_fn(p, xb, yb):
        out = torch.func.functional_call(model, p, (xb,))
        return torch.mean((out - yb) ** 2)

    grad_fn = torch.func.grad_and_value(loss_fn)
    tx = ftopt.adam(3e-2)
    state = tx.init(params)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=3e-2)

    first = None
    for _ in range(50):
        grads, loss = grad_fn(params, x, y)
        first = float(loss) if first is None else first
        params, state = ftopt.step(tx, params, grads, state)

        ref_opt.zero_grad()
        ref_loss = torch.mean((ref_model(x) - y) ** 2)
        ref_loss.backward()
        ref_opt.step()
    final = float(loss_fn(params, x, y))
    assert final < 0.25 * first, (first, final)
    for k, v in ref_model.named_parameters():
        torch.testing.assert_close(params[k], v.detach(), rtol=1e-4, atol=1e-5, msg=k)
    assert int(state[0].count) == 50
    # The module's own parameters were not touched by the functional loop.
    for k, v in model.named_parameters():
        assert not torch.equal(v.detach(), params[k])


def test_module_loop_donated_step_matches_torch_adamw():
    """A plain nn.Module loop: ``step(..., donate=True)`` on the module's own Parameters
    (requires grad, grad mode on) writes them in place, builds no autograd graph and
    matches torch.optim.AdamW."""
    torch.manual_seed(SEED + 21)
    model, ref_model = _MLP(), _MLP()
    ref_model.load_state_dict(model.state_dict())
    x = torch.randn(64, 4)
    y = torch.sin(x.sum(1, keepdim=True))
    tx = ftopt.adamw(1e-2, weight_decay=0.1)
    state = tx.init(dict(model.named_parameters()))
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    ids = {k: id(p) for k, p in model.named_parameters()}
    for _ in range(20):
        for m in (model, ref_model):
            m.zero_grad()
            torch.mean((m(x) - y) ** 2).backward()
        grads = {k: p.grad for k, p in model.named_parameters()}
        params, state = ftopt.step(tx, dict(model.named_parameters()), grads, state,
                                   donate=True)
        ref_opt.step()
        assert all(p.grad_fn is None and p.requires_grad for p in params.values())
        assert all(v.grad_fn is None for v in ftopt.tree.leaves(state))
    assert {k: id(p) for k, p in model.named_parameters()} == ids
    for (k, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-6, msg=k)


def test_scalar_leaf_updates_keep_their_dtype_with_device_counts():
    """Under torch.func the per-step scalars are float64 0-d tensors (computed from the
    count tensor); a 0-d leaf must not be promoted by them: its update is in its compute
    dtype (float32 for 16-bit and float32 leaves), as for every other leaf."""
    tx = ftopt.adam(0.01)
    params = {"s": torch.tensor(0.5, dtype=torch.float16), "t": torch.tensor(-1.5),
              "v": torch.randn(3)}
    state = tx.init(params)
    grads = {"s": torch.tensor(0.25, dtype=torch.float16), "t": torch.tensor(0.75),
             "v": torch.randn(3)}
    seen = {}

    def total(g):
        u, _ = tx.update(g, state, params)
        seen.update({k: v.dtype for k, v in u.items()})
        return sum(v.float().sum() for v in u.values())

    torch.func.grad(total)(grads)
    assert seen == {"s": torch.float32, "t": torch.float32, "v": torch.float32}
    u, _ = tx.update(grads, state, params)
    assert {k: v.dtype for k, v in u.items()} == seen


@pytest.mark.parametrize("use_step", [False, True], ids=["update", "step"])
@pytest.mark.parametrize("name", ["adam", "sgd_momentum", "lamb"])
def test_backward_to_a_learning_rate_that_requires_grad(name, use_step):
    """Plain autograd (``lr.requires_grad``, params that do not) reaches the learning rate
    with the same value as ``torch.func.grad``: such a step must not take a path that
    writes with ``out=`` (which autograd refuses) or drops the graph."""
    make = META[name]
    p0, coef, target, _, lr = _problem(SEED + 2)
    expected = torch.func.grad(lambda x: _unroll(make, x, p0, coef, target, use_step))(lr)
    leaf = lr.clone().requires_grad_(True)
    _unroll(make, leaf, p0, coef, target, use_step).backward()
    _close(leaf.grad, expected, 1e-12)
