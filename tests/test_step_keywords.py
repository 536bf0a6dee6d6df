"""``ftopt.step(tx, params, grads, state, **extra)``: keywords of ``update`` (the loss as
``value=``, a line search's ``grad=``/``value_fn=``, Sophia's ``obj_fn=``, SAM's
``grad_fn=``) pass through; the step is then ``tx.update(..., **extra)`` and
``apply_updates``, bit for bit, donated or not, and a fused step is refused clearly."""

from __future__ import annotations

import pytest
import torch

import ftopt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tree(gen) -> dict:
    return {"w": torch.randn(4, 3, generator=gen).to(DEVICE),
            "b": torch.randn(3, generator=gen).to(DEVICE)}


def _loss(p):
    return (p["w"] ** 2).sum() + ((p["b"] - 1.0) ** 4).sum()


def _grads(p):
    return torch.func.grad(_loss)(p)


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


CASES = {
    "polyak_sgd": (lambda: ftopt.polyak_sgd(1.0),
                   lambda p: {"value": _loss(p)}),
    "momo_adam": (lambda: ftopt.momo_adam(0.05),
                  lambda p: {"value": _loss(p)}),
    "lbfgs": (lambda: ftopt.lbfgs(),
              lambda p: {"value": _loss(p), "grad": _grads(p), "value_fn": _loss}),
    "backtracking": (lambda: ftopt.chain(ftopt.sgd(0.5),
                                         ftopt.scale_by_backtracking_linesearch(15)),
                     lambda p: {"value": _loss(p), "grad": _grads(p), "value_fn": _loss}),
    "sophia": (lambda: ftopt.sophia(0.05, update_interval=1),
               lambda p: {"obj_fn": _loss}),
    "sam_opaque": (lambda: ftopt.sam(ftopt.sgd(0.05), ftopt.sgd(0.01), sync_period=2,
                                     opaque_mode=True),
                   lambda p: {"grad_fn": lambda q, i: _grads(q)}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_step_passes_the_keywords_to_update(name):
    make, keywords = CASES[name]
    tx = make()
    gen = torch.Generator().manual_seed(len(name))
    params = _tree(gen)
    p, s = params, tx.init(params)
    q, t = params, tx.init(params)
    d = {k: v.clone() for k, v in params.items()}
    ds = tx.init(d)
    for _ in range(3):
        g = _grads(p)
        kw = keywords(p)
        u, s_next = tx.update(g, s, p, backend="eager", **kw)
        want = ftopt.apply_updates(p, u)
        q, t = ftopt.step(tx, q, _grads(q), t, **keywords(q))
        assert _same(q, want), name
        held = {k: id(v) for k, v in d.items()}
        d, ds = ftopt.step(tx, d, _grads(d), ds, donate=True, **keywords(d))
        assert {k: id(v) for k, v in d.items()} == held  # (in place)
        assert _same(d, want), name
        p, s = want, s_next
    assert not _same(p, params)  # (the control: the params moved)
    assert float(_loss(p)) < float(_loss(params))


def test_fused_is_refused_and_other_transforms_ignore_the_keywords():
    gen = torch.Generator().manual_seed(1)
    params = _tree(gen)
    tx = ftopt.polyak_sgd(1.0)
    with pytest.raises(RuntimeError, match=r"cannot fuse: the keywords \['value'\]"):
        ftopt.step(tx, params, _grads(params), tx.init(params), backend="fused",
                   value=_loss(params))
    with pytest.raises(TypeError, match="update needs the loss as value="):
        ftopt.step(tx, params, _grads(params), tx.init(params))
    adam = ftopt.adam(1e-2)  # (accepts and ignores them, as optax's ExtraArgs)
    a, _ = ftopt.step(adam, params, _grads(params), adam.init(params), value=1.0)
    b, _ = ftopt.step(adam, params, _grads(params), adam.init(params), backend="eager")
    assert _same(a, b)
