"""``masked`` of stateful transforms and ``partition`` branches that differ in their rules,
in the fused kernel, against the eager path.

A leaf a mask (or another branch's label) leaves out passes the position through and
has no state there (``None``, as the eager path keeps it): its flag turns the slot loads
and stores off. Small sizes: the kernels run in the Triton interpreter on the CPU.
"""

from __future__ import annotations

import io

import optree
import pytest
import torch

import ftopt
from tests.step_checks import assert_trees_close, run_steps

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPES = {"w": (24, 40), "b": (40,), "ln": (33,), "v": (3, 5)}
LABELS = {"w": "a", "b": "b", "ln": "a", "v": "b"}


def _matrices(tree):
    return {k: v.ndim > 1 for k, v in tree.items()}


def _params(shapes=SHAPES):
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g).to(DEVICE) for k, s in shapes.items()}


def _grads(params, step: int, zero_rows: bool = False):
    g = torch.Generator().manual_seed(100 + step)
    out = {k: torch.randn(p.shape, generator=g).to(DEVICE) for k, p in params.items()}
    if zero_rows:
        out["w"][::3] = 0.0
        out["b"][:7] = -0.0
        out["v"][1] = 0.0
    return out


CASES = {
    "masked_adam": lambda skip=False: ftopt.masked(ftopt.adam(1e-2, skip_zeros=skip),
                                                   _matrices),
    "masked_trace": lambda skip=False: ftopt.masked(
        ftopt.chain(ftopt.trace(0.9), ftopt.skip_zeros() if skip else ftopt.identity()),
        _matrices),
    "masked_decay_then_adam": lambda skip=False: ftopt.chain(
        ftopt.masked(ftopt.add_decayed_weights(0.1), _matrices), ftopt.adam(1e-2),
        ftopt.skip_zeros() if skip else ftopt.identity()),
    "outer_skip_masked_adam": lambda skip=False: ftopt.chain(
        ftopt.masked(ftopt.adam(1e-2), _matrices), ftopt.scale(0.5),
        ftopt.skip_zeros() if skip else ftopt.identity()),
    "partition_adamw_lion": lambda skip=False: ftopt.partition(
        {"a": ftopt.adamw(1e-2, weight_decay=0.1, skip_zeros=skip),
         "b": ftopt.lion(1e-3, skip_zeros=skip)}, LABELS),
    "partition_three_branches": lambda skip=False: ftopt.partition(
        {"a": ftopt.adamw(1e-2, skip_zeros=skip),
         "b": ftopt.sgd(1e-2, momentum=0.9, skip_zeros=skip),
         "c": ftopt.adamw(3e-2, b1=0.5, skip_zeros=skip)},
        {"w": "a", "b": "b", "ln": "c", "v": "b"}),
}


def _run(tx, backend: str, steps: int = 3, donate: bool = False, zero_rows: bool = False,
         state=None, params=None, start: int = 0):
    return run_steps(tx, params or _params(), lambda p, t: _grads(p, t, zero_rows), backend,
                     steps, donate, state, start)


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_one_launch_and_equal_to_eager(name, donate, kernel_launches):
    tx = CASES[name]()
    text = ftopt.explain(tx, _params(), backend="fused", file=None)
    assert text.count("path: fused") == 1 and "kernel launches per step: 1 " in text
    eager = _run(tx, "eager")
    kernel_launches.clear()
    fused = _run(tx, "fused", donate=donate)
    assert len(kernel_launches) == 3  # one kernel per step for every branch and mask
    assert_trees_close(fused, eager)  # params and every state, the same tree structure (None holes)


