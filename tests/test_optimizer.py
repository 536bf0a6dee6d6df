"""``ftopt.Optimizer``: the ``torch.optim.Optimizer`` front door.

Against torch's own optimizers under torch LR schedulers; live hyperparameters (a
scheduler's ``lr`` takes effect without a new transform or kernel); ``state_dict`` through
``torch.save``/``torch.load`` resuming bit-exactly (eager, fused in the interpreter, 8-bit
states); skipped ``grad=None`` params; closures; ``add_param_group``; ``GradScaler``; and
bad input that raises before anything is written.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

import ftopt
from ftopt.lowering import kernel_files

pytestmark = pytest.mark.usefixtures("one_thread")

# On a GPU machine the fused cases run the compiled kernels (the CPU runs them in the
# Triton interpreter); checkpoints are still loaded with map_location="cpu".
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _model(seed: int, width: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, 1)).to(DEVICE)


def _batches(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 8, generator=gen).to(DEVICE),
             torch.randn(32, 1, generator=gen).to(DEVICE)) for _ in range(n)]


def _train(model, opt, batches, scheduler=None):
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def _max_rel(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(((p - q).abs().max() / q.abs().max()).item()
               for p, q in zip(a.parameters(), b.parameters()))


SCHEDULERS = {
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=12),
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05,
                                                              total_steps=12),
}
PAIRS = {  # (ftopt factory and hyperparameters, torch optimizer)
    "adamw": (ftopt.adamw, dict(lr=0.01, weight_decay=0.1, betas=(0.8, 0.99)),
              lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, betas=(0.8, 0.99))),
    "adam": (ftopt.adam, dict(lr=0.01), lambda p: torch.optim.Adam(p, lr=0.01)),
    "sgd": (ftopt.sgd, dict(lr=0.05, momentum=0.9),
            lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
}


@pytest.mark.parametrize("sched", sorted(SCHEDULERS))
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_matches_torch_under_lr_schedulers(name, sched):
    factory, hparams, make_torch = PAIRS[name]
    ours, theirs = _model(1), _model(1)
    opt = ftopt.Optimizer(ours.named_parameters(), factory, **hparams)
    ref = make_torch(theirs.parameters())
    s1, s2 = SCHEDULERS[sched](opt), SCHEDULERS[sched](ref)
    batches = _batches(2, 12)
    _train(ours, opt, batches, s1)
    _train(theirs, ref, batches, s2)
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
    assert _max_rel(ours, theirs) < 2e-5
    assert _max_rel(ours, _model(1)) > 1e-3  # it trained


def _reference_run(factory, hparams_per_step, params, grads_per_step, backend):
    """ftopt.step with a new transform of float hyperparameters at every step."""
    params = [p.detach().clone() for p in params]
    state = None
    for hp, grads in zip(hparams_per_step, grads_per_step):
        tx = factory(**hp)
        state = tx.init(params) if state is None else state
        params, state = ftopt.step(tx, params, grads, state, backend=backend)
    return params


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_live_hyperparameters_equal_fixed_ones_bit_for_bit(backend):
    """A scheduler's values reach the step exactly as float hyperparameters would, with
    one transform for the whole run and, fused, no kernel compiled after the first."""
    gen = torch.Generator().manual_seed(11)
    params = [torch.randn(40, 3, generator=gen).to(DEVICE),
              torch.randn(7, generator=gen).to(DEVICE)]
    grads = [[torch.randn_like(p) for p in params] for _ in range(5)]
    lrs = [0.1, 0.05, 0.02, 0.3, 0.0]
    b1s = [0.9, 0.8, 0.95, 0.5, 0.9]
    live = [torch.nn.Parameter(p.clone()) for p in params]
    opt = ftopt.Optimizer(live, ftopt.adamw, lr=lrs[0], weight_decay=0.05, backend=backend)
    first_tx = opt._runs[0].tx
    modules = None
    for step, (lr, b1, g) in enumerate(zip(lrs, b1s, grads)):
        opt.param_groups[0]["lr"] = lr
        opt.param_groups[0]["betas"] = (b1, 0.999)
        for p, gi in zip(live, g):
            p.grad = gi.clone()
        opt.step()
        if step == 0:
            modules = len(kernel_files._MODULES)
    assert opt._runs[0].tx is first_tx
    assert len(kernel_files._MODULES) == modules
    expected = _reference_run(
        ftopt.adamw, [dict(learning_rate=lr, b1=b1, weight_decay=0.05) for lr, b1 in
                      zip(lrs, b1s)], params, grads, backend)
    for p, e in zip(live, expected):
        assert torch.equal(p.detach(), e)


def _save_load(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, map_location="cpu", weights_only=True)


RESUME = {
    "adamw": (ftopt.adamw, dict(lr=0.01, weight_decay=0.1)),
    "adamw_8bit": (ftopt.adamw, dict(lr=0.01, state_bits=8)),
    "sgd_nesterov": (ftopt.sgd, dict(lr=0.05, momentum=0.9, nesterov=True)),
    "lion_skip_zeros": (ftopt.lion, dict(lr=0.001, skip_zeros=True)),
}


@pytest.mark.parametrize("named", [True, False])
@pytest.mark.parametrize("backend", ["eager", "fused"])
@pytest.mark.parametrize("name", sorted(RESUME))
def test_state_dict_resumes_bit_exactly(name, backend, named):
    factory, hparams = RESUME[name]
    width = 512 if "8bit" in name else 16  # 8-bit states from 4096 elements on
    batches = _batches(3, 6)

    def fresh():
        model = _model(4, width)
        params = model.named_parameters() if named else model.parameters()
        groups = [{"params": [p for p in params]}]
        groups = [{"params": groups[0]["params"][:2]},
                  {"params": groups[0]["params"][2:], "lr": hparams["lr"] / 2}]
        opt = ftopt.Optimizer(groups, factory, backend=backend, **hparams)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)

    straight, opt, sched = fresh()
    _train(straight, opt, batches, sched)

    first, opt, sched = fresh()
    _train(first, opt, batches[:3], sched)
    saved = _save_load({"model": first.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()})
    if "8bit" in name:
        big = saved["opt"]["state"][0]
        assert big["mu.codes"].dtype == torch.uint8 and big["mu.absmax"].dtype == torch.float32
    resumed, opt2, sched2 = fresh()
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    _train(resumed, opt2, batches[3:], sched2)
    for p, q in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(p, q)
    state = opt2.state_dict()["state"]
    assert all(int(s["step"]) == 6 for s in state.values() if "step" in s)


def test_state_views_are_the_live_state():
    model = _model(5)
    opt = ftopt.Optimizer(model.parameters(), ftopt.adam, lr=0.01)
    _train(model, opt, _batches(5, 2))
    weight = model[0].weight
    mu = opt.state[weight]["mu"]
    before = mu.clone()
    _train(model, opt, _batches(6, 1))
    assert opt.state[weight]["mu"] is mu and not torch.equal(mu, before)
    assert int(opt.state[weight]["step"]) == 3
    assert opt.state_dict()["state"][0]["mu"] is mu


def test_load_rejects_a_mismatched_checkpoint_and_changes_nothing():
    model = _model(6, 512)
    opt = ftopt.Optimizer(model.parameters(), ftopt.adam, lr=0.01)
    _train(model, opt, _batches(6, 2))
    other_model = _model(7, 512)
    other = ftopt.Optimizer(other_model.parameters(), ftopt.adam, lr=0.02, state_bits=8)
    _train(other_model, other, _batches(7, 1))
    before = {i: {k: v.clone() for k, v in s.items()} for i, s in
              opt.state_dict()["state"].items()}
    # The saved hyperparameters win (as in torch): an 8-bit checkpoint makes 8-bit
    # states, unless the checkpoint's own group says 32.
    bad = _save_load(other.state_dict())
    bad["param_groups"][0]["state_bits"] = 32
    with pytest.raises(ValueError, match=r"state of param 0 does not match.*mu\.codes"):
        opt.load_state_dict(bad)
    sgd_model = _model(8, 512)
    sgd = ftopt.Optimizer(sgd_model.parameters(), ftopt.sgd, lr=0.1, momentum=0.9)
    _train(sgd_model, sgd, _batches(8, 1))
    with pytest.raises(ValueError, match=r"lacks hyperparameters \['eps'"):
        opt.load_state_dict(_save_load(sgd.state_dict()))
    bad = _save_load(opt.state_dict())
    bad["state"][0]["nu"] = bad["state"][0]["nu"][:3]
    with pytest.raises(ValueError, match=r"state 'nu' of param 0: shape \(3, 8\)"):
        opt.load_state_dict(bad)
    bad = _save_load(opt.state_dict())
    bad["state"][3]["step"] = torch.tensor(5.0)
    with pytest.raises(ValueError, match=r"state 'step' of param 3 .*differs from param 0"):
        opt.load_state_dict(bad)
    assert opt.param_groups[0]["lr"] == 0.01
    after = opt.state_dict()["state"]
    assert all(torch.equal(after[i][k], v) for i, s in before.items() for k, v in s.items())


def test_params_without_grad_are_skipped():
    model = _model(8)
    opt = ftopt.Optimizer(model.parameters(), ftopt.adam, lr=0.05)
    _train(model, opt, _batches(8, 2))
    frozen = model[2].weight
    kept, mu = frozen.detach().clone(), opt.state[frozen]["mu"].clone()
    x, y = _batches(9, 1)[0]
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    frozen.grad = None
    opt.step()
    assert torch.equal(frozen, kept) and torch.equal(opt.state[frozen]["mu"], mu)
    assert not torch.equal(opt.state[model[0].weight]["mu"], mu.new_zeros(()))


def test_closure_is_evaluated_with_grad_and_its_loss_returned():
    model, twin = _model(9), _model(9)
    opt = ftopt.Optimizer(model.parameters(), ftopt.sgd, lr=0.1)
    ref = torch.optim.SGD(twin.parameters(), lr=0.1)
    x, y = _batches(10, 1)[0]

    def closure(m, o):
        def run():
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            return loss
        return run

    with torch.no_grad():
        loss = opt.step(closure(model, opt))
    expected = ref.step(closure(twin, ref))
    assert torch.equal(loss, expected)
    assert _max_rel(model, twin) < 1e-6


def test_add_param_group_steps_the_new_group_with_its_own_hyperparameters():
    model = _model(10)
    first, second = list(model[0].parameters()), list(model[2].parameters())
    opt = ftopt.Optimizer(first, ftopt.sgd, lr=0.1)
    opt.add_param_group({"params": second, "learning_rate": 0.0})
    assert opt.param_groups[1]["lr"] == 0.0 and "learning_rate" not in opt.param_groups[1]
    kept = [p.detach().clone() for p in second]
    moved = [p.detach().clone() for p in first]
    _train(model, opt, _batches(10, 1))
    assert all(torch.equal(p, k) for p, k in zip(second, kept))
    assert not any(torch.equal(p, k) for p, k in zip(first, moved))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_scaler_skips_infinite_steps(dtype):
    if DEVICE.type == "cuda" and dtype != torch.float32:
        pytest.skip("torch's CUDA GradScaler refuses low-precision gradients "
                    "('Attempting to unscale FP16 gradients'); fp32 params run here")
    model = _model(11).to(dtype)
    opt = ftopt.Optimizer(model.parameters(), ftopt.adam, lr=0.01)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0 ** 10)
    steps = 0
    for i, (x, y) in enumerate(_batches(12, 4)):
        opt.zero_grad()
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        scaler.scale(loss).backward()
        if i == 2:
            model[0].weight.grad[0, 0] = float("inf")
            kept = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scale = scaler.get_scale()
        scaler.update()
        if i == 2:
            assert all(torch.equal(p, k) for p, k in zip(model.parameters(), kept))
            assert scaler.get_scale() < scale
        else:
            steps += 1
    assert int(opt.state[model[0].weight]["step"]) == steps == 3


def test_bad_hyperparameters_raise_before_anything_is_written():
    model = _model(12)
    opt = ftopt.Optimizer(model.parameters(), ftopt.adam, lr=0.01)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, device=DEVICE))],
                         "lr": 0.1})
    _train(model, opt, _batches(12, 1))
    kept = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[1]["lr"] = -1.0
    x, y = _batches(13, 1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(ValueError, match="param group 1: lr must be >= 0"):
        opt.step()
    opt.param_groups[1]["lr"] = 0.1
    opt.param_groups[0]["betas"] = (0.9, float("nan"))
    with pytest.raises(ValueError, match="param group 0: betas must be a finite number"):
        opt.step()
    assert all(torch.equal(p, k) for p, k in zip(model.parameters(), kept))
    with pytest.raises(TypeError, match=r"factory sgd rejected .*betas as b1, b2\): .*'b1'"):
        ftopt.Optimizer(model.parameters(), ftopt.sgd, lr=0.1, betas=(0.9, 0.99))
    with pytest.raises(TypeError, match="need a factory"):
        ftopt.Optimizer(model.parameters(), ftopt.sgd(0.1), lr=0.1)
    with pytest.raises(TypeError, match="call a factory|expected a GradientTransformation"):
        ftopt.Optimizer(model.parameters(), 3)


def test_a_fixed_transform_is_used_as_is():
    model, twin = _model(13), _model(13)
    opt = ftopt.Optimizer(model.parameters(), ftopt.adam(0.01))
    assert "lr" not in opt.param_groups[0]
    _train(model, opt, _batches(14, 3))
    params = [p.detach().clone() for p in twin.parameters()]
    tx = ftopt.adam(0.01)
    state = tx.init(params)
    for x, y in _batches(14, 3):
        twin.zero_grad()
        torch.nn.functional.mse_loss(twin(x), y).backward()
        params, state = ftopt.step(tx, params, [p.grad for p in twin.parameters()], state)
        with torch.no_grad():
            for p, new in zip(twin.parameters(), params):
                p.copy_(new)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))


def test_explain_reports_the_donated_step():
    model = _model(14)
    params = dict(model.named_parameters())
    plain = ftopt.explain(ftopt.adam(0.01), params, backend="fused", file=io.StringIO())
    donated = ftopt.explain(ftopt.adam(0.01), params, donate=True, backend="fused",
                            file=io.StringIO())
    assert "path: eager (param requires grad at ['0.bias']" in plain
    assert "path: fused" in donated and "eager" not in donated
    assert donated.startswith("ftopt plan (donated step)")
    # What explain says is what the optimizer's (donated) step does: backend="fused"
    # raises where the step cannot fuse.
    twin = copy.deepcopy(model)
    opt = ftopt.Optimizer(twin.named_parameters(), ftopt.adam, lr=0.01, backend="fused")
    _train(twin, opt, _batches(15, 1))
    assert not torch.equal(twin[0].weight, model[0].weight)


def test_a_bad_gradient_names_the_group_and_param_and_changes_nothing():
    model = _model(15)
    opt = ftopt.Optimizer(model.named_parameters(), ftopt.adam, lr=0.1)
    _train(model, opt, _batches(16, 1))
    kept = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in opt.state[model[0].bias].items()}
    x, y = _batches(17, 1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    model[2].weight.grad = model[2].weight.grad.to_sparse()
    with pytest.raises(TypeError, match=r"param group 0: grad at \['2.weight'\]: a sparse"):
        opt.step()
    assert all(torch.equal(p, k) for p, k in zip(model.parameters(), kept))
    assert all(torch.equal(opt.state[model[0].bias][k], v) for k, v in state.items())
