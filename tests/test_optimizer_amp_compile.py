"""``ftopt.Optimizer`` under ``torch.amp.GradScaler`` (a step with an infinite gradient is
skipped: params and states bit-identical, step count unchanged, the scale halved) and
inside a ``torch.compile``d function (the same bits as the plain call)."""

from __future__ import annotations

import copy

import pytest
import torch

import ftopt

pytestmark = pytest.mark.usefixtures("one_thread")


def _setup(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = ftopt.Optimizer(model.parameters(), ftopt.adamw, lr=1e-2, weight_decay=0.1)
    return model, opt, torch.randn(32, 8), torch.randn(32, 1)


def _snapshot(model, opt):
    state = {i: {k: v.clone() for k, v in s.items()}
             for i, s in opt.state_dict()["state"].items()}
    return [p.detach().clone() for p in model.parameters()], state


def _same(a, b) -> bool:
    params_a, state_a = a
    params_b, state_b = b
    return (all(torch.equal(x, y) for x, y in zip(params_a, params_b))
            and state_a.keys() == state_b.keys()
            and all(torch.equal(state_a[i][k], state_b[i][k]) for i in state_a
                    for k in state_a[i]))


def test_grad_scaler_skips_a_step_with_an_infinite_gradient():
    model, opt, x, y = _setup(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)

    def train_step(poison: bool = False):
        opt.zero_grad()
        scaler.scale((model(x) - y).pow(2).mean()).backward()
        if poison:
            model[0].weight.grad[1, 2] = float("inf")
        scaler.step(opt)
        scaler.update()

    train_step()
    train_step()
    before, scale = _snapshot(model, opt), scaler.get_scale()
    assert int(before[1][0]["step"]) == 2
    train_step(poison=True)
    assert _same(_snapshot(model, opt), before)  # nothing written, count included
    assert scaler.get_scale() == scale / 2
    train_step()
    after = _snapshot(model, opt)
    assert int(after[1][0]["step"]) == 3 and not torch.equal(after[0][0], before[0][0])


def test_grad_scaler_step_equals_an_unscaled_step():
    """Scaling by a power of two and unscaling is exact: the same bits as no scaler."""
    model, opt, x, y = _setup(1)
    plain = copy.deepcopy(model)
    plain_opt = ftopt.Optimizer(plain.parameters(), ftopt.adamw, lr=1e-2, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    for _ in range(3):
        opt.zero_grad()
        scaler.scale((model(x) - y).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        plain_opt.zero_grad()
        (plain(x) - y).pow(2).mean().backward()
        plain_opt.step()
    assert _same(_snapshot(model, opt), _snapshot(plain, plain_opt))


def test_compiled_function_calling_step():
    model, opt, x, y = _setup(2)
    reference = copy.deepcopy(model)
    ref_opt = ftopt.Optimizer(reference.parameters(), ftopt.adamw, lr=1e-2, weight_decay=0.1)

    # aot_eager: dynamo and AOT autograd trace it as inductor would, without compiling C++.
    @torch.compile(backend="aot_eager")
    def optimizer_step():
        opt.step()

    for _ in range(3):
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            (m(x) - y).pow(2).mean().backward()
        optimizer_step()
        ref_opt.step()
    assert _same(_snapshot(model, opt), _snapshot(reference, ref_opt))
    assert int(opt.state_dict()["state"][0]["step"]) == 3
