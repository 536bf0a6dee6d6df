"""Checks that several suites share: trees equal within a tolerance, bit patterns, and the
skip_zeros step (a warm-up, then a step whose gradient has zeros) on any transform."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterable
from typing import Any

import optree
import torch

import ftopt

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# The seeds fresh_generator drew in the running test, which a failing test's report names
# (conftest.pytest_runtest_makereport); FTOPT_TEST_SEEDS=a,b,... draws them again.
SEEDS: list[int] = []


def fresh_generator() -> torch.Generator:
    """A generator seeded afresh on every run, and torch's default generator seeded the
    same: new data each run, and a failure's data drawn again from the seeds its report
    names (``FTOPT_TEST_SEEDS``, in the order the test drew them)."""
    given = os.environ.get("FTOPT_TEST_SEEDS", "")
    if given:
        seed = int(given.split(",")[len(SEEDS) % len(given.split(","))])
    else:
        seed = random.SystemRandom().randrange(2**31)
    SEEDS.append(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def bits(x: torch.Tensor) -> torch.Tensor:
    """The bit pattern of ``x`` as integers of its element size, same shape (so a mask
    selects elements): equal bits, not equal values (``-0.0 != 0.0``, NaN == NaN)."""
    return x.detach().view(_INT_OF_SIZE[x.element_size()])


def same_bits(a: Any, b: Any) -> bool:
    """Whether two trees have the same leaves, bit for bit."""
    la, lb = ftopt.tree.leaves(a), ftopt.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y))
        for x, y in zip(la, lb))


def dense_randn(*shape: int, generator: torch.Generator | None = None,
                dtype: torch.dtype = torch.float32, like: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Normal draws with no exact zero, in ``dtype`` (or ``like``'s shape, dtype and
    device): ``torch.randn`` gives an exact 0.0 about once in 12 million elements
    (a uniform draw of 0 in its Box-Muller pairs; fp16 also rounds |x| < 3e-8 to 0),
    which a test counting the blocks with zero gradients would take for one it placed."""
    if like is not None:
        shape, dtype = tuple(like.shape), like.dtype
    x = torch.randn(*shape, generator=generator).to(dtype)
    x[x == 0] = 1.0
    return x if like is None else x.to(like.device)


def cloned(tree: Any) -> Any:
    """A copy of every tensor of ``tree``."""
    return ftopt.tree.map(lambda t: t.clone(), tree)


def with_zero_rows_and_columns(grads: list[dict], key: str = "w") -> torch.Tensor:
    """Zeros leaf ``key`` of every gradient after the first (a warm-up) in rows 2-4 and
    every 7th column, in place; returns that mask (a 2-D leaf's skip_zeros pattern)."""
    leaf = grads[0][key]
    zero = torch.zeros(leaf.shape, dtype=torch.bool, device=leaf.device)
    zero[2:5] = True
    zero[:, ::7] = True
    for g in grads[1:]:
        g[key][zero] = 0.0
    return zero


def assert_trees_close(a: Any, b: Any, rtol: float = 1e-6, atol: float = 1e-7) -> None:
    """The same tree structure (``None`` holes included), and every leaf of the same dtype
    and shape and equal within ``rtol``/``atol``."""
    la, sa = optree.tree_flatten(a, namespace="ftopt")
    lb, sb = optree.tree_flatten(b, namespace="ftopt")
    assert sa == sb
    for x, y in zip(la, lb):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


def run_steps(tx: Any, params: dict, grads_at: Callable[[dict, int], dict], backend: str,
              steps: int = 3, donate: bool = False, state: Any = None,
              start: int = 0) -> tuple[dict, Any]:
    """``steps`` steps of ``tx`` from copies of ``params`` (and of ``state``; ``None``:
    ``tx.init``), step ``t`` (from ``start``) on ``grads_at(params, t)``."""
    params = {k: v.clone() for k, v in params.items()}
    state = tx.init(params) if state is None else optree.tree_map(
        torch.clone, state, namespace="ftopt")
    for t in range(start, start + steps):
        params, state = ftopt.step(tx, params, grads_at(params, t), state, donate=donate,
                                   backend=backend)
    return params, state


def zero_step(tx: Any, params: dict, warmup: Iterable[dict], grads: dict,
              per_element: Callable[[Any], dict], backend: str) -> tuple:
    """Steps on each gradient of ``warmup``, then one on ``grads``: the params and the
    per-element states (``per_element(state)``: ``{slot: {leaf: tensor or None}}``) before
    and after that last step, as ``(before_p, before_s, new_p, new_s)``."""
    state = tx.init(params)
    for g in warmup:
        params, state = ftopt.step(tx, params, g, state, backend=backend)
    before_p = {k: v.clone() for k, v in params.items()}
    before_s = {n: {k: None if v is None else v.clone() for k, v in slot.items()}
                for n, slot in per_element(state).items()}
    new_p, new_state = ftopt.step(tx, params, grads, state, backend=backend)
    return before_p, before_s, new_p, per_element(new_state)


