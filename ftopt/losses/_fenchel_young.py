r"""Fenchel-Young losses (optax's ``make_fenchel_young_loss``), for torch tensors.

A convex "max function" :math:`\Omega^*` (a smoothed max of the scores, such as
``torch.logsumexp``) defines the loss

.. math:: \ell(z, y) = \Omega^*(z) - \langle y, z \rangle,

whose gradient in the scores is :math:`\nabla\Omega^*(z) - y`: the prediction
(softmax for ``logsumexp``) minus the target. No custom backward is needed: autograd of
this expression is that gradient exactly (and stays differentiable twice), under
``torch.autograd`` and ``torch.func`` (``grad``, ``vmap``, ``jacrev``) alike.

Reference: Blondel, Martins and Niculae, *Learning with Fenchel-Young Losses*, JMLR 2020.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.func

from ftopt.losses import _checks as check

__all__ = ["make_fenchel_young_loss"]

MaxFun = Callable[..., torch.Tensor]


def make_fenchel_young_loss(max_fun: MaxFun) -> Callable[..., torch.Tensor]:
    r"""The Fenchel-Young loss :math:`\ell(z, y) = \Omega^*(z) - \langle y, z\rangle` of
    the max function :math:`\Omega^*` = ``max_fun``.

    The returned ``fenchel_young_loss(scores, targets, *args, **kwargs)`` works on the
    last axis: ``max_fun(v, *args, **kwargs)`` is applied to each vector ``v`` of
    ``scores[..., :]`` (through ``torch.func.vmap`` when ``scores`` has leading axes, so
    ``max_fun`` must be vmappable: no Python branch on a tensor's value; ``args`` and
    ``kwargs`` are passed unbatched), ``targets`` broadcasts with ``scores``, and the
    result has the broadcast leading shape. Its gradient in ``scores`` is
    ``grad(max_fun)(scores) - targets``; in ``targets``, ``-scores``.

    Args:
        max_fun: a function of a 1-d score vector returning a 0-d tensor, e.g.
            ``lambda v: torch.logsumexp(v, -1)`` (which makes the loss the softmax cross
            entropy for a one-hot or probability-vector target).

    Returns:
        The loss function.
    """
    if not callable(max_fun):
        raise TypeError(f"make_fenchel_young_loss: max_fun must be a callable, "
                        f"got {type(max_fun).__name__}")
    fn = "fenchel_young_loss"  # the name of the returned function

    def one(vector: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        value = max_fun(vector, *args, **kwargs)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            got = (f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                   else type(value).__name__)
            raise ValueError(f"{fn}: max_fun must return a 0-d tensor for a 1-d score "
                             f"vector, got {got}")
        return value

    def fenchel_young_loss(scores: torch.Tensor, targets: torch.Tensor, *args: Any,
                           **kwargs: Any) -> torch.Tensor:
        r""":math:`\Omega^*(z) - \langle y, z\rangle` over the last axis of ``scores``
        (:math:`z`) and ``targets`` (:math:`y`)."""
        check.floating(fn, "scores", scores)
        check.floating(fn, "targets", targets)
        if scores.dim() == 0:
            raise ValueError(f"{fn}: scores must have at least one axis (the scores are on "
                             "the last), got a 0-d tensor")
        if targets.dim() == 0 or targets.shape[-1] not in (1, scores.shape[-1]):
            raise ValueError(f"{fn}: targets must have a last axis of size "
                             f"{scores.shape[-1]} (scores'), got shape "
                             f"{tuple(targets.shape)}")
        check.broadcast(fn, {"scores' leading axes": scores.shape[:-1],
                             "targets' leading axes": targets.shape[:-1]})
        inner = (targets * scores).sum(-1)
        if scores.dim() == 1:
            max_value = one(scores, *args, **kwargs)
        elif scores.shape[:-1].numel() == 0:
            max_value = scores.sum(-1)
        else:
            rows = scores.reshape(-1, scores.shape[-1])
            per_row = torch.func.vmap(lambda v: one(v, *args, **kwargs))(rows)
            max_value = per_row.reshape(scores.shape[:-1])
        return max_value - inner

    return fenchel_young_loss
