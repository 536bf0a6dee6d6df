"""The keywords a transform's ``update`` needs (``ftopt.combine.update_keywords``: the
loss as ``value=``, a line search's ``grad=``/``value_fn=``, Sophia's ``obj_fn=``),
found through chains and wrappers; and :class:`ftopt.Optimizer` passing the closure's
loss as ``value=`` to the transforms that read it."""

from __future__ import annotations

import pytest
import torch
from registry import PARAMS_WRAPPERS, TRANSFORMS, names, standalone
from test_inject_stateful import HalveOnRise

import ftopt
from ftopt.combine import update_keywords

LOSS = {"value"}
LINE_SEARCH = {"value", "grad", "value_fn"}
KNOWN = {"polyak_sgd": LOSS, "scale_by_polyak": LOSS, "momo": LOSS, "momo_adam": LOSS,
         "reduce_on_plateau": LOSS, "scale_by_backtracking_linesearch": LINE_SEARCH,
         "scale_by_zoom_linesearch": LINE_SEARCH, "lbfgs": LINE_SEARCH,
         "sophia": {"obj_fn"}, "scale_by_sophia": {"obj_fn"},
         "hutchinson_estimator_diag_hessian": {"obj_fn"}}
# (the inject_ entries build adam whatever their inner: tested on their own below)
COMBINATORS = [e for e in TRANSFORMS if e.kind == "combinator"
               and not e.name.startswith("inject_")]
# Every transform the registry suites leave to their own files (PARAMS_WRAPPERS).
MAKERS = {
    "lookahead": lambda: ftopt.lookahead(ftopt.sgd(0.1), 2, 0.5),
    "reduce_on_plateau": lambda: ftopt.reduce_on_plateau(),
    "scale_by_polyak": lambda: ftopt.scale_by_polyak(),
    "polyak_sgd": lambda: ftopt.polyak_sgd(0.5),
    "momo": lambda: ftopt.momo(),
    "momo_adam": lambda: ftopt.momo_adam(),
    "differentially_private_aggregate":
        lambda: ftopt.differentially_private_aggregate(1.0, 0.1, 0),
    "dpsgd": lambda: ftopt.dpsgd(0.1, 1.0, 0.1, 0),
    "split_real_and_imaginary": lambda: ftopt.split_real_and_imaginary(ftopt.adam(1e-2)),
    "scale_by_lbfgs": lambda: ftopt.scale_by_lbfgs(),
    "lbfgs": lambda: ftopt.lbfgs(),
    "scale_by_backtracking_linesearch": lambda: ftopt.scale_by_backtracking_linesearch(3),
    "scale_by_zoom_linesearch": lambda: ftopt.scale_by_zoom_linesearch(3),
    "sam": lambda: ftopt.sam(ftopt.sgd(0.1), ftopt.sgd(0.05)),
    "mechanize": lambda: ftopt.mechanize(ftopt.sgd(0.1)),
    "sophia": lambda: ftopt.sophia(1e-3),
    "scale_by_sophia": lambda: ftopt.scale_by_sophia(),
    "hutchinson_estimator_diag_hessian": lambda: ftopt.hutchinson_estimator_diag_hessian(),
    "measure_with_ema": lambda: ftopt.measure_with_ema(ftopt.tree.norm, 0.9),
    "flatten": lambda: ftopt.flatten(ftopt.adam(1e-2)),
}


def _tree(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)}


@pytest.mark.parametrize("entry", TRANSFORMS, ids=names(TRANSFORMS))
def test_every_transform_names_the_keywords_its_update_needs(entry):
    assert update_keywords(standalone(entry)) == KNOWN.get(entry.name, set())


def test_every_params_wrapper_has_a_maker_here():
    assert set(MAKERS) == set(PARAMS_WRAPPERS)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_the_wrappers_name_the_keywords_their_update_needs(name):
    assert update_keywords(MAKERS[name]()) == KNOWN.get(name, set())
    if name == "sam":
        opaque = ftopt.sam(ftopt.sgd(0.1), ftopt.sgd(0.05), opaque_mode=True)
        assert update_keywords(opaque) == {"grad_fn"}


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_the_named_keywords_are_needed(name):
    """Without them, the update refuses, naming one of them."""
    tx = MAKERS[name]()
    params = _tree(0)
    with pytest.raises((TypeError, ValueError)) as err:
        tx.update(_tree(1), tx.init(params), params)
    assert any(f"{k}=" in str(err.value) for k in KNOWN[name]), str(err.value)


