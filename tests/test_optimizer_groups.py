"""``ftopt.Optimizer`` param groups as one fused partition (:mod:`ftopt.param_groups`).

Groups whose transforms are the same chain of rules step as one launch per dtype group;
the results must equal separate single-group optimizers and the eager path, live
hyperparameters written by torch schedulers must apply without a recompile, and
checkpoints keep torch's format. Small sizes: the kernels run in the Triton interpreter
on the CPU.
"""

from __future__ import annotations

import io

import optree
import pytest
import torch

import ftopt
from ftopt import param_groups
from ftopt.lowering import codegen

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(),
                               torch.nn.LayerNorm(10), torch.nn.Linear(10, 3)).to(DEVICE)


def _groups(model, named: bool = True, lr_other: float = 3e-2) -> list[dict]:
    pairs = list(model.named_parameters())
    decay = [(n, p) for n, p in pairs if p.ndim > 1]
    other = [(n, p) for n, p in pairs if p.ndim <= 1]

    def params(chosen):
        return chosen if named else [p for _, p in chosen]

    return [{"params": params(decay), "weight_decay": 0.1},
            {"params": params(other), "weight_decay": 0.0, "lr": lr_other, "betas": (0.8, 0.95)}]


def _batches(seed: int, n: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(7, 6, generator=g).to(DEVICE), torch.randn(7, 3, generator=g).to(DEVICE))
            for _ in range(n)]


def _train(model, opt, batches, sched=None) -> None:
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if sched is not None:
            sched.step()


@pytest.fixture
def launches(kernel_launches):
    return kernel_launches


@pytest.mark.parametrize("named", [True, False])
def test_two_groups_one_launch_equal_to_separate_optimizers_and_eager(launches, named):
    batches = _batches(1, 4)
    joined = _model(0)
    opt = ftopt.Optimizer(_groups(joined, named), ftopt.adamw, lr=1e-2, backend="fused")
    for k in range(len(batches)):
        _train(joined, opt, batches[k:k + 1])
        assert len(launches) == k + 1  # two param groups, one kernel per step
    assert opt._joiner.joined is not None and opt._joiner.joined.reason is None

    # The same groups as two optimizers, each stepping its own group's params.
    apart = _model(0)
    opts = [ftopt.Optimizer([g], ftopt.adamw, lr=1e-2, backend="fused")
            for g in _groups(apart, named)]
    eager = _model(0)
    eager_opt = ftopt.Optimizer(_groups(eager, named), ftopt.adamw, lr=1e-2,
                                backend="eager")
    for x, y in batches:
        for o in opts:
            o.zero_grad()
        torch.nn.functional.mse_loss(apart(x), y).backward()
        for o in opts:
            o.step()
        _train(eager, eager_opt, [(x, y)])
    for p, q, r in zip(joined.parameters(), apart.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
    ours = opt.state_dict()["state"]
    theirs = eager_opt.state_dict()["state"]
    assert ours.keys() == theirs.keys()
    for i in ours:
        assert ours[i].keys() == theirs[i].keys() == {"step", "mu", "nu"}
        for k in ours[i]:
            torch.testing.assert_close(ours[i][k].float(), theirs[i][k].float(), rtol=1e-6,
                                       atol=1e-7)
        assert int(ours[i]["step"]) == len(batches)


def test_float64_formula_per_group():
    """Two AdamW steps per group written out in float64 from the groups' own values."""
    model = _model(2)
    start = [p.detach().double().clone() for p in model.parameters()]
    opt = ftopt.Optimizer(_groups(model), ftopt.adamw, lr=1e-2, backend="fused")
    grads = []
    for x, y in _batches(3, 2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads.append([p.grad.double().clone() for p in model.parameters()])
        opt.step()
    for k, (p, p0) in enumerate(zip(model.parameters(), start)):
        lr, b1, b2, wd = (1e-2, 0.9, 0.999, 0.1) if p.ndim > 1 else (3e-2, 0.8, 0.95, 0.0)
        mu = nu = torch.zeros_like(p0)
        want = p0
        for t, g in enumerate(grads, start=1):
            mu = b1 * mu + (1 - b1) * g[k]
            nu = b2 * nu + (1 - b2) * g[k] ** 2
            u = (mu / (1 - b1 ** t)) / ((nu / (1 - b2 ** t)).sqrt() + 1e-8)
            want = want - lr * (u + wd * want)
        torch.testing.assert_close(p.double(), want, rtol=1e-5, atol=1e-6)


def test_scheduler_lr_applies_without_recompiling(launches, monkeypatch):
    model = _model(4)
    opt = ftopt.Optimizer(_groups(model), ftopt.adamw, lr=1e-2, backend="fused")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0, lambda s: 0.5 ** s])
    batches = _batches(5, 4)
    _train(model, opt, batches[:1], sched)
    compiled = []
    real = codegen.compile_source
    monkeypatch.setattr(codegen, "compile_source",
                        lambda *a: (compiled.append(a[1]), real(*a))[1])
    joined = opt._joiner.joined
    twin = _model(4)
    twin_opt = ftopt.Optimizer(_groups(twin), ftopt.adamw, lr=1e-2, backend="eager")
    twin_sched = torch.optim.lr_scheduler.LambdaLR(twin_opt,
                                                   [lambda s: 1.0, lambda s: 0.5 ** s])
    _train(twin, twin_opt, batches[:1], twin_sched)
    _train(model, opt, batches[1:], sched)
    _train(twin, twin_opt, batches[1:], twin_sched)
    assert compiled == [] and opt._joiner.joined is joined  # no recompile, no rebuild
    assert len(launches) == len(batches)
    assert opt.param_groups[1]["lr"] == pytest.approx(3e-2 * 0.5 ** 4)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    # A group whose lr the scheduler set to 0 stands still from then on.
    frozen = [p.detach().clone() for p in opt.param_groups[1]["params"]]
    opt.param_groups[1]["lr"] = 0.0
    _train(model, opt, batches[:1])
    assert all(torch.equal(p, f) for p, f in zip(opt.param_groups[1]["params"], frozen))
    assert compiled == []


