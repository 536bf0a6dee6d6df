"""Norm-based transforms: ``clip_by_global_norm``, ``normalize_by_update_norm``,
``clip_by_param_norm_ratio``, ``scale_by_trust_ratio``.

Their bodies read norms through ``o.leaf_norm`` / ``o.global_norm``: the eager backend
computes them with torch, the fused backend in a reduction pass before the main kernel.
"""

from __future__ import annotations

import torch

from ftopt.base import GradientTransformation
from ftopt.domains import NONNEG, POSITIVE
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule


def _global_clip_body(o, x):
    norm = o.global_norm(x.u)
    return o.where(norm < x.max_norm, x.u, x.u * (x.max_norm / norm)), {}


def clip_by_global_norm(max_norm: float | torch.Tensor) -> GradientTransformation:
    """Clips the whole tree to a global norm: u ← u·min(1, max_norm/‖u‖).

    ‖u‖ is over all leaves of the tree (as optax). ``max_norm`` > 0 (a negative one would
    flip the update's sign).
    """
    return rule_transform(
        Rule("clip_by_global_norm", _global_clip_body, hparams={"max_norm": max_norm},
             domains={"max_norm": POSITIVE})
    )


def _normalize_body(o, x):
    return x.u / ((o.global_norm(x.u) + x.eps) / x.scale_factor), {}


def normalize_by_update_norm(scale_factor: float | torch.Tensor = 1.0,
                             eps: float | torch.Tensor = 1e-6) -> GradientTransformation:
    """Scales the whole tree to a global norm, as optax: u ← u / ((‖u‖ + eps)/scale_factor).

    ‖u‖ is over all leaves of the tree. Args: scale_factor: the norm of the result (any
    sign: ``-1.0`` descends with ``apply_updates``), finite; eps: >= 0, added to the norm.
    """
    return rule_transform(
        Rule("normalize_by_update_norm", _normalize_body,
             hparams={"scale_factor": scale_factor, "eps": eps}, domains={"eps": NONNEG})
    )


def normalize() -> GradientTransformation:
    """Scales the whole tree to unit global norm, u ← u/‖u‖ (optax.contrib's ``normalize``,
    which SAM's adversarial optimizer uses): ``normalize_by_update_norm(1.0, 0.0)``, the
    same rule (a zero tree gives NaN, as optax's 0/0)."""
    return normalize_by_update_norm(1.0, 0.0)


def _param_ratio_body(o, x):
    limit = x.max_ratio * o.leaf_norm(x.p)
    norm = o.leaf_norm(x.u)
    factor = o.where(norm > limit, limit / norm, 1.0)
    return x.u * factor, {}


def clip_by_param_norm_ratio(max_ratio: float | torch.Tensor) -> GradientTransformation:
    """Per leaf: if ‖u‖ > max_ratio·‖p‖ then u ← u·max_ratio·‖p‖/‖u‖.

    The update-norm clipping of bitsandbytes' LAMB and LARS (``max_unorm``); ``max_ratio``
    > 0.
    """
    return rule_transform(
        Rule("clip_by_param_norm_ratio", _param_ratio_body, hparams={"max_ratio": max_ratio},
             domains={"max_ratio": POSITIVE}, uses_params=True)
    )


def _trust_body(o, x):
    param_norm = o.maximum(o.leaf_norm(x.p), x.min_norm)
    update_norm = o.maximum(o.leaf_norm(x.u), x.min_norm)
    ratio = x.trust_coefficient * param_norm / (update_norm + x.eps)
    zero = (param_norm == 0.0) | (update_norm == 0.0)
    return x.u * o.where(zero, 1.0, ratio), {}


def scale_by_trust_ratio(
    min_norm: float | torch.Tensor = 0.0,
    trust_coefficient: float | torch.Tensor = 1.0,
    eps: float | torch.Tensor = 0.0,
) -> GradientTransformation:
    """Per leaf, as optax: u ← u·c·‖p‖/(‖u‖+eps), ratio 1 where ‖p‖ = 0 or ‖u‖ = 0.

    Norms are floored at ``min_norm``; ``min_norm``, ``trust_coefficient`` and ``eps`` are
    >= 0.
    """
    return rule_transform(
        Rule(
            "scale_by_trust_ratio",
            _trust_body,
            hparams={"min_norm": min_norm, "trust_coefficient": trust_coefficient,
                     "eps": eps},
            domains={"min_norm": NONNEG, "trust_coefficient": NONNEG, "eps": NONNEG},
            uses_params=True,
        )
    )