@pytest.mark.parametrize("entry", COMBINATORS, ids=names(COMBINATORS))
def test_a_wrapped_transform_s_keywords_are_found(entry):
    """Every combinator of the registry, holding polyak_sgd where its inner transforms go,
    needs the loss."""
    inner = [ftopt.polyak_sgd(0.5) for _ in entry.inner] or [ftopt.polyak_sgd(0.5)]
    tx = standalone(entry, inner=inner)
    assert update_keywords(tx) == LOSS


def test_inject_hyperparams_finds_them_before_and_after_init():
    tx = ftopt.inject_hyperparams(ftopt.polyak_sgd)(max_learning_rate=0.5)
    assert update_keywords(tx) == LOSS
    tx.init(_tree(0))
    assert update_keywords(tx) == LOSS
    assert update_keywords(ftopt.inject_hyperparams(ftopt.adam)(learning_rate=1e-3)) == set()


def _model_and_data(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randn(16, 5, generator=gen), torch.randn(16, 1, generator=gen))
               for _ in range(4)]
    return model, batches


@pytest.mark.parametrize("make", [
    lambda: ftopt.polyak_sgd(0.5, f_min=0.01),
    lambda: ftopt.momo(0.5),
    lambda: ftopt.momo_adam(0.05),
    lambda: ftopt.chain(ftopt.adamw(0.05), ftopt.reduce_on_plateau(patience=1, factor=0.5)),
    lambda: ftopt.inject_hyperparams(ftopt.adamw)(learning_rate=HalveOnRise(0.05)),
], ids=["polyak_sgd", "momo", "momo_adam", "adamw+reduce_on_plateau",
        "adamw+stateful_schedule"])
def test_optimizer_passes_the_closure_s_loss_as_value(make):
    """``ftopt.Optimizer(...).step(closure)`` is, bit for bit, the functional loop that
    passes each step's loss to ``update`` as ``value=``."""
    model, batches = _model_and_data(3)
    names_ = [n for n, _ in model.named_parameters()]
    tx = make()
    # (a list in the module's order, the tree ftopt.Optimizer steps: sums over the
    # leaves, as momo's, then add in the same order)
    params = [p.detach().clone() for p in model.parameters()]
    state = tx.init(params)
    for x, y in batches:
        def loss_of(p, x=x, y=y):
            out = torch.func.functional_call(model, dict(zip(names_, p)), (x,))
            return torch.nn.functional.mse_loss(out, y)
        grads, loss = torch.func.grad_and_value(loss_of)(params)
        updates, state = tx.update(grads, state, params, value=loss)
        params = ftopt.apply_updates(params, updates)

    opt = ftopt.Optimizer(model.parameters(), make())
    for x, y in batches:
        def closure(x=x, y=y):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss
        out = opt.step(closure)
        assert isinstance(out, torch.Tensor) and out.requires_grad  # (the closure's own)
    for n, p, q in zip(names_, model.parameters(), params):
        assert torch.equal(p.detach(), q), n
    moved = _model_and_data(3)[0]
    assert any(not torch.equal(a, b) for a, b in zip(moved.parameters(), model.parameters()))


def test_optimizer_needs_a_closure_for_a_transform_that_reads_the_loss():
    model, batches = _model_and_data(4)
    opt = ftopt.Optimizer(model.parameters(), ftopt.polyak_sgd(0.5))
    x, y = batches[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=r"param group 0: .*reads the loss.*closure"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert not opt.state  # no state was made


@pytest.mark.parametrize("make,needs", [
    (lambda: ftopt.lbfgs(), "grad=, value_fn="),
    (lambda: ftopt.sophia(1e-3), "obj_fn="),
    (lambda: ftopt.chain(ftopt.scale_by_zoom_linesearch(3), ftopt.scale(-1.0)),
     "grad=, value_fn="),
])
def test_optimizer_refuses_a_transform_needing_a_function_of_the_params(make, needs):
    model, _ = _model_and_data(5)
    with pytest.raises(TypeError, match=f"param group 0: the transform's update needs {needs}"):
        ftopt.Optimizer(model.parameters(), make())