@pytest.mark.parametrize("name", list(CASES))
def test_skip_zeros_against_the_control(name):
    """At the second step, where the raw gradient is zero, the skipping chain keeps the
    params and states of the leaves its rules run on bit for bit; the same chain without
    skip_zeros (the control) moves them; elsewhere both agree bit for bit, and the eager
    path agrees with the fused one."""
    first = _run(CASES[name](skip=True), "fused", steps=1)
    skipping = _run(CASES[name](skip=True), "fused", steps=1, zero_rows=True, donate=True,
                    params=first[0], state=first[1], start=1)
    plain = CASES[name](skip=False)
    control = _run(plain, "fused", steps=1, zero_rows=True, params=first[0],
                   state=_restate(plain, first[0], first[1]), start=1)
    eager = _run(CASES[name](skip=True), "eager", steps=1, zero_rows=True,
                 params=first[0], state=first[1], start=1)
    assert_trees_close(skipping, eager)
    zeros = {k: g == 0 for k, g in _grads(first[0], 1, True).items()}
    before = dict(_slots(first[1]))
    moved_by_control = False
    for (key, old), (_, new), (_, ctrl) in zip(
            [*first[0].items(), *before.items()], [*skipping[0].items(), *_slots(skipping[1])],
            [*control[0].items(), *_slots(control[1])]):
        leaf = key.split("/")[-1]
        zero = zeros[leaf]
        if _runs_skip(name, leaf):
            assert torch.equal(new[zero], old[zero]), key
            moved_by_control |= not torch.equal(ctrl[zero], old[zero])
        assert torch.equal(new[~zero], ctrl[~zero]), key
    assert moved_by_control  # the test can fail: without skip_zeros the zeros move


def _restate(tx, params, state):
    """``state``'s tensors in ``tx``'s state structure (a chain without the skip_zeros
    marker has one state fewer; the marker's holds no tensors)."""
    leaves = optree.tree_leaves(state, namespace="ftopt")
    spec = optree.tree_structure(tx.init(params), namespace="ftopt")
    return optree.tree_unflatten(spec, leaves)


def _slots(state) -> list:
    """(path ending in the leaf's name, tensor) of every per-element state."""
    paths, leaves, _ = optree.tree_flatten_with_path(state, namespace="ftopt")
    return [("/".join(map(str, p)), x) for p, x in zip(paths, leaves) if x.ndim > 0]


def _runs_skip(name: str, leaf: str) -> bool:
    """Whether the leaf's update comes from a skip-aware stage (a masked-out leaf of a
    mask inside the skip_zeros chain passes its raw gradient through)."""
    inner_only = name in ("masked_adam", "masked_trace")
    return not inner_only or len(SHAPES[leaf]) > 1


@pytest.mark.parametrize("name", ["masked_adam", "partition_adamw_lion"])
def test_checkpoint_round_trip(name):
    """The fused state has the eager layout (``None`` where a leaf has no state), saves
    and loads with ``weights_only=True``, and the loaded state continues the run."""
    tx = CASES[name]()
    params, state = _run(tx, "fused", steps=2)
    layout = optree.tree_structure(tx.init(_params()), namespace="ftopt")
    assert optree.tree_structure(state, namespace="ftopt") == layout
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    resumed = _run(tx, "fused", steps=2, state=loaded, params=params, start=2, donate=True)
    straight = _run(tx, "eager", steps=4)
    assert_trees_close(resumed, straight, rtol=1e-5, atol=1e-6)


def test_8bit_branches_and_mask_match_eager():
    """8-bit states of a masked transform and of differing branches: leaves outside the
    mask have no codes (4 code tensors: trace and adam's mu, nu of "big", lion's mu of
    "odd"); the fused step equals the eager one (to a code at a boundary)."""
    shapes = {"big": (12, 130), "odd": (517,), "small": (3, 5)}
    tx = ftopt.chain(
        ftopt.masked(ftopt.quantize_states(ftopt.trace(0.9), min_size=256),
                     lambda p: {k: k != "odd" for k in p}),
        ftopt.partition({"a": ftopt.quantize_states(ftopt.adam(1e-2), min_size=256),
                         "b": ftopt.quantize_states(ftopt.lion(1e-3), min_size=256)},
                        {"big": "a", "odd": "b", "small": "b"}))
    eager = _run(tx, "eager", steps=2, params=_params(shapes))
    fused = _run(tx, "fused", steps=2, params=_params(shapes))
    for k in shapes:
        torch.testing.assert_close(fused[0][k], eager[0][k], rtol=2e-4, atol=2e-5)
    codes = [(a, b) for a, b in zip(optree.tree_leaves(eager[1], namespace="ftopt"),
                                    optree.tree_leaves(fused[1], namespace="ftopt"))
             if a.dtype == torch.uint8]
    assert len(codes) == 4 and all((a != b).float().mean() < 1e-2 for a, b in codes)


