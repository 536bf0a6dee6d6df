"""Porting optimizer state from and to ``torch.optim``: continuing from a ported state
matches continuing the original optimizer (fp32 rounding), both ways, for Adam, AdamW,
Adam with L2 decay, SGD (momentum, Nesterov), RMSprop (with momentum) and Adagrad; and
what cannot be ported raises, naming the param index and the reason."""

from __future__ import annotations

import pytest
import torch
from step_checks import ftopt_steps, torch_optimizer_steps

import ftopt

pytestmark = pytest.mark.usefixtures("one_thread")

LR = 0.01
PAIRS = {
    "adam": (lambda p: torch.optim.Adam(p, lr=LR, betas=(0.8, 0.99), eps=1e-7),
             lambda: ftopt.adam(LR, 0.8, 0.99, 1e-7)),
    "adamw": (lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=0.1),
              lambda: ftopt.adamw(LR, weight_decay=0.1)),
    "adam_l2": (lambda p: torch.optim.Adam(p, lr=LR, weight_decay=0.05),
                lambda: ftopt.chain(ftopt.add_decayed_weights(0.05), ftopt.scale_by_adam(),
                                    ftopt.scale_by_learning_rate(LR))),
    "sgd_momentum": (lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9),
                     lambda: ftopt.sgd(LR, 0.9)),
    "sgd_nesterov": (lambda p: torch.optim.SGD(p, lr=LR, momentum=0.8, nesterov=True),
                     lambda: ftopt.sgd(LR, 0.8, nesterov=True)),
    "rmsprop": (lambda p: torch.optim.RMSprop(p, lr=LR, alpha=0.95, eps=1e-6),
                lambda: ftopt.rmsprop(LR, decay=0.95, eps=1e-6, eps_in_sqrt=False)),
    "rmsprop_momentum": (
        lambda p: torch.optim.RMSprop(p, lr=LR, alpha=0.9, eps=1e-6, momentum=0.7),
        lambda: ftopt.rmsprop(LR, decay=0.9, eps=1e-6, eps_in_sqrt=False, momentum=0.7)),
    "rmsprop_centered": (
        lambda p: torch.optim.RMSprop(p, lr=LR, alpha=0.9, eps=1e-6, momentum=0.5,
                                      centered=True),
        lambda: ftopt.rmsprop(LR, decay=0.9, eps=1e-6, eps_in_sqrt=False, centered=True,
                              momentum=0.5)),
    "adagrad": (lambda p: torch.optim.Adagrad(p, lr=LR, eps=1e-8,
                                              initial_accumulator_value=0.1),
                lambda: ftopt.chain(ftopt.scale_by_rss(0.1, 1e-8, eps_in_sqrt=False),
                                    ftopt.scale_by_learning_rate(LR))),
}
# Not sorted by name: the torch index follows the order given, not optree's.
NAMES = ("z.weight", "a.bias", "m.weight")
SHAPES = ((6, 5), (7,), (3, 4))


def _setup(seed: int, steps: int):
    gen = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(s, generator=gen) for n, s in zip(NAMES, SHAPES)}
    grads = [{n: torch.randn(s, generator=gen) for n, s in zip(NAMES, SHAPES)}
             for _ in range(steps)]
    return params, grads


def _torch_steps(opt, tensors, grads):
    torch_optimizer_steps(opt, tensors, NAMES, grads)


