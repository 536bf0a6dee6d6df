"""``ftopt.Optimizer``'s bound step (:class:`ftopt.group_run.Lane`, :mod:`ftopt.lowering.
bound`): after a donated fused step, the next ones hand only the gradients to the tables
that step used, while every group holds the same transform, state and params. Any change
between steps must still reach the next step: a new lr or weight decay, a param swapped
in a group or given new storage, gradients re-allocated or missing, a group added, a
checkpoint loaded. The reference is AdamW written out in float64 from the values each
step had (one step count per group). Small sizes: the kernels run in the Triton
interpreter on the CPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ftopt
from ftopt.lowering import bound

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPES = [(5, 4), (4,), (3, 5), (5,), (2, 3)]  # 0-3 in the groups; 4 for a group added


class Reference:
    """AdamW in float64 over ``start``, one step count per group (as ``ftopt.Optimizer``
    keeps): a param without a gradient is left as it is, its group's count still
    advances where another param of the group has one."""

    def __init__(self, start: list):
        self.p = [s.clone() for s in start]
        self.mu = [torch.zeros_like(s) for s in start]
        self.nu = [torch.zeros_like(s) for s in start]
        self.counts: dict[int, int] = {}

    def step(self, groups: list, grads: dict) -> None:
        """``groups``: per group (its param indices, lr, b1, b2, weight decay);
        ``grads``: index -> float64 gradient (absent: no gradient)."""
        for k, (indices, lr, b1, b2, wd) in enumerate(groups):
            if not any(i in grads for i in indices):
                continue
            t = self.counts[k] = self.counts.get(k, 0) + 1
            for i in indices:
                if i not in grads:
                    continue
                g = grads[i]
                self.mu[i] = b1 * self.mu[i] + (1 - b1) * g
                self.nu[i] = b2 * self.nu[i] + (1 - b2) * g ** 2
                u = (self.mu[i] / (1 - b1 ** t)) / ((self.nu[i] / (1 - b2 ** t)).sqrt() + 1e-8)
                self.p[i] = self.p[i] - lr * (u + wd * self.p[i])


class Run:
    """The optimizer (two groups, or one) and the reference, stepped together."""

    def __init__(self, joined: bool, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        start = [torch.randn(s, generator=self.gen, dtype=torch.float64) for s in SHAPES]
        self.params = [torch.nn.Parameter(s.float().to(DEVICE)) for s in start]
        self.ref = Reference([p.detach().double().cpu() for p in self.params])
        if joined:
            groups = [{"params": [self.params[0], self.params[2]], "weight_decay": 0.1},
                      {"params": [self.params[1], self.params[3]], "weight_decay": 0.0,
                       "lr": 2e-2}]
        else:
            groups = [{"params": self.params[:4], "weight_decay": 0.1}]
        self.opt = ftopt.Optimizer(groups, ftopt.adamw, lr=1e-2, backend="fused")

    def index(self, p) -> int:
        return next(i for i, q in enumerate(self.params) if q is p)

    def values(self) -> list:
        """Per group: its param indices and hyperparameters now (for the reference)."""
        return [([self.index(p) for p in g["params"]], float(g["lr"]),
                 *map(float, g["betas"]), float(g["weight_decay"]))
                for g in self.opt.param_groups]

    def step(self, skip=()) -> None:
        """New gradient tensors for every param of a group but ``skip``; one step."""
        grads = {}
        for group in self.opt.param_groups:
            for p in group["params"]:
                i = self.index(p)
                if i in skip:
                    p.grad = None
                    continue
                grads[i] = torch.randn(p.shape, generator=self.gen, dtype=torch.float64)
                p.grad = grads[i].float().to(DEVICE)
        self.step_as_is({i: g.float().double() for i, g in grads.items()})

    def step_as_is(self, grads: dict | None = None) -> None:
        """One step with the gradients the params hold."""
        values = self.values()
        if grads is None:
            grads = {i: p.grad.double().cpu() for i, p in enumerate(self.params)
                     if p.grad is not None}
        self.opt.step()
        self.ref.step(values, grads)

    def check(self) -> None:
        for p, want in zip(self.params, self.ref.p):
            torch.testing.assert_close(p.detach().double().cpu(), want, rtol=1e-5, atol=1e-6)


@pytest.fixture
def bound_launches(monkeypatch):
    """The steps launched through the bound step."""
    found = []
    real = bound.BoundStep.launch
    monkeypatch.setattr(bound.BoundStep, "launch", lambda *a: (found.append(1), real(*a))[1])
    return found


@pytest.mark.parametrize("joined", [False, True], ids=["one group", "two groups"])
@pytest.mark.parametrize("native_grads", [False, True], ids=["python", "native"])
def test_changes_between_bound_steps_reach_the_next_step(joined, native_grads,
                                                         bound_launches, request,
                                                         monkeypatch):
    """Gradients read from Python, or in one native call (where it is built)."""
    if native_grads:
        request.getfixturevalue("native_checks")
    else:
        monkeypatch.setattr(bound.native, "module", lambda start=True: None)
    run = Run(joined, 1)
    run.step()
    run.step()
    assert len(bound_launches) == 1 and run.opt._lane is not None
    last = run.opt.param_groups[-1]
    last["lr"] = 0.03  # a new lr (a new float, as a scheduler writes)
    run.step()
    last["weight_decay"] = 0.25  # a live value: no rebuild, the same tables
    run.step()
    assert len(bound_launches) == 3
    # The same gradient tensors again (no new addresses), then a gradient whose storage
    # moved under the same tensor object.
    run.step_as_is()
    g0 = run.params[0].grad
    g0.data = torch.randn(g0.shape, generator=run.gen).to(DEVICE)
    run.step_as_is()
    assert len(bound_launches) == 5
    assert (run.opt._lane.bounds[0].reader is not None) == native_grads
    run.check()


@pytest.mark.parametrize("joined", [False, True], ids=["one group", "two groups"])
def test_a_param_swapped_or_moved_is_stepped_and_the_old_one_left(joined, bound_launches):
    run = Run(joined, 2)
    run.step()
    run.step()
    old = run.params[2]
    new = torch.nn.Parameter(old.detach().clone())
    group = run.opt.param_groups[0]
    group["params"][next(k for k, q in enumerate(group["params"]) if q is old)] = new
    run.params[2] = new
    kept = old.detach().clone()
    run.step()
    assert torch.equal(old.detach(), kept)
    # New storage for a param (same shape): the tensor check sends the step to the full
    # path, which steps the new storage.
    moved = run.params[1]
    was = moved.data
    moved.data = moved.data.clone()
    kept = was.clone()
    run.step()
    assert torch.equal(was, kept) and not torch.equal(moved.detach(), kept)
    run.step()
    run.check()
    assert len(bound_launches) >= 2 and run.opt._lane is not None


@pytest.mark.parametrize("joined", [False, True], ids=["one group", "two groups"])
def test_missing_gradients_and_an_added_group_after_bound_steps(joined, bound_launches):
    run = Run(joined, 3)
    run.step()
    run.step()
    run.step(skip={1})  # one param without a gradient: not stepped (its count advances)
    run.step()
    run.step(skip={0, 2} if joined else {0, 1, 2, 3})  # a whole group without gradients
    run.step()
    before = len(bound_launches)
    run.step()  # (bound again)
    assert len(bound_launches) == before + 1
    run.opt.add_param_group({"params": [run.params[4]], "weight_decay": 0.05, "lr": 3e-2})
    run.step()
    before = len(bound_launches)
    run.step()  # (the groups' new partition, bound)
    run.check()
    assert len(bound_launches) == before + 1


def test_a_bad_gradient_after_bound_steps_raises_by_path_and_changes_nothing():
    run = Run(True, 4)
    run.step()
    run.step()
    assert run.opt._lane is not None
    params = [p.detach().clone() for p in run.params]
    state = {i: {k: v.clone() for k, v in s.items()}
             for i, s in run.opt.state_dict()["state"].items()}
    for p in run.params[:4]:
        p.grad = torch.randn(p.shape, generator=run.gen).to(DEVICE)
    run.params[3].grad = run.params[3].grad.to_sparse()
    with pytest.raises(TypeError, match=r"param group 1: grad at \[1\]: a sparse"):
        run.opt.step()
    assert all(torch.equal(p, b) for p, b in zip(run.params, params))
    for i, s in run.opt.state_dict()["state"].items():
        assert all(torch.equal(v, state[i][k]) for k, v in s.items())
    run.step()
    run.check()


def test_a_loaded_checkpoint_is_stepped_from():
    """After ``load_state_dict`` the next step starts from the loaded state (new state
    tensors: the bound step of the old ones is dropped)."""
    run = Run(True, 5)
    run.step()
    saved = copy.deepcopy(run.opt.state_dict())  # (its tensors are the state's own)
    mu, nu = [m.clone() for m in run.ref.mu], [n.clone() for n in run.ref.nu]
    counts, p_saved = dict(run.ref.counts), [p.detach().clone() for p in run.params]
    run.step()
    run.step()
    with torch.no_grad():
        for p, s in zip(run.params, p_saved):
            p.copy_(s)
    run.opt.load_state_dict(saved)
    run.ref.mu, run.ref.nu, run.ref.counts = mu, nu, counts
    run.ref.p = [p.double().cpu() for p in p_saved]
    run.step()
    run.step()
    run.check()


def test_a_schedulers_numbers_reach_bound_steps_and_the_device_when_read():
    """A new float lr in a bound step is recorded as its live tensor's host value (the
    kernel takes it as a number); the tensor is written once a step reads it on the
    device: a step whose scalars are computed there (a tensor lr with no host value in
    the other group), or a step that is not bound (a param without a gradient)."""
    run = Run(True, 6)
    sched = torch.optim.lr_scheduler.LambdaLR(run.opt, lambda s: 0.8 ** s)
    run.step()
    sched.step()
    for _ in range(3):
        run.step()
        sched.step()
    live = [r.live["lr"] for r in run.opt._runs]
    assert run.opt._deferred and run.opt._lane is not None
    run.step(skip={1})  # not bound: every deferred value written first
    assert not run.opt._deferred
    assert [float(t) for t in live] == [g["lr"] for g in run.opt.param_groups]
    run.step()
    sched.step()
    run.step()
    sched.step()
    # A tensor lr in group 0 (the caller's: no host value, the scalars are computed on
    # the device) while group 1 gets new floats.
    run.opt.param_groups[0]["lr"] = torch.tensor(0.02, dtype=torch.float64, device=DEVICE)
    run.step()
    run.opt.param_groups[1]["lr"] = 0.011
    run.step()
    assert not run.opt._deferred and float(live[1]) == 0.011
    run.check()


def test_tables_that_do_not_fit_after_their_own_step_are_not_bound_again(monkeypatch):
    """Where the tensors do not fit the tables right after a step over them (as for
    DTensor shards), the tables are refused once, not flattened again on every step;
    the steps go on on the usual path, and new tables are bound again."""
    run = Run(True, 7)
    built = []
    real_init, real_fits = bound.BoundStep.__init__, bound.BoundStep.fits
    monkeypatch.setattr(bound.BoundStep, "__init__",
                        lambda self, *a: (built.append(1), real_init(self, *a))[1])
    monkeypatch.setattr(bound.BoundStep, "fits", lambda self, grads: False)
    for _ in range(4):
        run.step()
    assert run.opt._lane is None and len(built) == 1
    monkeypatch.setattr(bound.BoundStep, "fits", real_fits)
    run.step()  # (the same tables: still refused)
    assert run.opt._lane is None and len(built) == 1
    new = torch.nn.Parameter(run.params[0].detach().clone())
    run.opt.param_groups[0]["params"][0] = new  # new tables, bound
    run.params[0] = new
    run.step()
    run.step()
    assert run.opt._lane is not None and len(built) == 2
    run.check()


def test_groups_stepped_one_by_one_are_bound_each(bound_launches, monkeypatch):
    """Groups that are not joined (here: the partition refused) step as their own bound
    steps, every group's tensors checked before any launches; a group without gradients
    sends the step to the usual path, and the groups are bound again after."""
    run = Run(True, 8)
    monkeypatch.setattr(run.opt._joiner, "step", lambda *a: None)
    run.step()
    run.step()
    assert len(bound_launches) == 2 and len(run.opt._lane.bounds) == 2
    run.opt.param_groups[1]["lr"] = 0.04
    run.step()
    run.step(skip={1, 3})
    run.step()
    run.step()
    assert len(bound_launches) == 6
    run.check()
