"""Everyday utilities of optax: ``zero_nans``, ``clip``, ``keep_params_nonnegative`` (each an
elementwise rule: fused on a GPU) and ``centralize`` (a matrix stage: whole-leaf means,
batched by shape; the elementwise stages around it stay fused). ``clip_by_block_rms`` is an
elementwise rule with a per-leaf norm (:mod:`ftopt.transforms.factored`).
"""

from __future__ import annotations

import torch

from ftopt.base import GradientTransformation
from ftopt.domains import POSITIVE
from ftopt.matrix import matrix_transform
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule


def _zero_nans_body(o, x):
    return o.where(x.u != x.u, 0.0, x.u), {}


def zero_nans() -> GradientTransformation:
    """Replaces NaN updates by zero: u ← 0 where u is NaN, else u (±Inf pass through).

    optax also records, per leaf, whether a NaN was found (``ZeroNansState.found_nan``);
    ftopt keeps no state here (a per-leaf flag would be a reduction written back to the
    state on every step): check the gradients, or wrap the optimizer in
    :func:`ftopt.apply_if_finite`, which records ``last_finite`` and ``total_notfinite``.
    """
    return rule_transform(Rule("zero_nans", _zero_nans_body))


def _clip_body(o, x):
    # Two selects rather than minimum/maximum: a NaN passes through, as jnp.clip lets it.
    low = -x.max_delta
    return o.where(x.u > x.max_delta, x.max_delta, o.where(x.u < low, low, x.u)), {}


def clip(max_delta: float | torch.Tensor) -> GradientTransformation:
    """Clips every element: u ← min(max(u, −max_delta), max_delta) (NaN stays NaN).

    Args:
        max_delta: the largest magnitude of an update element, > 0.
    """
    return rule_transform(Rule("clip", _clip_body, hparams={"max_delta": max_delta},
                               domains={"max_delta": POSITIVE}))


def _nonnegative_body(o, x):
    return o.where(x.p + x.u < 0.0, -x.p, x.u), {}


def keep_params_nonnegative() -> GradientTransformation:
    """Keeps params >= 0: u ← −p where p + u < 0, else u (as optax).

    Params must start non-negative (it only stops the update from crossing zero). Reads
    the params: ``update(updates, state, params)``.
    """
    return rule_transform(Rule("keep_params_nonnegative", _nonnegative_body,
                               uses_params=True))


def _has_matrix_shape(leaf: torch.Tensor) -> bool:
    return leaf.dim() > 1 and leaf.numel() > 0


def centralize() -> GradientTransformation:
    """Gradient centralization (Yong et al., 2020), as optax: for leaves with ndim > 1,
    u ← u − mean(u) over every axis but the first; other leaves pass through.

    A matrix stage: equal-shaped leaves are computed in one batched call; in a chain the
    elementwise stages before and after it stay fused. On DTensor leaves it needs each
    ``u[i, ...]`` whole on its rank (``Shard(0)`` or ``Replicate``).
    """

    def fn(batch: torch.Tensor) -> torch.Tensor:
        dims = tuple(range(2, batch.dim()))  # batch is (B, *shape)
        return batch - batch.mean(dim=dims, keepdim=True)

    return matrix_transform("centralize", fn, applies=_has_matrix_shape, reads="rows")
