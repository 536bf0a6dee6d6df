"""Every registry entry (``tests/registry.py``, as a standalone optimizer) under
``torch.func``: an ensemble of three models stepped in one vmapped call equals a loop
over the members, params and state, within fp32 rounding; and the gradient of a loss
after two steps with respect to the initial params (differentiating through the
updates, float64) is finite and the same through ``torch.func.grad`` and plain autograd.
The entries that cannot run under vmap are listed in the registry (``NOT_UNDER_VMAP``,
with the reason), and each of them is checked to fail still, so that the list stays
true; those not differentiated through are in ``NOT_DIFFERENTIATED``."""

from __future__ import annotations

import pytest
import torch
from registry import NOT_DIFFERENTIATED, NOT_UNDER_VMAP, TRANSFORMS, names, standalone
from step_checks import assert_vmap_matches_loop, vmapped_steps

import ftopt
from ftopt.combine import update_keywords

pytestmark = pytest.mark.usefixtures("one_thread")

M = 3  # members of the ensemble
ENTRIES = [e for e in TRANSFORMS if not update_keywords(standalone(e))]


def _data():
    gen = torch.Generator().manual_seed(5)
    params = {"w": torch.randn(M, 4, 5, generator=gen), "b": torch.randn(M, 5, generator=gen)}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
             for _ in range(3)]
    return params, grads


@pytest.mark.parametrize("name", names(e for e in ENTRIES if e.name not in NOT_UNDER_VMAP))
def test_vmapped_ensemble_equals_a_loop(name):
    params, grads_seq = _data()
    p = assert_vmap_matches_loop(standalone(name), params, grads_seq, 1e-5, 1e-6)
    if next(e for e in ENTRIES if e.name == name).moves:
        assert not torch.equal(p["b"], params["b"])


@pytest.mark.parametrize("name", sorted(NOT_UNDER_VMAP))
def test_the_listed_entries_still_fail_under_vmap(name):
    """A fix that makes one of them run should take it off the registry's list."""
    params, grads_seq = _data()
    with pytest.raises((RuntimeError, ValueError), match="vmap"):
        vmapped_steps(standalone(name), params, grads_seq)


@pytest.mark.parametrize("name", names(e for e in ENTRIES
                                       if e.name not in NOT_DIFFERENTIATED))
def test_gradient_through_two_updates(name):
    tx = standalone(name)
    gen = torch.Generator().manual_seed(6)
    params = {"w": torch.randn(4, 5, generator=gen, dtype=torch.float64),
              "b": torch.randn(5, generator=gen, dtype=torch.float64)}
    x = torch.randn(8, 4, generator=gen, dtype=torch.float64)

    def loss(p):
        return (torch.tanh(x @ p["w"] + p["b"]) ** 2).sum()

    def after(p, inner_grad):
        s = tx.init(p)
        for _ in range(2):
            u, s = tx.update(inner_grad(p), s, p)
            p = ftopt.apply_updates(p, u)
        return loss(p)

    by_func = torch.func.grad(lambda p: after(p, torch.func.grad(loss)))(params)
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}

    def autograd_grad(p):
        return dict(zip(p, torch.autograd.grad(loss(p), list(p.values()),
                                               create_graph=True)))

    by_autograd = dict(zip(leaves, torch.autograd.grad(after(leaves, autograd_grad),
                                                       list(leaves.values()))))
    for k in params:
        assert bool(torch.isfinite(by_func[k]).all()), k
        torch.testing.assert_close(by_func[k], by_autograd[k], rtol=1e-9, atol=1e-12)
