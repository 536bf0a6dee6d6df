r"""Sparsemax losses (optax's ``sparsemax_loss`` and ``multiclass_sparsemax_loss``), for
torch tensors.

Sparsemax maps scores :math:`z` to their Euclidean projection onto the probability
simplex, :math:`\operatorname{sparsemax}(z) = \operatorname{argmin}_{p \in \Delta}
\|p - z\|^2` (:func:`ftopt.projections.projection_simplex`, one row at a time). Its
losses are the Fenchel-Young losses of the Gini negentropy
:math:`\Omega(p) = \tfrac12(\|p\|^2 - 1)`: zero exactly when sparsemax gives the label
all the mass, with gradient :math:`\operatorname{sparsemax}(z) - e_y`.

Both functions are differentiable with ``torch.autograd`` and ``torch.func`` (``grad``,
``vmap``); labels are not range-checked on the host (that would read a tensor's value),
so a label outside ``[0, K)`` makes torch's indexing raise.
"""

from __future__ import annotations

import torch
import torch.func

from ftopt.losses import _checks as check
from ftopt.projections import projection_simplex

__all__ = ["multiclass_sparsemax_loss", "sparsemax_loss"]


def sparsemax_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    r"""Binary sparsemax loss, :math:`\operatorname{sparse\_plus}(-z)` for label 1 and
    :math:`\operatorname{sparse\_plus}(z)` for label 0, element by element.

    :math:`\operatorname{sparse\_plus}(x)` is 0 for :math:`x \le -1`,
    :math:`(x + 1)^2 / 4` for :math:`-1 < x < 1` and :math:`x` for :math:`x \ge 1`; the
    loss is zero exactly when the sparse sigmoid of ``logits`` equals ``labels``.

    Args:
        logits: the scores, a floating-point tensor.
        labels: the labels, 0 or 1 (any nonzero value counts as 1; bool, integer or
            float), broadcastable with ``logits``.

    Returns:
        The loss, of the broadcast shape of ``logits`` and ``labels``.
    """
    fn = "sparsemax_loss"
    check.floating(fn, "logits", logits)
    check.tensor(fn, "labels", labels)
    check.broadcast(fn, {"logits": logits, "labels": labels})
    x = torch.where(labels != 0, -logits, logits)
    middle = (x.clamp(-1.0, 1.0) + 1.0).square() / 4.0
    return torch.where(x >= 1.0, x, middle)


def _sparsemax_rows(scores: torch.Tensor) -> torch.Tensor:
    """Sparsemax over the last axis of ``scores`` (at least one row)."""
    rows = scores.reshape(-1, scores.shape[-1])
    return torch.func.vmap(projection_simplex)(rows).reshape(scores.shape)


def multiclass_sparsemax_loss(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    r"""Multiclass sparsemax loss, per example:
    :math:`\langle p, z - z_y \rangle + \tfrac12 (1 - \|p\|^2)` with
    :math:`p = \operatorname{sparsemax}(z)`.

    This is :math:`\Omega^*(z) - z_y` with :math:`\Omega^*(z) = \langle p, z\rangle +
    \tfrac12(1 - \|p\|^2)`; the inner product runs over the support of :math:`p` only
    (classes of score :math:`-\infty` outside it add nothing).

    Args:
        scores: ``(..., K)`` scores (optax takes ``(B, K)``; any number of leading axes,
            none included, works here).
        labels: ``(...)`` integer labels in ``[0, K)``, ``scores``' leading shape.

    Returns:
        The ``(...)`` loss.
    """
    fn = "multiclass_sparsemax_loss"
    check.floating(fn, "scores", scores)
    if scores.dim() == 0 or scores.shape[-1] == 0:
        raise ValueError(f"{fn}: scores must have shape (..., K) with K >= 1, "
                         f"got {tuple(scores.shape)}")
    check.integer(fn, "labels", labels)
    if labels.shape != scores.shape[:-1]:
        raise ValueError(f"{fn}: labels must have shape {tuple(scores.shape[:-1])} "
                         f"(scores' without the last axis), got {tuple(labels.shape)}")
    if scores.numel() == 0:
        return scores.sum(-1)
    proba = _sparsemax_rows(scores)
    index = labels.long().unsqueeze(-1)
    classes = torch.arange(scores.shape[-1], device=scores.device)
    is_label = classes == index
    gap = torch.where(is_label, 0.0, scores - scores.gather(-1, index))
    inner = torch.where(proba > 0, proba * gap, 0.0).sum(-1)
    return inner + 0.5 * (1.0 - proba.square().sum(-1))