def _close(ours: dict, theirs: list, rtol: float = 2e-5) -> None:
    for n, t in zip(NAMES, theirs):
        scale = t.detach().abs().max()
        err = (ours[n] - t.detach()).abs().max() / scale
        assert err < rtol, f"{n}: relative error {err:.2e}"


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_from_torch_continues_as_torch(name):
    make_torch, make_tx = PAIRS[name]
    params, grads = _setup(1, 15)
    tensors = [torch.nn.Parameter(params[n].clone()) for n in NAMES]
    opt = make_torch(tensors)
    _torch_steps(opt, tensors, grads[:5])
    tx = make_tx()
    here = {n: t.detach().clone() for n, t in zip(NAMES, tensors)}
    state = ftopt.from_torch_state_dict(opt.state_dict(), tx, here)
    ours, _ = ftopt_steps(tx, here, state, grads[5:])
    _torch_steps(opt, tensors, grads[5:])
    _close(ours, tensors)
    # The control: a fresh state does not continue as torch.
    fresh, _ = ftopt_steps(tx, here, tx.init(here), grads[5:])
    with pytest.raises(AssertionError):
        _close(fresh, tensors, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_to_torch_continues_as_ftopt(name):
    make_torch, make_tx = PAIRS[name]
    params, grads = _setup(2, 15)
    tx = make_tx()
    params, state = ftopt_steps(tx, params, tx.init(params), grads[:5])
    tensors = [torch.nn.Parameter(params[n].clone()) for n in NAMES]
    opt = make_torch(tensors)
    groups = None if "nesterov" in name else [{"params": [0, 1, 2]}]
    if groups is not None:  # hyperparameters read off tx
        sd = ftopt.to_torch_state_dict(state, tx, params)
    else:
        sd = ftopt.to_torch_state_dict(state, tx, params,
                                       param_groups=opt.state_dict()["param_groups"])
    opt.load_state_dict(sd)
    _torch_steps(opt, tensors, grads[5:])
    ours, _ = ftopt_steps(tx, params, state, grads[5:])
    _close(ours, tensors)


def test_round_trip_and_named_torch_params():
    params, grads = _setup(3, 4)
    tensors = [torch.nn.Parameter(params[n].clone()) for n in NAMES]
    opt = torch.optim.AdamW(list(zip(NAMES, tensors)), lr=LR)
    _torch_steps(opt, tensors, grads)
    tx = ftopt.adamw(LR)
    reordered = {n: params[n] for n in sorted(NAMES)}  # matched by name, not order
    state = ftopt.from_torch_state_dict(opt.state_dict(), tx, reordered)
    assert int(state[0].count) == 4
    assert torch.equal(state[0].mu["z.weight"], opt.state[tensors[0]]["exp_avg"])
    back = ftopt.to_torch_state_dict(state, tx, params)
    for i, t in enumerate(tensors):
        assert torch.equal(back["state"][i]["exp_avg_sq"], opt.state[t]["exp_avg_sq"])
        assert float(back["state"][i]["step"]) == 4.0


def test_eight_bit_states_are_quantized_from_torch():
    gen = torch.Generator().manual_seed(4)
    p = torch.nn.Parameter(torch.randn(64, 128, generator=gen))
    opt = torch.optim.Adam([p], lr=LR)
    for _ in range(3):
        p.grad = torch.randn(64, 128, generator=gen)
        opt.step()
    tx = ftopt.adam(LR, state_bits=8)
    state = ftopt.from_torch_state_dict(opt.state_dict(), tx, [p.detach()])
    mu = state[0].mu[0]
    assert mu.codes.dtype == torch.uint8 and mu.absmax.shape == (32,)
    back = ftopt.to_torch_state_dict(state, tx, [p.detach()])["state"][0]["exp_avg"]
    exact = opt.state[p]["exp_avg"]
    assert not torch.equal(back, exact)
    assert (back - exact).abs().max() <= 0.02 * exact.abs().max()


def test_what_cannot_be_ported_names_the_param_and_the_reason():
    params, grads = _setup(5, 3)
    tensors = [torch.nn.Parameter(params[n].clone()) for n in NAMES]
    amsgrad = torch.optim.Adam(tensors, lr=LR, amsgrad=True)
    _torch_steps(amsgrad, tensors, grads)
    with pytest.raises(ValueError, match="param 0: amsgrad=True cannot be ported"):
        ftopt.from_torch_state_dict(amsgrad.state_dict(), ftopt.adam(LR), params)
    sd = amsgrad.state_dict()
    sd["param_groups"][0]["amsgrad"] = False
    with pytest.raises(ValueError, match="param 0: torch state 'max_exp_avg_sq'.*amsgrad"):
        ftopt.from_torch_state_dict(sd, ftopt.adam(LR), params)
    adam = torch.optim.Adam(tensors, lr=LR)
    _torch_steps(adam, tensors, grads[:2])
    tensors[1].grad = None
    adam.step()  # param 1 is not stepped: its step count lags
    with pytest.raises(ValueError, match="param 1 has step 2, param 0 has 3"):
        ftopt.from_torch_state_dict(adam.state_dict(), ftopt.adam(LR), params)
    with pytest.raises(ValueError, match="scale_by_lion has no torch.optim counterpart"):
        ftopt.from_torch_state_dict(adam.state_dict(), ftopt.lion(LR), params)
    nadam = torch.optim.NAdam(tensors, lr=LR)
    _torch_steps(nadam, tensors, grads[:1])
    with pytest.raises(ValueError, match="'mu_product' cannot be ported"):
        ftopt.from_torch_state_dict(nadam.state_dict(), ftopt.adam(LR), params)
    with pytest.raises(ValueError, match="hold 3 params, params holds 1 tensors"):
        ftopt.from_torch_state_dict(adam.state_dict(), ftopt.adam(LR), {"w": params["a.bias"]})
    centered = torch.optim.RMSprop(tensors, lr=LR, centered=True)
    _torch_steps(centered, tensors, grads[:1])
    with pytest.raises(ValueError, match="param 0: centered=True cannot be ported"):
        ftopt.from_torch_state_dict(centered.state_dict(), ftopt.rmsprop(LR), params)
    plain = torch.optim.RMSprop(tensors, lr=LR)
    with pytest.raises(ValueError, match="param 0: centered=False cannot be ported"):
        ftopt.from_torch_state_dict(plain.state_dict(), ftopt.rmsprop(LR, centered=True),
                                    params)
    dampened = torch.optim.SGD(tensors, lr=LR, momentum=0.9, dampening=0.1)
    with pytest.raises(ValueError, match="param 0: dampening=0.1"):
        ftopt.from_torch_state_dict(dampened.state_dict(), ftopt.sgd(LR, 0.9), params)
