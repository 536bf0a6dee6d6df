"""Differentially private SGD (optax.contrib's ``differentially_private_aggregate`` and
``dpsgd``) and optax's per-example clipping functions.

The input of :func:`differentially_private_aggregate` is per-example gradients: every
leaf has the batch on its dim 0 (``torch.func.vmap(torch.func.grad(loss))`` gives them).
Each example's gradient is clipped to the global L2 norm ``l2_norm_clip`` (over all its
leaves), the clipped gradients are summed over the batch, Gaussian noise of standard
deviation ``l2_norm_clip · noise_multiplier`` is added to every element and the sum is
divided by the batch size (Abadi et al. 2016):

    m_i = min(1, C/‖g_i‖)  (1 where ‖g_i‖ = 0),   u = (Σ_i m_i·g_i + C·σ·z)/B

The noise is :func:`ftopt.add_noise`'s (``gamma=0``): a counter-based hash of (seed,
step, leaf position, element position), the same on every backend and reproducible from
the seed and the step count alone; the state holds that count where optax holds a JAX
key, so the values of ``z`` are not JAX's. Runs as eager torch ops, first in a chain
(its output has the params' shapes); it cannot run under ``skip_zeros``, whose promise
(an element with a zero gradient keeps its bits) would withhold the noise from the
elements no example touched, and so reveal them.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from ftopt import tree as tree_lib
from ftopt.base import GradientTransformation, register_owner, register_state
from ftopt.combine import chain
from ftopt.domains import NONNEG, check_finite, check_int
from ftopt.schedules import ScalarOrSchedule
from ftopt.transforms import add_noise, identity, scale_by_learning_rate, trace
from ftopt.transforms.noise import AddNoiseState

__all__ = ["DifferentiallyPrivateAggregateState", "differentially_private_aggregate",
           "dpsgd", "per_example_global_norm_clip", "per_example_layer_norm_clip"]


@register_state
class DifferentiallyPrivateAggregateState(NamedTuple):
    """The step count the noise is drawn from (0-d int32; optax keeps a JAX key)."""

    count: torch.Tensor


def _batched(where: str, leaves: list, paths: list) -> int:
    """The batch size shared by ``leaves`` (dim 0), or a ``ValueError`` naming the leaf."""
    if not leaves:
        raise ValueError(f"{where}: expects at least one gradient leaf")
    for x, path in zip(leaves, paths):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            got = type(x).__name__ if not isinstance(x, torch.Tensor) else x.dtype
            raise TypeError(f"{where}: per-example gradients at {path}: expected a "
                            f"floating-point tensor, got {got}")
        if x.ndim < 1 or x.shape[0] != leaves[0].shape[0]:
            raise ValueError(
                f"{where}: expects per-example gradients with the batch on dim 0 of every "
                f"leaf; {path} has shape {tuple(x.shape)}, {paths[0]} has batch "
                f"{leaves[0].shape[0] if leaves[0].ndim else 'none (0-d)'}")
    return leaves[0].shape[0]


def _clipped_sum(leaves: list, clip: Any) -> tuple[list, torch.Tensor]:
    """Σ_i m_i·g_i per leaf and the number of examples with m_i < 1."""
    sq = sum(x.reshape(x.shape[0], -1).double().square().sum(1) for x in leaves)
    norms = sq.sqrt()
    clip = torch.as_tensor(clip, dtype=torch.float64, device=norms.device)
    # optax: nan_to_num(minimum(C/‖g‖, 1), nan=1): 1 where C = ‖g‖ = 0 or ‖g‖ = ∞ and C = ∞
    multipliers = torch.nan_to_num(torch.minimum(clip / norms, torch.ones_like(norms)),
                                   nan=1.0)
    count = (multipliers < 1.0).sum().to(torch.int32)
    sums = [torch.tensordot(multipliers.to(x.dtype), x, dims=1) for x in leaves]
    return sums, count


def per_example_global_norm_clip(grads: Any, l2_norm_clip: float | torch.Tensor
                                 ) -> tuple[Any, torch.Tensor]:
    """Clips each example's gradient to the global L2 norm ``l2_norm_clip`` and sums them
    (optax's function): every leaf of ``grads`` has the batch on dim 0. Returns the tree of
    sums and the number of examples that were clipped (0-d int32). An example's norm is
    taken in float64; a norm of 0 (or ``l2_norm_clip`` of ``inf`` over an infinite norm)
    scales by 1."""
    leaves, spec, paths = _flat(grads)
    _batched("per_example_global_norm_clip", leaves, paths)
    sums, count = _clipped_sum(leaves, l2_norm_clip)
    return tree_lib.unflatten(spec, sums), count


def per_example_layer_norm_clip(grads: Any, global_l2_norm_clip: float | torch.Tensor,
                                uniform: bool = True) -> tuple[Any, Any]:
    """Clips each leaf's per-example gradients to its own norm and sums them (optax's
    function): ``C/√K`` for K leaves if ``uniform``, else ``C·√(Dₖ/D)`` (Dₖ the leaf's
    elements per example, D their total). Returns the tree of sums and the tree of the
    numbers of examples clipped, per leaf."""
    leaves, spec, paths = _flat(grads)
    _batched("per_example_layer_norm_clip", leaves, paths)
    total = sum(x[0].numel() for x in leaves)
    sums, counts = [], []
    for x in leaves:
        share = 1.0 / len(leaves) if uniform else x[0].numel() / total
        s, c = _clipped_sum([x], global_l2_norm_clip * math.sqrt(share))
        sums.append(s[0])
        counts.append(c)
    return tree_lib.unflatten(spec, sums), tree_lib.unflatten(spec, counts)


def _flat(tree: Any) -> tuple[list, Any, list]:
    paths, leaves, spec = tree_lib.flatten_with_paths(tree)
    return leaves, spec, paths


class DifferentiallyPrivateAggregate:
    """The object behind :func:`differentially_private_aggregate` (see there)."""

    unfused_reason = ("differentially_private_aggregate runs eagerly: its input is "
                      "per-example gradients")
    mask_aware = True  # (refuses skip_zeros itself, below)

    def __init__(self, l2_norm_clip: float, noise_multiplier: float, seed: int):
        name = "differentially_private_aggregate"
        self.l2_norm_clip = check_finite(name, "l2_norm_clip", l2_norm_clip, NONNEG)
        self.noise_multiplier = check_finite(name, "noise_multiplier", noise_multiplier,
                                             NONNEG)
        self.seed = check_int(name, "seed", seed, 0)
        std = self.l2_norm_clip * self.noise_multiplier
        # (u + σ·z with σ² = eta: the noise of add_noise at gamma = 0)
        self.noise = add_noise(std * std, 0.0, self.seed)
        register_owner(self)

    def init(self, params) -> DifferentiallyPrivateAggregateState:
        device = next((x.device for x in tree_lib.leaves(params)
                       if isinstance(x, torch.Tensor)), None)
        return DifferentiallyPrivateAggregateState(
            torch.zeros((), dtype=torch.int32, device=device))

    def update(self, updates, state, params=None, *, zero_mask=None, **extra):
        del params, extra
        name = "differentially_private_aggregate"
        if zero_mask is not None:
            raise TypeError(
                f"{name} cannot run under skip_zeros: keeping the elements with a zero "
                "gradient as they are would withhold the noise from the elements no "
                "example touched (and so reveal them); leave skip_zeros off")
        if not isinstance(state, DifferentiallyPrivateAggregateState):
            raise TypeError(f"{name}: expected a DifferentiallyPrivateAggregateState, got "
                            f"{type(state).__name__}")
        leaves, spec, paths = _flat(updates)
        batch = _batched(name, leaves, paths)
        sums, _ = _clipped_sum(leaves, self.l2_norm_clip)
        noised, noise_state = self.noise.update(tree_lib.unflatten(spec, sums),
                                                AddNoiseState(state.count), backend="eager")
        out = tree_lib.map(lambda x: x / batch, noised)
        return out, DifferentiallyPrivateAggregateState(noise_state.count)


def differentially_private_aggregate(l2_norm_clip: float, noise_multiplier: float,
                                     seed: int = 0) -> GradientTransformation:
    """Aggregates per-example gradients as DP-SGD (optax.contrib's transform; the math
    in :mod:`ftopt.privacy`): clip each example to the global norm ``l2_norm_clip``, sum,
    add N(0, (l2_norm_clip·noise_multiplier)²) noise, divide by the batch size. Every leaf
    of the input has the batch on dim 0; the output has the params' shapes, so it comes
    first in a chain. ``seed`` (an int >= 0) stands for optax's ``key``.

    Args:
        l2_norm_clip: the largest L2 norm of an example's gradient, finite, >= 0.
        noise_multiplier: the noise's standard deviation over ``l2_norm_clip``, >= 0.
        seed: the noise's seed (default: 0).
    """
    obj = DifferentiallyPrivateAggregate(l2_norm_clip, noise_multiplier, seed)
    return GradientTransformation(obj.init, obj.update)


def dpsgd(learning_rate: ScalarOrSchedule, l2_norm_clip: float, noise_multiplier: float,
          seed: int = 0, momentum: float | None = None, nesterov: bool = False
          ) -> GradientTransformation:
    """DP-SGD (optax.contrib's ``dpsgd``): ``chain(differentially_private_aggregate(
    l2_norm_clip, noise_multiplier, seed), [trace(momentum, nesterov)],
    scale_by_learning_rate(learning_rate))``; the gradients passed to ``update`` are
    per-example (the batch on dim 0 of every leaf)."""
    return chain(differentially_private_aggregate(l2_norm_clip, noise_multiplier, seed),
                 trace(momentum, nesterov) if momentum is not None else identity(),
                 scale_by_learning_rate(learning_rate))
