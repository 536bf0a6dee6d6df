"""``ftopt.step`` as a ``torch.library`` custom op, for ``torch.compile``.

Under ``torch.compile`` the step is one opaque op over the flattened params, grads and
states: Dynamo traces the flattening and the op call, not ftopt's planner, so a training
step that calls ``ftopt.step`` compiles with ``fullgraph=True``. At run time the op
rebuilds the trees and runs the usual step (fused where it can be).
"""

from __future__ import annotations

import sys
from typing import Any

import optree
import torch

from ftopt.base import GradientTransformation, owner_by_key
from ftopt.lowering.plan import SEPARATE_OUTPUTS
from ftopt.update import step

_REGISTRY: dict[int, tuple] = {}


def _spec(shape_tree: Any) -> optree.PyTreeSpec:
    return optree.tree_structure(shape_tree, none_is_leaf=False, namespace="ftopt")


def _assume_constant_result(fn):
    """``torch.compiler.assume_constant_result`` without importing Dynamo when ftopt is
    imported (that import costs seconds, and this module is loaded with ftopt so that
    Dynamo never traces an import): the decorator only marks the function, with the
    attribute set here; once Dynamo is imported its own decorator is used.
    ``tests/test_compile.py`` checks that the two agree."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _register(tx_key: str, params_shape, grads_shape, state_shape, backend: str) -> int:
    """Called while tracing (with constants only): remembers the transform, found by its
    owner's key, and the tree structures."""
    obj = owner_by_key(tx_key)
    tx = GradientTransformation(obj.init, obj.update)
    key = len(_REGISTRY)
    _REGISTRY[key] = (tx, _spec(params_shape), _spec(grads_shape), _spec(state_shape),
                      backend)
    return key


def _unflatten(key: int, params, grads, states):
    tx, p_spec, g_spec, s_spec, backend = _REGISTRY[key]
    trees = (optree.tree_unflatten(p_spec, params), optree.tree_unflatten(g_spec, grads),
             optree.tree_unflatten(s_spec, states))
    return tx, trees, backend


@torch.library.custom_op("ftopt::step_", mutates_args=("params", "states"))
def _step_in_place(params: list[torch.Tensor], grads: list[torch.Tensor],
                   states: list[torch.Tensor], key: int) -> None:
    tx, (p, g, s), backend = _unflatten(key, params, grads, states)
    step(tx, p, g, s, donate=True, backend=backend)


@torch.library.custom_op("ftopt::step", mutates_args=())
def _step_functional(params: list[torch.Tensor], grads: list[torch.Tensor],
                     states: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    tx, (p, g, s), backend = _unflatten(key, params, grads, states)
    token = SEPARATE_OUTPUTS.set(True)
    try:
        new_p, new_s = step(tx, p, g, s, donate=False, backend=backend)
    finally:
        SEPARATE_OUTPUTS.reset(token)
    inputs = {id(t) for t in (*params, *grads, *states)}
    outputs = optree.tree_leaves((new_p, new_s), none_is_leaf=False, namespace="ftopt")
    # An op's outputs may not alias its inputs (leaves without a gradient come back as
    # they were).
    return [t.clone() if id(t) in inputs else t for t in outputs]


@_step_functional.register_fake
def _(params, grads, states, key):
    return [torch.empty_like(t) for t in (*params, *states)]


def compiled_step(tx, params, grads, state, donate: bool, backend: str):
    """The body of ``ftopt.step`` while Dynamo traces it."""
    leaves = lambda tree: optree.tree_leaves(tree, none_is_leaf=False, namespace="ftopt")  # noqa: E731
    shape = lambda tree: optree.tree_map(lambda _: 0, tree, none_is_leaf=False,  # noqa: E731
                                         namespace="ftopt")
    tx_key = getattr(getattr(tx.update, "__self__", None), "ftopt_key", None)
    if tx_key is None:
        raise TypeError("ftopt.step under torch.compile needs a transform built by ftopt "
                        "(wrap other functions with ftopt.stateless)")
    key = _register(tx_key, shape(params), shape(grads), shape(state), backend)
    g_flat = leaves(grads)
    p_flat, p_spec = optree.tree_flatten(params, none_is_leaf=False, namespace="ftopt")
    s_flat, s_spec = optree.tree_flatten(state, none_is_leaf=False, namespace="ftopt")
    if donate:
        _step_in_place(p_flat, g_flat, s_flat, key)
        return params, state
    out = _step_functional(p_flat, g_flat, s_flat, key)
    n = len(p_flat)
    return (optree.tree_unflatten(p_spec, out[:n]), optree.tree_unflatten(s_spec, out[n:]))