def test_checkpoint_round_trip_resumes_bit_exactly(launches):
    batches = _batches(6, 6)

    def fresh():
        model = _model(7)
        opt = ftopt.Optimizer(_groups(model), ftopt.adamw, lr=1e-2, backend="fused")
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)

    straight, opt, sched = fresh()
    _train(straight, opt, batches, sched)
    first, opt, sched = fresh()
    _train(first, opt, batches[:3], sched)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict(),
                "sched": sched.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert sorted(saved["opt"]["state"][0]) == ["mu", "nu", "step"]
    resumed, opt2, sched2 = fresh()
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    launches.clear()
    _train(resumed, opt2, batches[3:], sched2)
    assert len(launches) == 3
    for p, q in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(p, q)
    assert all(int(s["step"]) == 6 for s in opt2.state_dict()["state"].values())


def test_state_views_follow_the_joined_step():
    model = _model(8)
    opt = ftopt.Optimizer(_groups(model), ftopt.adamw, lr=1e-2, backend="fused")
    _train(model, opt, _batches(9, 1))
    views = {id(p): dict(opt.state[p]) for p in model.parameters()}
    _train(model, opt, _batches(10, 1))
    for p in model.parameters():
        assert all(opt.state[p][k] is t for k, t in views[id(p)].items())
        assert int(opt.state[p]["step"]) == 2


