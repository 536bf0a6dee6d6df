"""Complex params as pairs of real ones (optax.contrib's ``split_real_and_imaginary``).

The wrapper splits every complex param and update into a
:class:`SplitRealAndImaginaryArrays` of two real tensors (the real and the imaginary
parts, each contiguous) before the inner transform's ``init`` and ``update``, and merges
the inner updates back into complex ones: an optimizer of complex params behaves as the
same optimizer of two real params, and each part is a leaf of its own (a per-leaf norm
sees the parts apart, as in optax). Real leaves pass through as they are. In a chain with
``skip_zeros`` a complex element is skipped where both its parts are zero (the complex
gradient is zero): the inner transform keeps both parts' states and the update is
``-0.0 - 0.0j``, which leaves the param's bits as they are.

PyTorch's autograd gives the conjugate Wirtinger derivative of a real loss (the direction
of steepest ascent), so, unlike JAX's ``grad``, the gradients need no conjugation before
``update``: ``p - lr·grad`` descends. For elementwise optimizers the result is then that of
``torch.optim`` on complex params (which views them as real pairs). The wrapper runs as
eager torch ops; its inner transform's update is called as any nested update is (in
``ftopt.step`` eagerly; from a direct ``update`` call, fused where it fuses).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from ftopt import tree as tree_lib
from ftopt.base import GradientTransformation, check_transform, register_owner, register_state
from ftopt.program import skip_updates

__all__ = ["SplitRealAndImaginaryArrays", "SplitRealAndImaginaryState",
           "split_real_and_imaginary"]


@register_state
class SplitRealAndImaginaryArrays(NamedTuple):
    """The real and imaginary parts of a complex tensor, each a real tensor."""

    real: torch.Tensor
    imaginary: torch.Tensor


@register_state
class SplitRealAndImaginaryState(NamedTuple):
    """The inner transform's state (over the split tree)."""

    inner_state: Any


def _split(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_complex():
        return SplitRealAndImaginaryArrays(x.real.contiguous(), x.imag.contiguous())
    return x


def _merge(x: Any) -> Any:
    if isinstance(x, SplitRealAndImaginaryArrays):
        return torch.complex(x.real, x.imaginary)
    return x


def _split_tree(tree: Any) -> Any:
    return None if tree is None else tree_lib.map(_split, tree)


def _split_mask(u: Any, mask: Any) -> Any:
    """A complex element is skipped where both its parts are zero: its mask for both."""
    if isinstance(u, torch.Tensor) and u.is_complex():
        return SplitRealAndImaginaryArrays(mask, mask)
    return mask


class SplitRealAndImaginary:
    """The object behind :func:`split_real_and_imaginary` (see there)."""

    unfused_reason = "split_real_and_imaginary runs eagerly: it splits complex tensors"
    mask_aware = True  # (the chain's zero mask, split as the updates are: below)

    def __init__(self, inner: GradientTransformation):
        check_transform(inner, "split_real_and_imaginary: inner")
        self.inner = inner
        register_owner(self)

    def init(self, params) -> SplitRealAndImaginaryState:
        return SplitRealAndImaginaryState(self.inner.init(_split_tree(params)))

    def update(self, updates, state, params=None, **extra):
        if not isinstance(state, SplitRealAndImaginaryState):
            raise TypeError("split_real_and_imaginary: expected a SplitRealAndImaginaryState,"
                            f" got {type(state).__name__}")
        mask = extra.get("zero_mask")
        if mask is not None:  # inside a skip_zeros chain
            mask = tree_lib.map(_split_mask, updates, mask)
            extra = {**extra, "zero_mask": mask}
        out, inner_state = self.inner.update(_split_tree(updates), state.inner_state,
                                             _split_tree(params), **extra)
        if mask is not None:  # (-0.0 in both parts: p + (-0.0 - 0.0j) is p, bit for bit)
            out = skip_updates(out, mask)
        merged = optree.tree_map(
            _merge, out, is_leaf=lambda x: isinstance(x, SplitRealAndImaginaryArrays),
            none_is_leaf=False, namespace="ftopt")
        return merged, SplitRealAndImaginaryState(inner_state)


def split_real_and_imaginary(inner: GradientTransformation) -> GradientTransformation:
    """Runs ``inner`` on the real and imaginary parts of complex params and updates as
    separate real leaves, and merges its updates back into complex ones (optax.contrib's
    wrapper; see :mod:`ftopt.complex_valued`). Real leaves pass through unchanged.
    Gradients from PyTorch's autograd are passed as they are (no conjugation).

    Args:
        inner: the transform of the real parts (any ``GradientTransformation``).
    """
    obj = SplitRealAndImaginary(inner)
    return GradientTransformation(obj.init, obj.update)
