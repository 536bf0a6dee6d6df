"""optax's ``MultiSteps`` (gradient accumulation): its bookkeeping runs eagerly with torch
ops and calls the inner transform's ``update``, which fuses as usual (``backend=`` reaches
it). ``inject_hyperparams`` is :mod:`ftopt.inject`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ftopt import tree as tree_lib
from ftopt._counts import host_count, mark_device_decided, new_count
from ftopt.base import GradientTransformation, check_transform, register_owner, register_state
from ftopt.domains import check_int
from ftopt.rules import check_param, checked_params
from ftopt.validate import check_layout, check_leaf

__all__ = ["MultiSteps", "MultiStepsState"]


@register_state
class MultiStepsState(NamedTuple):
    """The state of :class:`MultiSteps` (optax's layout).

    Attributes:
        mini_step: micro-steps accumulated since the last inner step (0-d int32).
        gradient_step: inner steps taken (0-d int32).
        inner_opt_state: the inner transform's state.
        acc_grads: the accumulated gradients (a tree like the params, fp32 or wider).
    """

    mini_step: torch.Tensor
    gradient_step: torch.Tensor
    inner_opt_state: Any
    acc_grads: Any


def _read(count: torch.Tensor) -> int:
    """A counter's value: from the host mirror when known (no device read), else read."""
    known = host_count(count)
    return int(count) if known is None else known


class MultiSteps:
    """Gradient accumulation over ``k`` micro-steps (optax.MultiSteps).

    On each call the gradient enters the accumulator: acc ← acc + (g − acc)/(n + 1) with
    ``use_grad_mean`` (the running mean of the ``n + 1`` gradients so far), else
    acc ← acc + g. On micro-steps 1 … k−1 the update is zero (``-0.0``: ``p + u`` keeps
    every param bit-identical) and the inner state is kept; on the k-th, the inner
    transform runs on the accumulated gradient, its update is returned, and the
    accumulator is reset. ``k = every_k_schedule(gradient_step)`` (an int or a function
    of the inner step count).

    ``should_skip_update_fn(updates, gradient_step, params) -> (skip, _)``: where ``skip``
    (a 0-d bool tensor) holds, the call changes nothing (optax's predicate; e.g. a
    non-finite gradient). The counters are read on the host from a mirror (no device read
    after ``init``); with ``should_skip_update_fn`` they are decided on the device and read
    each step.

    A ``None`` gradient leaf leaves that leaf's accumulator and inner state as they are
    (its update is ``None``), also on the k-th call.

    ``skip_zeros`` (SPEC §3, on the raw gradient of each call): where a micro-gradient is
    exactly zero the element's accumulator is kept bit-identical (a skipped micro-step does
    not count in its mean), and on the k-th call the element's update is zero and its
    accumulator and inner state are kept, so its accumulated gradient carries over to the
    next window.
    """

    mask_aware = True
    unfused_reason = ("MultiSteps runs eagerly: it accumulates gradients and calls the inner "
                      "transform (whose update fuses) every k micro-steps")

    def __init__(self, opt: GradientTransformation, every_k_schedule: int | Callable[[Any], int],
                 use_grad_mean: bool = True,
                 should_skip_update_fn: Callable | None = None):
        check_transform(opt, "MultiSteps opt")
        if not callable(every_k_schedule):
            check_int("MultiSteps", "every_k_schedule", every_k_schedule, minimum=1)
        self.inner = opt
        self.every_k_schedule = every_k_schedule
        self.use_grad_mean = bool(use_grad_mean)
        self.should_skip_update_fn = should_skip_update_fn
        register_owner(self)

    @property
    def transforms(self) -> tuple[GradientTransformation, ...]:
        return (self.inner,)

    def rebuild(self, transforms: Sequence[GradientTransformation]) -> GradientTransformation:
        return MultiSteps(transforms[0], self.every_k_schedule, self.use_grad_mean,
                          self.should_skip_update_fn).gradient_transformation()

    def gradient_transformation(self) -> GradientTransformation:
        """This object as a ``GradientTransformation``."""
        return GradientTransformation(self.init, self.update)

    def _k(self, gradient_step: int) -> int:
        k = self.every_k_schedule
        return int(k(gradient_step)) if callable(k) else k

    def init(self, params) -> MultiStepsState:
        paths, flat, _ = checked_params(params)
        inner_state = self.inner.init(params)
        device = tree_lib.state_device(tree_lib.leaves(params))
        acc = tree_lib.map(lambda p: torch.zeros_like(p, dtype=torch.promote_types(
            p.dtype, torch.float32)), params)
        return MultiStepsState(new_count(0, device), new_count(0, device), inner_state, acc)

    def has_updated(self, state: MultiStepsState) -> torch.Tensor:
        """Whether the last call ran the inner step (a 0-d bool tensor, as optax)."""
        return (state.mini_step == 0) & (state.gradient_step > 0)

    def _flatten(self, updates, state: MultiStepsState, params):
        """Grads, accumulators, params and zero mask as flat lists over the params' tree
        (the accumulators' without params), checked leaf by leaf before anything is
        computed: errors name the leaf's path."""
        ref, against = (params, "params") if params is not None else (state.acc_grads,
                                                                      "state acc_grads")
        paths, ref_flat, spec = tree_lib.flatten_with_paths(ref)
        grads = tree_lib.flatten_like(spec, updates, "grads", paths, against)
        acc = tree_lib.flatten_like(spec, state.acc_grads, "state acc_grads", paths, against)
        for path, g, a, r in zip(paths, grads, acc, ref_flat):
            if not isinstance(a, torch.Tensor):
                raise TypeError(f"state acc_grads at {path}: expected a tensor, got "
                                f"{type(a).__name__}")
            check_layout("state acc_grads", path, a)
            if not a.is_floating_point():
                raise TypeError(f"state acc_grads at {path}: expected a floating-point "
                                f"tensor, got {a.dtype}")
            if params is not None:
                check_param(path, r)
                if a.shape != r.shape:
                    raise ValueError(f"state acc_grads at {path}: shape {tuple(a.shape)} "
                                     f"does not match the param's shape: expected "
                                     f"{tuple(r.shape)}")
            if g is not None:
                check_leaf(path, g, r if params is not None else a)
        return spec, paths, grads, acc

    def update(self, updates, state, params=None, **extra):
        """One micro-step (see the class docstring)."""
        if not isinstance(state, MultiStepsState):
            raise ValueError(f"MultiSteps expects a MultiStepsState, got "
                             f"{type(state).__name__} (a state made by another transform?)")
        spec, paths, grads, acc = self._flatten(updates, state, params)
        zero = extra.get("zero_mask")
        zero_flat = (tree_lib.flatten_like(spec, zero, "zero_mask", paths)
                     if zero is not None else [None] * len(grads))
        mini, step = _read(state.mini_step), _read(state.gradient_step)
        n = mini + 1

        def accumulate(a, g, z):
            if g is None:  # no gradient: the accumulator is kept as it is
                return a
            new = a + (g.to(a.dtype) - a) / n if self.use_grad_mean else a + g.to(a.dtype)
            return new if z is None else torch.where(z, a, new)

        new_acc = [accumulate(a, g, z) for a, g, z in zip(acc, grads, zero_flat)]
        device = state.mini_step.device
        if n < self._k(step):
            out = tree_lib.unflatten(spec, [None if g is None else torch.full_like(
                g, -0.0, dtype=torch.promote_types(g.dtype, torch.float32)) for g in grads])
            new = MultiStepsState(new_count(n, device), state.gradient_step,
                                  state.inner_opt_state, tree_lib.unflatten(spec, new_acc))
        else:
            inner_in = tree_lib.unflatten(spec, [None if g is None else a
                                                 for a, g in zip(new_acc, grads)])
            out, inner_state = self.inner.update(inner_in, state.inner_opt_state, params,
                                                 **extra)
            # Reset, except where nothing entered (None) or the element was skipped.
            reset = [a if g is None else (torch.zeros_like(a) if z is None
                                          else torch.where(z, a, torch.zeros_like(a)))
                     for a, g, z in zip(new_acc, grads, zero_flat)]
            new = MultiStepsState(new_count(0, device), new_count(step + 1, device),
                                  inner_state,
                                  tree_lib.unflatten(spec, reset))
        if self.should_skip_update_fn is not None:
            skip, _ = self.should_skip_update_fn(updates, state.gradient_step, params)
            skip = torch.as_tensor(skip, device=device)
            out = tree_lib.map(lambda u: torch.where(skip, torch.full_like(u, -0.0), u), out)
            new = tree_lib.map(lambda n_, o: _keep(skip, n_, o), new, state)
        return out, new


def _keep(skip: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    out = torch.where(skip.to(new.device), old, new)
    if out.ndim == 0 and not out.is_floating_point():
        mark_device_decided(out)  # a counter chosen on the device: never read on the host
    return out
