"""Distance over gradients (optax.contrib's ``scale_by_dog`` and ``scale_by_dowg``):
learning-rate-free steps from the distance travelled from the initial params.

Each is one elementwise rule (:mod:`ftopt.rules`): the copy of the initial params is a
``from_params`` slot (kept in the params' compute dtype, never in 8 or 16 bits), the
distance ‖x₀ − p‖ and the gradient norm ‖u‖ are global norms (the fused reduction pass;
on DTensor shards, summed over the ranks), and the running values (the largest distance,
the sum of squared gradient norms) are 0-d running scalars the body computes from them:
no host read. The step's size is one scalar for the whole tree, so with ``skip_zeros``
the skipped elements' update is ``-0.0`` and the scalars advance from the norms, where a
skipped element counts as the zero it is.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ftopt.base import GradientTransformation, register_state
from ftopt.domains import NONNEG, POSITIVE, check_finite
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule, Slot

__all__ = ["DoGState", "DoWGState", "ScaleByDistanceOverGradientsState", "scale_by_dog",
           "scale_by_dowg", "scale_by_distance_over_gradients"]

Float = float | torch.Tensor
INIT_STEPS = ("distance", "learning_rate", "heuristic")


@register_state
class DoGState(NamedTuple):
    """optax.contrib's ``DoGState`` (a step count where optax keeps ``is_init_step``):
    the initial params, the largest distance from them and Σ‖g‖², 0-d fp32."""

    count: torch.Tensor
    init_params: Any
    max_dist: torch.Tensor
    sum_sq_norm_grads: torch.Tensor


@register_state
class DoWGState(NamedTuple):
    """optax.contrib's ``DoWGState``: the initial params, the estimated squared distance
    and the distance-weighted Σ‖g‖², 0-d fp32."""

    init_params: Any
    weighted_sq_norm_grads: torch.Tensor
    estim_sq_dist: torch.Tensor


def _carry(names: tuple[str, ...]):
    def advance(t, h, old) -> tuple[dict, dict]:
        # The body reads the old values and returns the new ones.
        return {k: old[k] for k in names}, {}
    return advance


def _first_step(t, h) -> dict:
    first = (t == 1).to(torch.float64) if isinstance(t, torch.Tensor) else float(t == 1)
    return {"first": first}


def _dog_body(kind: str):
    def body(o, x):
        previous = x.max_dist
        if kind == "heuristic":  # r_ε = value·(1 + ‖x₀‖), the first step's bound
            start = x.init_value * (1.0 + o.global_norm(x.init_params))
            previous = o.where(x.first > 0.5, start, previous)
        max_dist = o.maximum(previous, o.global_norm(x.init_params - x.p))
        norm = o.global_norm(x.u)
        sum_sq = x.sum_sq_norm_grads + norm * norm
        step = max_dist / o.sqrt(sum_sq + x.eps)
        if kind == "learning_rate":
            step = o.where(x.first > 0.5, x.init_value, step)
        return step * x.u, {"init_params": x.init_params, "max_dist": max_dist,
                            "sum_sq_norm_grads": sum_sq}
    return body


def scale_by_dog(init_step: tuple[str, Float], eps: Float = 1e-8) -> GradientTransformation:
    """Scales by DoG's step (Ivgi et al. 2023), as optax.contrib: with x₀ the params at
    ``init``, r̄ ← max(r̄, ‖x₀ − p‖) and G ← G + ‖u‖² over the whole tree,
    ``u ← r̄/√(G + eps) · u``.

    ``init_step`` is ``(kind, value)``: ``"distance"`` starts r̄ at ``value``;
    ``"heuristic"`` at ``value·(1 + ‖x₀‖)`` (taken at the first step from the copy of
    the params; the state holds 0 until then); ``"learning_rate"`` starts r̄ at 0 and
    makes the first step's scale ``value``. Needs the params at every update.

    Args:
        init_step: the initial step's kind and value, value >= 0.
        eps: added to G under the root, > 0 (default: 1e-8).
    """
    if (not isinstance(init_step, tuple) or len(init_step) != 2
            or init_step[0] not in INIT_STEPS):
        raise ValueError(f"scale_by_dog: init_step must be (kind, value) with kind one of "
                         f"{INIT_STEPS}, got {init_step!r}")
    kind, value = init_step
    value = check_finite("scale_by_dog", f"init_step value ({kind})", value, NONNEG)
    rule = Rule(
        "scale_by_dog", _dog_body(kind), state_class=DoGState,
        slots=(Slot("init_params", from_params=True),),
        hparams={"eps": eps, "init_value": value,
                 "init_max_dist": value if kind == "distance" else 0.0},
        domains={"eps": POSITIVE},
        scalars=_first_step, counted=True, uses_params=True,
        running={"max_dist": "init_max_dist", "sum_sq_norm_grads": 0.0},
        advance=_carry(("max_dist", "sum_sq_norm_grads")))
    return rule_transform(rule)


def _dowg_body(o, x):
    distance = o.global_norm(x.init_params - x.p)
    estim = o.maximum(x.estim_sq_dist, distance * distance)
    norm = o.global_norm(x.u)
    weighted = estim * (norm * norm) + x.weighted_sq_norm_grads
    step = estim / (o.sqrt(weighted) + x.eps)
    return step * x.u, {"init_params": x.init_params, "estim_sq_dist": estim,
                        "weighted_sq_norm_grads": weighted}


def scale_by_dowg(init_estim_sq_dist: Float | None = None,
                  eps: Float = 1e-4) -> GradientTransformation:
    """Scales by DoWG's step (Khaled et al. 2023), as optax.contrib: with x₀ the params at
    ``init``, r² ← max(r², ‖x₀ − p‖²), V ← V + r²·‖u‖² over the whole tree,
    ``u ← r²/(√V + eps) · u``. Needs the params at every update.

    Args:
        init_estim_sq_dist: the initial r², >= 0 (default: ``eps``).
        eps: added to √V, > 0 (default: 1e-4).
    """
    start = eps if init_estim_sq_dist is None else init_estim_sq_dist
    rule = Rule(
        "scale_by_dowg", _dowg_body, state_class=DoWGState,
        slots=(Slot("init_params", from_params=True),),
        hparams={"eps": eps, "init_estim_sq_dist": start},
        domains={"eps": POSITIVE, "init_estim_sq_dist": NONNEG},
        uses_params=True,
        running={"estim_sq_dist": "init_estim_sq_dist", "weighted_sq_norm_grads": 0.0},
        advance=_carry(("estim_sq_dist", "weighted_sq_norm_grads")))
    return rule_transform(rule)


@register_state
class ScaleByDistanceOverGradientsState(NamedTuple):
    """optax's ``ScaleByDistanceOverGradientsState``: per leaf, the largest distance from
    the initial params and the sum of squared gradient norms (0-d, where optax keeps a
    shape-(1,) array), and the initial params. ``max_dist`` holds −1 until a leaf's first
    step (where optax's init stores reps_rel·(1 + ‖x₀‖), which that step takes)."""

    max_dist: Any
    grad_sum_of_squares: Any
    init_params: Any


def _ldog_body(o, x):
    start = x.reps_rel * (1.0 + o.leaf_norm(x.init_params))
    previous = o.where(x.max_dist < 0.0, start, x.max_dist)
    max_dist = o.maximum(previous, o.leaf_norm(x.p - x.init_params))
    norm = o.leaf_norm(x.u)
    sum_sq = x.grad_sum_of_squares + norm * norm
    step = x.global_scale * (max_dist / o.sqrt(sum_sq + x.eps))
    return step * x.u, {"max_dist": max_dist, "grad_sum_of_squares": sum_sq,
                        "init_params": x.init_params}


def scale_by_distance_over_gradients(reps_rel: Float = 1e-6, eps: Float = 1e-8,
                                     param_dtype: torch.dtype | None = None,
                                     global_scale: Float = 1.0) -> GradientTransformation:
    """Layer-wise DoG (LDoG, Ivgi et al. 2023), optax's
    ``scale_by_distance_over_gradients``: per leaf, with x₀ its params at ``init``,
    r̄ ← max(r̄, ‖p − x₀‖) (r̄ starting at reps_rel·(1 + ‖x₀‖)), G ← G + ‖u‖²,
    ``u ← global_scale · r̄/√(G + eps) · u``. One elementwise rule: the three leaf norms
    come from the fused reduction pass, r̄ and G are per-leaf slots (0-d, never 8 or
    16-bit). With ``skip_zeros`` a leaf whose gradient is all zero keeps r̄ and G bit for
    bit; in a partly zero leaf they advance from the norms, where a skipped element counts
    as the zero it is. Needs the params at every update.

    Args:
        reps_rel: the initial distance's factor, >= 0 (default: 1e-6).
        eps: added to G under the root, > 0 (default: 1e-8).
        param_dtype: the copy of the initial params is kept in the params' compute
            dtype (fp32 for 16-bit params); only ``None``, ``torch.float32`` (optax's
            default) or ``torch.float64`` are accepted, and the copy follows the params
            all the same.
        global_scale: a factor of every update, typically 1.0 or −1.0 (default: 1.0).
    """
    if param_dtype not in (None, torch.float32, torch.float64):
        raise ValueError("scale_by_distance_over_gradients: param_dtype must be None, "
                         f"torch.float32 or torch.float64, got {param_dtype!r}")
    rule = Rule(
        "scale_by_distance_over_gradients", _ldog_body,
        state_class=ScaleByDistanceOverGradientsState,
        slots=(Slot("max_dist", per_leaf=True, init="unset"),
               Slot("grad_sum_of_squares", signed=False, per_leaf=True),
               Slot("init_params", from_params=True)),
        hparams={"reps_rel": reps_rel, "eps": eps, "global_scale": global_scale,
                 "unset": -1.0},
        domains={"reps_rel": NONNEG, "eps": POSITIVE},
        uses_params=True)
    return rule_transform(rule)
