r"""Self-supervised (contrastive and metric) losses, optax's :func:`ntxent` and
:func:`triplet_margin_loss`, for torch tensors.

Differences from optax, where JAX and torch differ:

* :func:`triplet_margin_loss` measures distances with :math:`|a - b|^q` (a true
  :math:`\ell_q` norm); optax raises the signed difference to the power ``norm_degree``,
  which agrees for even degrees (the default 2) but is not a distance for odd or
  fractional ones (negative sums, NaN).
* Inputs are torch tensors; the embeddings must be floating point.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ftopt.losses import _checks as check
from ftopt.losses._checks import Scalar

__all__ = ["ntxent", "triplet_margin_loss"]


def ntxent(embeddings: torch.Tensor, labels: torch.Tensor,
           temperature: Scalar = 0.07) -> torch.Tensor:
    r"""Normalized temperature-scaled cross entropy (NT-Xent, SimCLR's loss).

    With :math:`s_{ij} = \cos(z_i, z_j) / \tau` (the squared norms clipped at the
    dtype's machine epsilon), the mean over positive pairs :math:`(i, j)`, :math:`i \ne
    j` with equal labels, of

    .. math::
        -\log \frac{e^{s_{ij}}}{e^{s_{ij}} + \sum_{k:\, y_k \ne y_i} e^{s_{ik}}}.

    ``embeddings`` is ``[batch, features]``; ``labels`` is ``[batch]``, equal for the
    members of a positive group (e.g. ``[0, 0, 1, 1]`` for two pairs). Returns a scalar;
    NaN when no two samples share a label (no positive pair), as in optax.
    """
    fn = "ntxent"
    check.floating(fn, "embeddings", embeddings)
    check.tensor(fn, "labels", labels)
    check.number(fn, "temperature", temperature, "> 0")
    if embeddings.ndim != 2:
        raise ValueError(f"{fn}: embeddings must be 2-D [batch, features], got shape "
                         f"{tuple(embeddings.shape)}")
    if labels.ndim != 1 or labels.shape[0] != embeddings.shape[0]:
        raise ValueError(f"{fn}: labels must be 1-D with one label per embedding "
                         f"({embeddings.shape[0]}), got shape {tuple(labels.shape)}")
    eps = torch.finfo(embeddings.dtype).eps
    norms = torch.clamp((embeddings * embeddings).sum(-1, keepdim=True), min=eps).sqrt()
    unit = embeddings / norms
    logits = (unit @ unit.T) / temperature

    same = labels[:, None] == labels[None, :]
    eye = torch.eye(labels.shape[0], dtype=torch.bool, device=labels.device)
    positive, negative = same & ~eye, ~same
    # log sum_k exp(s_ik) over the negatives of row i (-inf for a row with none); a row
    # without negatives reads its logits unmasked and is then discarded, so no -inf
    # enters logsumexp's backward.
    has_negative = negative.any(dim=-1)
    fill = torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device)
    masked = torch.where(negative | ~has_negative[:, None], logits, fill)
    negative_lse = torch.where(has_negative, torch.logsumexp(masked, dim=-1), fill)
    # -log(e^s / (e^s + e^n)) = softplus(n - s)
    pair_loss = F.softplus(negative_lse[:, None] - logits)
    zero = torch.zeros((), dtype=logits.dtype, device=logits.device)
    return torch.where(positive, pair_loss, zero).sum() / positive.sum()


def triplet_margin_loss(anchors: torch.Tensor, positives: torch.Tensor,
                        negatives: torch.Tensor, axis: int = -1, norm_degree: Scalar = 2,
                        margin: Scalar = 1.0, eps: Scalar = 1e-6) -> torch.Tensor:
    r"""Triplet margin loss, per triplet (no reduction):

    .. math::
        \max\bigl(d(a, p) - d(a, n) + m,\ 0\bigr), \qquad
        d(x, y) = \Bigl(\sum_i |x_i - y_i|^q + \epsilon\Bigr)^{1/q}

    with the sum over ``axis``, :math:`q` = ``norm_degree`` and :math:`m` = ``margin``.
    ``anchors``, ``positives`` and ``negatives`` broadcast to one shape (typically
    ``[batch, features]``); the result has that shape without ``axis``.
    ``torch.nn.functional.triplet_margin_loss`` adds its ``eps`` to the differences
    instead; both agree at ``eps=0``.
    """
    fn = "triplet_margin_loss"
    named = {"anchors": anchors, "positives": positives, "negatives": negatives}
    for name, value in named.items():
        check.floating(fn, name, value)
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise TypeError(f"{fn}: axis must be an int, got {axis!r}")
    check.number(fn, "norm_degree", norm_degree, "> 0")
    check.number(fn, "margin", margin)
    check.number(fn, "eps", eps, ">= 0")
    shape = check.broadcast(fn, named)
    (dim,) = check.dims(fn, axis, len(shape))
    anchors = anchors.expand(shape)

    def distance(other: torch.Tensor) -> torch.Tensor:
        powered = torch.pow((anchors - other.expand(shape)).abs(), norm_degree)
        return torch.pow(powered.sum(dim=dim) + eps, 1.0 / norm_degree)

    return torch.relu(distance(positives) - distance(negatives) + margin)