def test_joined_state_holds_the_groups_tensors():
    model = _model(20)
    opt = ftopt.Optimizer(_groups(model, named=False), ftopt.adamw, lr=1e-2,
                          backend="fused")
    _train(model, opt, _batches(21, 1))
    joined = opt._joiner.joined
    for run, group, own in zip(opt._runs, opt.param_groups,
                               param_groups.split_state(joined, joined.state)):
        mine = optree.tree_leaves(run.state, namespace="ftopt")
        theirs = optree.tree_leaves(own, namespace="ftopt")
        assert len(mine) == len(theirs) == 1 + 2 * len(group["params"])
        assert all(a is b for a, b in zip(mine, theirs))
        assert optree.tree_structure(run.state, namespace="ftopt") == \
            optree.tree_structure(own, namespace="ftopt")


def test_groups_that_differ_in_their_rules_still_step_as_one(launches):
    model, eager = _model(11), _model(11)
    groups = _groups(model)
    groups[1]["nesterov"] = True  # another rule body: its stages follow the first's
    opt = ftopt.Optimizer(groups, ftopt.adamw, lr=1e-2, backend="fused")
    _train(model, opt, _batches(12, 2))
    assert len(launches) == 2  # one per step
    assert opt._joiner.joined.reason is None
    eager_groups = _groups(eager)
    eager_groups[1]["nesterov"] = True
    _train(eager, ftopt.Optimizer(eager_groups, ftopt.adamw, lr=1e-2, backend="eager"),
           _batches(12, 2))
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_group_without_gradients_keeps_its_step_count(launches):
    model = _model(13)
    opt = ftopt.Optimizer(_groups(model), ftopt.adamw, lr=1e-2, backend="fused")
    _train(model, opt, _batches(14, 1))
    x, y = _batches(15, 1)[0]
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    for p in opt.param_groups[1]["params"]:
        p.grad = None
    opt.step()
    assert [int(opt.state[g["params"][0]]["step"]) for g in opt.param_groups] == [2, 1]
    _train(model, opt, _batches(16, 1))
    assert [int(opt.state[g["params"][0]]["step"]) for g in opt.param_groups] == [3, 2]
    assert len(launches) == 3  # joined, group 0 alone, joined


def test_a_bad_gradient_names_the_group_and_changes_nothing():
    model = _model(17)
    opt = ftopt.Optimizer(_groups(model), ftopt.adamw, lr=1e-2, backend="fused")
    _train(model, opt, _batches(18, 1))
    kept = [p.detach().clone() for p in model.parameters()]
    x, y = _batches(19, 1)[0]
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    bias = opt.param_groups[1]["params"][0]
    bias.grad = bias.grad.to_sparse()
    state = {k: v.clone() for k, v in opt.state[bias].items()}
    with pytest.raises(TypeError, match=r"param group 1: grad at \['0.bias'\]: a sparse"):
        opt.step()
    assert all(torch.equal(p, k) for p, k in zip(model.parameters(), kept))
    assert all(torch.equal(opt.state[bias][k], v) for k, v in state.items())


def test_live_values_reach_the_kernel_as_numbers_or_tensors(launches):
    """A group's numbers go to the kernel from their host mirror (no device work); a
    group value given as a tensor is copied into the live tensor, which forgets the
    mirror, and the step reads it on the device: both equal the eager optimizer."""
    model, eager = _model(21), _model(21)
    opt = ftopt.Optimizer(_groups(model), ftopt.adamw, lr=1e-2, backend="fused")
    ref = ftopt.Optimizer(_groups(eager), ftopt.adamw, lr=1e-2, backend="eager")
    batches = _batches(22, 3)
    for k, (x, y) in enumerate(batches):
        for o in (opt, ref):
            o.param_groups[0]["lr"] = (2e-2, torch.tensor(0.0, device=DEVICE), 5e-3)[k]
            o.param_groups[1]["lr"] = 1e-3 * (k + 1)
        _train(model, opt, [(x, y)])
        _train(eager, ref, [(x, y)])
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=f"step {k}")
    assert len(launches) == 3
    before = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    opt.param_groups[0]["lr"] = torch.tensor(0.0, device=DEVICE)
    _train(model, opt, batches[:1])
    assert all(torch.equal(p, b) for p, b in zip(opt.param_groups[0]["params"], before))


