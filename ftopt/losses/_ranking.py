r"""Listwise ranking losses (optax's ``ranking_softmax_loss``), for torch tensors.

A ranking loss scores the order that item scores induce on a list against the order its
relevance labels induce. The last axis is the list; leading axes are a batch of lists.

Differences from optax, where JAX and torch differ:

* ``reduce_fn``: optax calls ``reduce_fn(loss, where=mask)``, which torch's reductions
  do not take. Here ``torch.mean`` (the default) and ``torch.sum`` are recognised and
  reduce over the valid lists only (a mean over no valid list is 0, as optax's); any
  other callable gets the unreduced loss, ``reduce_fn(loss)``, with the losses of lists
  that ``where`` masks out entirely set to 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ftopt.losses import _checks as check

__all__ = ["ranking_softmax_loss"]

ReduceFn = Callable[[torch.Tensor], torch.Tensor]


def _list_values(fn: str, name: str, x: object, logits: torch.Tensor) -> torch.Tensor:
    """``x`` (labels or weights) checked, broadcast to ``logits``' shape and cast to
    their dtype."""
    x = check.real(fn, name, x)
    return check.broadcast_to(fn, name, x, logits.shape, of="logits'").to(logits.dtype)


def _reduce(loss: torch.Tensor, valid: torch.Tensor | None,
            reduce_fn: ReduceFn | None) -> torch.Tensor:
    """Reduce the per-list ``loss`` over the lists where ``valid`` (all if ``None``)."""
    if valid is not None:
        loss = torch.where(valid, loss, 0.0)
        if reduce_fn is torch.mean:
            return loss.sum() / valid.sum().to(loss.dtype).clamp_min(1)
    if reduce_fn is None:
        return loss
    return reduce_fn(loss)


def ranking_softmax_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    where: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    reduce_fn: ReduceFn | None = torch.mean,
) -> torch.Tensor:
    r"""Ranking softmax loss of each list,
    :math:`\ell(s, y) = -\sum_i w_i y_i \log \frac{e^{s_i}}{\sum_j e^{s_j}}`, reduced.

    The sums run over the valid items (``where``) only; the labels are used as given
    (not normalised), so a list with no relevant item (all labels 0) has loss 0 and,
    under ``torch.mean``, still counts in the mean. A list with no valid item has loss 0
    and does not count in the mean.

    Args:
        logits: ``[..., list_size]`` item scores, a floating-point tensor.
        labels: ``[..., list_size]`` relevance labels (cast to ``logits``' dtype).
        where: optional ``[..., list_size]`` bool tensor, False for items to ignore.
        weights: optional ``[..., list_size]`` item weights :math:`w_i` (1 if omitted).
        reduce_fn: ``torch.mean`` (default), ``torch.sum``, ``None`` for the
            ``[...]`` per-list losses, or another callable applied to them.

    ``labels``, ``where`` and ``weights`` may be of any shape broadcastable to
    ``logits``'.

    Returns:
        The reduced loss, or the ``[...]`` per-list losses if ``reduce_fn`` is None.
    """
    fn = "ranking_softmax_loss"
    check.floating(fn, "logits", logits)
    if logits.dim() == 0:
        raise ValueError(f"{fn}: logits must have shape [..., list_size], got a 0-d tensor")
    if reduce_fn is not None and not callable(reduce_fn):
        raise TypeError(f"{fn}: reduce_fn must be torch.mean, torch.sum, None or a "
                        f"callable, got {type(reduce_fn).__name__}")
    labels = _list_values(fn, "labels", labels, logits)
    if weights is not None:
        labels = labels * _list_values(fn, "weights", weights, logits)
    where = check.mask(fn, where, logits.shape, of="logits'")
    valid = None
    if where is not None:
        valid = where.any(dim=-1)
        # Masked items get a score of -inf (out of the softmax); a list with no valid
        # item keeps finite scores so that nothing, its gradient included, is NaN.
        fill = torch.where(valid, float("-inf"), 0.0).to(logits.dtype).unsqueeze(-1)
        logits = torch.where(where, logits, fill)
    terms = labels * torch.log_softmax(logits, dim=-1)
    if where is not None:
        terms = torch.where(where, terms, 0.0)
    loss = -terms.sum(dim=-1)
    return _reduce(loss, valid, reduce_fn)