def test_matrix_stage_in_a_branch_runs_in_segments():
    """(The fused segments of branches with matrix stages: tests/test_muon_fused.py.)"""
    params = {"w": torch.randn(8, 6, device=DEVICE), "b": torch.randn(6, device=DEVICE)}
    tx = ftopt.muon(1e-2)
    text = ftopt.explain(tx, params, backend="fused", file=None)
    assert "newton_schulz (matrix stage on 'muon' leaves" in text
    assert "path: fused" in text and "eager" not in text


@pytest.mark.parametrize("backend", ["fused", "eager"])
def test_callable_rule_mask_in_a_branch_sees_the_other_branch_leaves_as_none(backend):
    """A branch's update sees the params with ``None`` where another branch owns a leaf;
    a rule's callable mask over that tree has entries for those ``None``s too. The fused
    update lines the mask up with the branch's own leaves (as the eager one does): the
    decay lands on every matrix, not on the leaf after each ``None``."""
    params = _params({"b": (40,), "w": (24, 40), "ln": (33,), "v": (3, 5)})
    grads = _grads(params, 0)
    seen = []

    def matrices(tree):
        seen.append(sorted(k for k, v in tree.items() if v is None))
        return {k: v is not None and v.ndim > 1 for k, v in tree.items()}

    decay = ftopt.chain(ftopt.add_decayed_weights(0.5, matrices), ftopt.sgd(0.1))
    tx = ftopt.partition({"m": decay, "o": ftopt.sgd(0.1)},
                         lambda t: {k: "m" if v.ndim > 1 else "o" for k, v in t.items()})
    state = tx.init(params)
    updates, _ = tx.update(grads, state, params, backend=backend)
    assert ["b", "ln"] in seen  # the branch's params: None at the other branch's leaves
    for k, p in params.items():
        want = -0.1 * (grads[k] + 0.5 * p) if p.ndim > 1 else -0.1 * grads[k]
        torch.testing.assert_close(updates[k], want, rtol=1e-6, atol=1e-6)


def _ndim_mask(tree):
    return ftopt.tree.map(lambda p: isinstance(p, torch.Tensor) and p.ndim >= 2, tree)


@pytest.mark.parametrize("name", ["decay_then_sgd", "lars", "muon"])
def test_callable_rule_mask_with_none_leaves_in_the_params(name):
    """A params tree with ``None`` leaves (frozen params) before a matrix: a rule's
    callable mask sees them, and the fused step lines its entries up with the tensors
    as the eager one does (the matrix decays; the mask of the ``None`` is not its)."""
    made = {
        "decay_then_sgd": lambda: ftopt.chain(ftopt.add_decayed_weights(0.5, _ndim_mask),
                                              ftopt.sgd(0.1)),
        "lars": lambda: ftopt.lars(0.1, weight_decay=0.5, weight_decay_mask=_ndim_mask,
                                   trust_ratio_mask=_ndim_mask),
        "muon": lambda: ftopt.muon(1e-2, weight_decay=0.5, weight_decay_mask=_ndim_mask,
                                   ns_dtype=torch.float32),
    }
    gen = torch.Generator().manual_seed(3)
    params = {"a": torch.randn(7, generator=gen), "frozen": None,
              "m": torch.randn(16, 17, generator=gen), "b": torch.randn(5, generator=gen)}
    params = {k: None if v is None else v.to(DEVICE) for k, v in params.items()}
    grads = {k: None if v is None else torch.randn(v.shape, generator=gen).to(DEVICE)
             for k, v in params.items()}
    tx = made[name]()
    state = tx.init(params)
    for api in ("update", "step"):
        out = {}
        for backend in ("eager", "fused"):
            if api == "update":
                out[backend] = tx.update(grads, state, params, backend=backend)
            else:
                out[backend] = ftopt.step(tx, params, grads, state, backend=backend)
        assert out["fused"][0]["frozen"] is None
        assert_trees_close(out["fused"], out["eager"])