def test_joined_tree_getter_reads_leaves_as_optree():
    """The joined groups' getter (a list of dicts, another group's slots as ``None``
    holes) gives optree's leaves for every mix of tensors and holes, and ``None`` for a
    tree of other keys or containers (the caller then flattens)."""
    from ftopt.lowering.flat import dict_list_getter

    gen = torch.Generator().manual_seed(22)

    def t():
        return torch.randn(2, generator=gen)

    layouts = [[{"b": t(), "a": t()}, {"c": None, "d": None}],  # a group and holes
               [{"b": None, "a": None}, {"c": t(), "d": t()}],
               [{"b": t(), "a": None}, {"c": None, "d": t()}],  # mixed
               [{"z": t()}, {"y": None}],  # dicts of one key
               [{"b": t(), "a": t()}, {}]]
    for tree in layouts:
        get = dict_list_getter(tree)
        fresh = [{k: (None if v is None else t()) for k, v in d.items()} for d in tree]
        filled = [{k: t() for k in d} for d in tree]  # holes no more
        for other in (tree, fresh, filled):
            want = optree.tree_leaves(other, none_is_leaf=False, namespace="ftopt")
            got = get(other)
            assert len(got) == len(want) and all(a is b for a, b in zip(got, want))
            proven: set = set()  # one read of several trees: holes proven once
            for _ in range(2):
                got = get(other, True, proven)
                assert len(got) == len(want) and all(a is b for a, b in zip(got, want))
            full = optree.tree_leaves(other, none_is_leaf=True, namespace="ftopt")
            got = get(other, drop_none=False)
            assert len(got) == len(full) and all(a is b for a, b in zip(got, full))
        # A None put in a dict that held tensors is passed on, for the tensor check of
        # the cached step to refuse (the dict is not scanned on every step).
        emptied = [{k: None for k in d} if i == 0 else d for i, d in enumerate(fresh)]
        if all(v is not None for v in tree[0].values()):
            assert sum(x is None for x in get(emptied)) == len(tree[0])
        assert get([*tree[:-1], {**tree[-1], "extra": None}]) is None
        assert get(tuple(tree)) is None and get(tree[:1]) is None
    assert get([{"q": t(), "a": t()}, {}]) is None  # another key, same size


def test_a_state_leaf_set_to_none_after_cached_steps_is_refused_by_path():
    """The cached step over a list of dicts does not scan the dicts of tensors for
    ``None`` (see ``dict_list_getter``): its tensor check sends such a state to the full
    path, which names the leaf; the params are left as they were."""
    gen = torch.Generator().manual_seed(23)
    params = [{"w": torch.randn(4, 3, generator=gen), "v": torch.randn(3, generator=gen)},
              {"b": torch.randn(3, generator=gen)}]
    params = [{k: v.to(DEVICE) for k, v in d.items()} for d in params]
    tx = ftopt.partition({0: ftopt.adamw(1e-2, weight_decay=0.1), 1: ftopt.adamw(1e-2)},
                         [{"w": 0, "v": 0}, {"b": 1}])
    state = tx.init(params)
    grads = [{k: torch.randn_like(v) for k, v in d.items()} for d in params]
    for _ in range(2):
        _, state = ftopt.step(tx, params, grads, state, donate=True, backend="fused")
    state.inner_states[0].inner_state[0].mu[0]["w"] = None
    before = [{k: v.clone() for k, v in d.items()} for d in params]
    with pytest.raises(TypeError, match=r"state mu at \[0\]\['w'\]: expected a tensor"):
        ftopt.step(tx, params, grads, state, donate=True, backend="fused")
    assert all(torch.equal(d[k], b[k]) for d, b in zip(params, before) for k in d)