def assert_kept_where_zero(grads: dict, before_p: dict, before_s: dict, new_p: dict,
                           new_s: dict) -> None:
    """Where a gradient is zero, each param and each per-element state shaped like it kept
    its bits (SPEC §3)."""
    for k, g in grads.items():
        zero = g == 0
        assert torch.equal(bits(new_p[k])[zero], bits(before_p[k])[zero]), k
        for n, slot in new_s.items():
            if slot[k] is not None and slot[k].shape == g.shape:
                assert torch.equal(bits(slot[k])[zero], bits(before_s[n][k])[zero]), (n, k)


def torch_optimizer_steps(opt: Any, tensors: list, names: list, grads: Iterable[dict]) -> None:
    """Steps a torch-style optimizer over ``tensors`` (named ``names``), one step per dict
    of gradients."""
    for g in grads:
        for t, n in zip(tensors, names):
            t.grad = g[n].clone()
        opt.step()


def ftopt_steps(tx: Any, params: dict, state: Any, grads: Iterable[dict]) -> tuple:
    """``ftopt.step`` once per dict of gradients: the final (params, state)."""
    for g in grads:
        params, state = ftopt.step(tx, params, g, state)
    return params, state



def _named(node: Any, field: str, names: frozenset) -> bool:
    return field in names or (type(node).__name__, field) in names


def without_fields(state: Any, names: frozenset) -> Any:
    """``state`` with the fields named in ``names`` (field names, or (state class, field)
    pairs, of any NamedTuple state inside it) left out; each NamedTuple becomes a plain
    tuple of its other fields."""
    if hasattr(state, "_fields"):
        return tuple(without_fields(getattr(state, f), names) for f in state._fields
                     if not _named(state, f, names))
    if isinstance(state, (tuple, list)):
        return tuple(without_fields(x, names) for x in state)
    if isinstance(state, dict):
        return {k: without_fields(v, names) for k, v in state.items()}
    return state


def field_leaves(state: Any, names: frozenset) -> list:
    """The tensor leaves of the fields named in ``names`` (as :func:`without_fields`),
    in order."""
    if hasattr(state, "_fields"):
        return [x for f in state._fields for x in (
            ftopt.tree.leaves(getattr(state, f)) if _named(state, f, names)
            else field_leaves(getattr(state, f), names))]
    if isinstance(state, (tuple, list, dict)):
        values = state.values() if isinstance(state, dict) else state
        return [x for v in values for x in field_leaves(v, names)]
    return []


def vmapped_steps(tx: Any, params: dict, grads_seq: list) -> tuple:
    """``tx`` over an ensemble (each leaf's axis 0 a member) under ``torch.func.vmap``:
    ``init``, then one vmapped ``update`` + ``apply_updates`` per grads of ``grads_seq``."""
    def one(p, g, s):
        u, s = tx.update(g, s, p)
        return ftopt.apply_updates(p, u), s

    state = torch.func.vmap(tx.init)(params)
    p = params
    for g in grads_seq:
        p, state = torch.func.vmap(one)(p, g, state)
    return p, state


def assert_vmap_matches_loop(tx: Any, params: dict, grads_seq: list, rtol: float,
                             atol: float) -> dict:
    """:func:`vmapped_steps` equal to a loop over the members, params and every state
    leaf (floats within ``rtol`` and ``atol`` times the member's largest magnitude, at
    least 1; others exactly); returns the vmapped params."""
    p, state = vmapped_steps(tx, params, grads_seq)
    members = next(iter(params.values())).shape[0]
    for m in range(members):
        pm = {k: v[m] for k, v in params.items()}
        sm = tx.init(pm)
        for g in grads_seq:
            u, sm = tx.update({k: v[m] for k, v in g.items()}, sm, pm)
            pm = ftopt.apply_updates(pm, u)
        for k in pm:
            torch.testing.assert_close(p[k][m], pm[k], rtol=rtol, atol=atol * float(
                pm[k].abs().max().clamp_min(1.0)), msg=f"member {m} leaf {k}")
        for a, b in zip(ftopt.tree.leaves(state), ftopt.tree.leaves(sm), strict=True):
            assert a.shape[0] == members and a[m].shape == b.shape
            if a.is_floating_point():
                torch.testing.assert_close(a[m], b, rtol=rtol, atol=atol * float(
                    b.abs().max().clamp_min(1.0)) if b.numel() else 0.0)
            else:
                assert torch.equal(a[m], b)
    return p


def assert_state_dict_resumes(tx: Any, params: dict, grads: list, split: int,
                              backend: str) -> None:
    """``split`` steps, ``ftopt.state_dict`` (copied), the remaining steps; then the same
    remaining steps from a fresh ``init`` loaded with the copy: the same params, bit for
    bit."""
    state = tx.init(params)
    for g in grads[:split]:
        params, state = ftopt.step(tx, params, g, state, backend=backend)
    saved = ftopt.tree.map(torch.clone, ftopt.state_dict(state, tx, params))
    resumed = ftopt.tree.map(torch.clone, params)
    for g in grads[split:]:
        params, state = ftopt.step(tx, params, g, state, backend=backend)
    loaded = ftopt.load_state_dict(tx.init(resumed), tx, resumed, saved)
    for g in grads[split:]:
        resumed, loaded = ftopt.step(tx, resumed, g, loaded, backend=backend)
    assert all(torch.equal(resumed[k], params[k]) for k in params)
