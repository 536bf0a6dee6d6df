"""``lookahead``: k fast steps forward, one step back (optax's wrapper and layout).

The params are a :class:`LookaheadParams` pair (fast and slow weights); the gradients are
those of the fast weights only, so the params tree is not the gradients' tree. As in optax,
call ``tx.update(grads, state, params)`` with the pair and apply the returned pair of
updates with :func:`ftopt.apply_updates`; ``ftopt.step`` does the same (eagerly).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ftopt import tree as tree_lib
from ftopt._counts import host_count, remember_count
from ftopt.base import GradientTransformation, check_transform, register_owner, register_state
from ftopt.domains import check_int
from ftopt.rules import check_param

__all__ = ["LookaheadParams", "LookaheadState", "lookahead"]


@register_state
class LookaheadParams(NamedTuple):
    """The fast and the slow weights (two trees of one structure)."""

    fast: Any
    slow: Any

    @classmethod
    def init_synced(cls, params: Any) -> LookaheadParams:
        """Fast and slow weights that start equal (the same tensors: ftopt is pure)."""
        return cls(fast=params, slow=params)


@register_state
class LookaheadState(NamedTuple):
    """The state of :func:`lookahead`.

    Attributes:
        fast_state: the fast optimizer's state.
        steps_since_sync: fast steps since the last synchronisation (0-d int32).
    """

    fast_state: Any
    steps_since_sync: torch.Tensor


def _check_pair(params: Any, what: str) -> None:
    if not isinstance(params, LookaheadParams):
        raise ValueError(f"lookahead {what}: params must be a LookaheadParams(fast, slow) "
                         f"pair (LookaheadParams.init_synced(params) makes one), got "
                         f"{type(params).__name__}")
    paths, flat, spec = tree_lib.flatten_with_paths(params.fast)
    slow = tree_lib.flatten_like(spec, params.slow, "params.slow", paths, against="params.fast")
    for path, f, s in zip(paths, flat, slow):
        check_param(f"params.fast{path}", f)
        check_param(f"params.slow{path}", s)
        if f.shape != s.shape:
            raise ValueError(f"params.slow at {path}: shape {tuple(s.shape)} does not match "
                             f"the fast param's: expected {tuple(f.shape)}")


class Lookahead:
    """The object behind :func:`lookahead` (see there)."""

    unfused_reason = ("lookahead runs eagerly: its params are a (fast, slow) pair; the fast "
                      "optimizer's update fuses")

    def __init__(self, fast: GradientTransformation, sync_period: int,
                 slow_step_size: float, reset_state: bool):
        check_transform(fast, "lookahead fast_optimizer")
        self.fast = fast
        self.sync_period = check_int("lookahead", "sync_period", sync_period, minimum=1)
        if isinstance(slow_step_size, bool) or not isinstance(slow_step_size, (int, float)) \
                or not 0.0 <= slow_step_size <= 1.0:
            raise ValueError(f"lookahead: slow_step_size must be a float in [0, 1], got "
                             f"{slow_step_size!r}")
        self.alpha = float(slow_step_size)
        self.reset_state = bool(reset_state)
        register_owner(self)

    def init(self, params: LookaheadParams) -> LookaheadState:
        _check_pair(params, "init")
        leaves = tree_lib.leaves(params.fast)
        device = leaves[0].device if leaves else None
        since = torch.zeros((), dtype=torch.int32, device=device)
        remember_count(since, 0)
        return LookaheadState(self.fast.init(params.fast), since)

    def update(self, updates, state, params=None, **extra):
        if params is None:
            raise ValueError("lookahead needs params: call update(grads, state, "
                             "LookaheadParams(fast, slow))")
        if not isinstance(state, LookaheadState):
            raise ValueError(f"lookahead expects a LookaheadState, got "
                             f"{type(state).__name__} (a state made by another transform?)")
        _check_pair(params, "update")
        fast_updates, fast_state = self.fast.update(updates, state.fast_state, params.fast,
                                                    **extra)
        known = host_count(state.steps_since_sync)
        since = int(state.steps_since_sync) if known is None else known
        sync = since == self.sync_period - 1
        if sync:
            out = self._synchronise(fast_updates, params)
            if self.reset_state:
                fast_state = self.fast.init(params.fast)
        else:  # the slow weights stay as they are: -0.0 keeps every one bit-identical
            out = LookaheadParams(fast_updates, tree_lib.map(
                lambda u: torch.full_like(u, -0.0), fast_updates))
        new_since = torch.full_like(state.steps_since_sync, (since + 1) % self.sync_period)
        remember_count(new_since, (since + 1) % self.sync_period)
        return out, LookaheadState(fast_state, new_since)

    def _synchronise(self, fast_updates, params: LookaheadParams) -> LookaheadParams:
        """d = fast + u − slow; slow ← slow + α·d; fast ← fast + u − (1 − α)·d (= the new
        slow weights, up to rounding), in fp32 (or wider)."""
        alpha = self.alpha
        paths, f_flat, spec = tree_lib.flatten_with_paths(params.fast)
        u_flat = tree_lib.flatten_like(spec, fast_updates, "updates", paths)
        s_flat = spec.flatten_up_to(params.slow)
        fast_out, slow_out = [], []
        for f, u, s in zip(f_flat, u_flat, s_flat):
            if u is None:  # no gradient: neither weight moves
                fast_out.append(None)
                slow_out.append(None)
                continue
            wide = torch.promote_types(torch.promote_types(f.dtype, u.dtype), torch.float32)
            d = f.to(wide) + u.to(wide) - s.to(wide)
            fast_out.append(u.to(wide) - (1.0 - alpha) * d)
            slow_out.append(alpha * d)
        return LookaheadParams(tree_lib.unflatten(spec, fast_out),
                               tree_lib.unflatten(spec, slow_out))


def lookahead(
    fast_optimizer: GradientTransformation,
    sync_period: int,
    slow_step_size: float,
    reset_state: bool = False,
) -> GradientTransformation:
    """Lookahead (Zhang et al., 2019), as optax: k fast steps forward, one step back.

    The fast weights follow ``fast_optimizer``. Every ``sync_period``-th step, after that
    step's fast update u: d = fast + u − slow, slow ← slow + α·d and fast ← slow (the new
    one), as one update of each: u_slow = α·d, u_fast = u − (1 − α)·d. On the other steps
    u_slow = 0 (``-0.0``: the slow weights stay bit-identical). With ``reset_state`` the
    fast optimizer's state is re-initialised at every synchronisation.

    Params are a :class:`LookaheadParams` pair, the gradients those of the fast weights:
    ``u, s = tx.update(grads, s, pair); pair = ftopt.apply_updates(pair, u)``. Evaluate
    the model at ``pair.slow`` for the smoothed weights. A ``None`` gradient leaf moves
    neither of its weights.

    Args:
        fast_optimizer: the inner optimizer (any ``GradientTransformation``).
        sync_period: fast steps between synchronisations, an int >= 1.
        slow_step_size: α, in [0, 1].
        reset_state: re-initialise the fast optimizer's state at each synchronisation
            (default: False).
    """
    obj = Lookahead(fast_optimizer, sync_period, slow_step_size, reset_state)
    return GradientTransformation(obj.init, obj.update)
