"""``sam`` (optax.contrib): Sharpness-Aware Minimization (Foret et al., 2021) as a wrapper
of two optimizers, an adversarial one that climbs and an outer one that descends.

Eager torch ops around the two inner optimizers (each runs as it would alone: a fused
chain's update fuses). The counter that picks the adversarial or the outer step is read
from the host mirror of step counts (no device read); a counter the host does not know (a
state loaded from a checkpoint) is decided on the device instead (see :func:`sam`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ftopt import tree as tree_lib
from ftopt._counts import host_count, mark_device_decided, remember_count
from ftopt.base import GradientTransformation, check_transform, register_owner, register_state
from ftopt.domains import check_int
from ftopt.finite import where_leaf
from ftopt.program import skip_updates
from ftopt.rules import checked_params
from ftopt.update import apply_updates
from ftopt.validate import check_leaf

__all__ = ["SAMState", "sam"]


@register_state
class SAMState(NamedTuple):
    """The state of :func:`sam` (optax.contrib's ``SAMState`` layout).

    Attributes:
        steps_since_sync: adversarial steps since the last outer step (0-d int32).
        opt_state: the outer optimizer's state.
        adv_state: the adversarial optimizer's state.
        cache: the outer params at the start of the current cycle (a copy of the params
            tree); ``None`` in opaque mode.
    """

    steps_since_sync: torch.Tensor
    opt_state: Any
    adv_state: Any
    cache: Any


def _negated(u: Any) -> Any:
    """``-u``, every zero written ``-0.0`` (``p + (-0.0)`` keeps every param's bits)."""
    if not isinstance(u, torch.Tensor):
        return u
    return torch.where(u == 0, torch.full((), -0.0, dtype=u.dtype, device=u.device), -u)


def _to_cache(c: torch.Tensor, p: torch.Tensor, u: Any) -> Any:
    """The outer update c − p + u in fp32 (or wider); exactly ``u`` where c == p (the
    element was not moved by the cycle's adversarial steps: a zero ``u`` keeps its sign)."""
    if u is None:
        return None
    wide = torch.promote_types(torch.promote_types(p.dtype, u.dtype), torch.float32)
    c, p, u = c.to(wide), p.to(wide), u.to(wide)
    return torch.where(c == p, u, c - p + u)


def _select(flag: torch.Tensor, new: Any, old: Any) -> Any:
    """``new`` where the 0-d ``flag`` holds, else ``old``, leaf by leaf (two trees of one
    structure; ``None`` leaves stay ``None``)."""
    return tree_lib.map(lambda n, o: where_leaf(flag, n, o), new, old)


class Sam:
    """The object behind :func:`sam` (see there)."""

    # The chain's skip_zeros mask is handled here (passed to both inner optimizers): the
    # chain must not zero the outer step, which returns perturbed elements to the cache.
    mask_aware = True
    unfused_reason = ("sam runs eagerly: it alternates two inner optimizers on a step "
                      "counter and returns the params to a cached copy")

    def __init__(self, optimizer: GradientTransformation, adv_optimizer: GradientTransformation,
                 sync_period: int, reset_state: bool, opaque_mode: bool,
                 batch_axis_name: str | None):
        check_transform(optimizer, "sam: argument optimizer")
        check_transform(adv_optimizer, "sam: argument adv_optimizer")
        self.opt, self.adv = optimizer, adv_optimizer
        self.period = check_int("sam", "sync_period", sync_period, minimum=1)
        for name, value in (("reset_state", reset_state), ("opaque_mode", opaque_mode)):
            if not isinstance(value, bool):
                raise TypeError(f"sam: {name} must be a bool, got {type(value).__name__}")
        if batch_axis_name is not None:
            raise ValueError(f"sam: batch_axis_name must be None, got {batch_axis_name!r} "
                             "(a JAX pmap axis has no torch counterpart: average the "
                             "gradients that grad_fn returns across ranks instead, as "
                             "DistributedDataParallel does)")
        self.reset, self.opaque = reset_state, opaque_mode
        self.update_keywords = ("grad_fn",) if opaque_mode else ()
        register_owner(self)

    def init(self, params) -> SAMState:
        paths, flat, _ = checked_params(params)
        since = torch.zeros((), dtype=torch.int32, device=tree_lib.state_device(flat))
        remember_count(since, 0)
        cache = None if self.opaque else tree_lib.map(torch.clone, params)
        return SAMState(since, self.opt.init(params), self.adv.init(params), cache)

    def update(self, updates, state, params=None, *,
               grad_fn: Callable[[Any, int], Any] | None = None, **extra):
        if params is None:
            raise ValueError("sam needs params: call update(grads, state, params)")
        if not isinstance(state, SAMState):
            raise TypeError(f"sam expects a SAMState, got {type(state).__name__} (a state "
                            "made by another transform?)")
        paths, p_flat, spec = tree_lib.flatten_with_paths(params)
        u_flat = tree_lib.flatten_like(spec, updates, "updates", paths)
        for path, u, p in zip(paths, u_flat, p_flat):
            if u is not None:
                check_leaf(path, u, p)
        if self.opaque:
            return self._opaque(updates, state, params, grad_fn, extra, spec, paths)
        if state.cache is None:
            raise ValueError("sam: state.cache is None (a state of sam(opaque_mode=True)); "
                             "this sam has opaque_mode=False")
        c_flat = tree_lib.flatten_like(spec, state.cache, "state cache", paths)
        for path, c, p in zip(paths, c_flat, p_flat):
            if not isinstance(c, torch.Tensor) or c.shape != p.shape:
                raise ValueError(f"state cache at {path}: expected a tensor of shape "
                                 f"{tuple(p.shape)}, got "
                                 f"{getattr(c, 'shape', type(c).__name__)}")
        since = host_count(state.steps_since_sync)
        if since is None:
            return self._on_device(updates, state, params, extra, spec, paths)
        if since == 0:  # the cycle starts here: its outer params are these
            cache = tree_lib.map(torch.clone, params)
        else:
            cache = state.cache
        if since == self.period - 1:
            out, opt_state = self._outer(updates, state, params, cache, extra, spec, paths)
            adv_state = self.adv.init(params) if self.reset else state.adv_state
        else:
            out, adv_state = self._adversarial(updates, state, params, extra)
            opt_state = state.opt_state
        new_since = torch.full_like(state.steps_since_sync, (since + 1) % self.period)
        remember_count(new_since, (since + 1) % self.period)
        return out, SAMState(new_since, opt_state, adv_state, cache)

    def _masked(self, updates, extra: dict):
        zero = extra.get("zero_mask")
        return updates if zero is None else skip_updates(updates, zero)

    def _adversarial(self, updates, state, params, extra: dict):
        """One adversarial step: the adversarial optimizer's update, negated (it climbs)."""
        u, adv_state = self.adv.update(updates, state.adv_state, params, **extra)
        return tree_lib.map(_negated, self._masked(u, extra)), adv_state

    def _outer(self, updates, state, params, cache, extra: dict, spec, paths):
        """The outer step: back to the cycle's params, plus the outer optimizer's update
        of the gradient at the adversarial point (computed with the cached params)."""
        u, opt_state = self.opt.update(updates, state.opt_state, cache, **extra)
        u_flat = tree_lib.flatten_like(spec, self._masked(u, extra), "sam optimizer's update",
                                     paths)
        out = [_to_cache(c, p, v) for c, p, v in zip(
            spec.flatten_up_to(cache), spec.flatten_up_to(params), u_flat)]
        return tree_lib.unflatten(spec, out), opt_state

    def _on_device(self, updates, state, params, extra: dict, spec, paths):
        """Both steps, selected by the counter on its device (no host read): a counter the
        host mirror does not know (a loaded checkpoint's)."""
        since = state.steps_since_sync
        first, last = since == 0, since == self.period - 1
        cache = _select(first, params, state.cache)
        adv_out, adv_state = self._adversarial(updates, state, params, extra)
        opt_out, opt_state = self._outer(updates, state, params, cache, extra, spec, paths)
        out = _select(last, opt_out, adv_out)
        kept = self.adv.init(params) if self.reset else state.adv_state
        adv_state = _select(last, kept, adv_state)
        opt_state = _select(last, opt_state, state.opt_state)
        new_since = torch.remainder(since + 1, self.period).to(since.dtype)
        mark_device_decided(new_since)
        return out, SAMState(new_since, opt_state, adv_state, cache)

    def _opaque(self, updates, state, params, grad_fn, extra: dict, spec, paths):
        """sync_period − 1 adversarial steps inside this call (grad_fn gives the gradient
        at each adversarial point), then the outer step from the given params."""
        if grad_fn is None:
            raise ValueError("sam(opaque_mode=True): update needs grad_fn= (a function of "
                             "(params, i) returning the gradients at params): "
                             "tx.update(grads, state, params, grad_fn=grad_fn)")
        if not callable(grad_fn):
            raise TypeError(f"sam: grad_fn must be a function of (params, i), got "
                            f"{type(grad_fn).__name__}")
        adv_params, adv_grads, adv_state = params, updates, state.adv_state
        for i in range(self.period - 1):
            u, adv_state = self.adv.update(adv_grads, adv_state, adv_params, **extra)
            adv_params = apply_updates(adv_params, tree_lib.map(_negated,
                                                                self._masked(u, extra)))
            adv_grads = grad_fn(adv_params, i)
            tree_lib.flatten_like(spec, adv_grads, f"grad_fn's gradients (call {i})", paths)
        if self.reset:
            adv_state = self.adv.init(params)
        out, opt_state = self.opt.update(adv_grads, state.opt_state, params, **extra)
        since = torch.zeros_like(state.steps_since_sync)
        remember_count(since, 0)
        return self._masked(out, extra), SAMState(since, opt_state, adv_state, None)


def sam(
    optimizer: GradientTransformation,
    adv_optimizer: GradientTransformation,
    sync_period: int = 2,
    reset_state: bool = True,
    opaque_mode: bool = False,
    batch_axis_name: str | None = None,
) -> GradientTransformation:
    """SAM, Sharpness-Aware Minimization (Foret et al., 2021), as optax.contrib's ``sam``.

    Each cycle of ``sync_period`` calls takes ``sync_period − 1`` adversarial steps with
    ``adv_optimizer`` (its update negated: p ← p − u_adv climbs the loss), then one outer
    step: with c the params at the cycle's start (``state.cache``), p the current
    (adversarial) params and u = ``optimizer``'s update of the gradient at p (its params
    argument: c), the update is c − p + u, so p ← c + u. With ``reset_state`` the
    adversarial optimizer's state is re-initialised at every outer step; otherwise it
    keeps its state from before the outer call. The paper's SAM::

        sam(ftopt.sgd(lr), ftopt.chain(ftopt.normalize_by_update_norm(eps=0.0),
                                       ftopt.sgd(rho)), sync_period=2)

    (``normalize_by_update_norm(eps=0.0)`` is optax.contrib's ``normalize()``: u/‖u‖.)

    Default (transparent) mode: every call is one step and the caller computes the next
    gradient at the returned params (adversarial points included). ``opaque_mode=True``
    runs the cycle inside one call: ``tx.update(grads, state, params, grad_fn=grad_fn)``
    with ``grad_fn(params, i)`` returning the gradients at ``params`` (called
    ``sync_period − 1`` times, ``i`` = 0, 1, …), and returns the outer update (use it
    where each call has side effects, e.g. BatchNorm statistics).

    The counter: while the host knows its value (every state this process made; no device
    read) only the chosen step runs. A counter it does not know (a state loaded from a
    checkpoint) is decided on the device: both inner optimizers run on every call and
    their results are selected with ``torch.where`` (bit-identical to the chosen step, at
    the cost of computing both).

    ``skip_zeros``: in ``chain(sam(...), ftopt.skip_zeros())`` the raw gradient's mask is
    passed to both inner optimizers (their states keep their bits where it is zero) and an
    adversarial step leaves those elements as they are (update ``-0.0``). The outer step's
    update is the inner optimizer's (``-0.0`` there) where the cycle's adversarial steps did
    not move the element (c == p), so an element whose gradient is zero on every call of a
    cycle keeps its bits (param and states); an element moved by an adversarial call returns
    to c even if its gradient at the outer call is zero (SAM's outer step is relative to c:
    leaving it would keep the perturbation). Inner optimizers built with ``skip_zeros=True``
    give the same guarantee for the gradients they are handed. In opaque mode the mask of
    the gradient passed to ``update`` is given to every inner call (params and states keep
    their bits where it is zero, SPEC §3 exactly).

    Differences from optax: ``batch_axis_name`` (a JAX pmap axis) must be ``None`` (reduce
    the gradients across ranks in ``grad_fn``). With ``sync_period=1`` optax reads the
    cache before refreshing it, so its outer step goes back to the previous call's params;
    here the refreshed cache is read and ``sync_period=1`` is the outer optimizer itself
    (for ``sync_period >= 2`` the two agree). Zeros of the adversarial update are written
    ``-0.0``.

    Args:
        optimizer: the outer optimizer.
        adv_optimizer: the adversarial optimizer (its update is negated).
        sync_period: calls per cycle, an int >= 1 (default 2: one adversarial step).
        reset_state: re-initialise ``adv_optimizer``'s state at each outer step.
        opaque_mode: run the adversarial steps inside ``update`` (needs ``grad_fn=``).
        batch_axis_name: ``None`` only (see above).
    """
    obj = Sam(optimizer, adv_optimizer, sync_period, reset_state, opaque_mode,
              batch_axis_name)
    return GradientTransformation(obj.init, obj.update)
