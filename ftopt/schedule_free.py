"""Schedule-Free learning (optax.contrib): ``schedule_free``, ``schedule_free_sgd``,
``schedule_free_adamw`` and ``schedule_free_eval_params``.

The base optimizer's updates step a sequence z; the params are the interpolation
y = b1·x + (1−b1)·z of z and its weighted average x, so x (where evaluations should be
made) is recomputed from y and z and never stored. ``schedule_free(base, ...)`` is
``chain(base, <the Schedule-Free stage>)``: the stage is an elementwise rule (z ← z + u and
the new y) with z a slot that starts as a copy of the params, so a fusible base runs with
it in one kernel. Its averaging weight c = w/Σw depends on the whole history of learning
rates: Σw and the largest learning rate so far are running scalars of its state (0-d fp32
tensors next to the step count, :attr:`ftopt.rules.Rule.running`), moved once per step with
torch ops on their device, the same function on every backend.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from ftopt import tree as tree_lib
from ftopt.alias import check_state_options, finish
from ftopt.base import GradientTransformation, register_state
from ftopt.combine import chain
from ftopt.domains import Interval
from ftopt.quantize import check_state_dtype
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule, Slot
from ftopt.schedules import ScalarOrSchedule, warmup_constant_schedule
from ftopt.transforms import add_decayed_weights, scale_by_adam, scale_by_learning_rate

__all__ = ["ScheduleFreeState", "schedule_free", "schedule_free_sgd", "schedule_free_adamw",
           "schedule_free_eval_params"]

Float = float | torch.Tensor

_B1 = Interval(0.0, 1.0, lo_open=True)  # (0, 1]: x = (y − (1−b1)·z)/b1


@register_state
class ScheduleFreeState(NamedTuple):
    """The state of the Schedule-Free stage (optax's fields, the base optimizer's state
    beside it in the chain's tuple).

    Attributes:
        count: steps taken (0-d int32; optax's ``step_count`` is ``count + 1``).
        b1: the interpolation weight (0-d fp32), read by :func:`schedule_free_eval_params`.
        weight_sum: Σ of the averaging weights ``max_lr ** weight_lr_power`` (0-d fp32).
        max_lr: the largest learning rate so far (0-d fp32).
        z: the z sequence: a copy of the params at ``init``, then z ← z + u each step.
    """

    count: torch.Tensor
    b1: torch.Tensor
    weight_sum: torch.Tensor
    max_lr: torch.Tensor
    z: Any


def _advance(t, h: dict, old: dict) -> tuple[dict, dict]:
    """optax's averaging weight, on 0-d tensors: max_lr ← max(max_lr, lr(t));
    w = max_lr**power; Σw ← Σw + w; c = w/Σw (0 where 0/0, NaN kept)."""
    lr = h["learning_rate"]
    max_lr = old["max_lr"]
    if isinstance(lr, torch.Tensor):
        max_lr = torch.maximum(max_lr, lr.to(device=max_lr.device, dtype=max_lr.dtype))
    else:
        max_lr = torch.clamp(max_lr, min=float(lr))
    weight = max_lr ** h["weight_lr_power"]
    weight_sum = old["weight_sum"] + weight
    ratio = torch.nan_to_num(weight / weight_sum, nan=0.0, posinf=math.inf)
    # (weight, weight_sum are in [0, inf] or NaN: their sum is NaN where either is.)
    ck = torch.where((weight + weight_sum).isnan(), math.nan, ratio)
    b1 = old["b1"]
    # keep = c·b1 + 1 − b1: the weight of the base update in the update of y (see _body).
    scalars = {"ck": ck, "keep": ck * b1 + (1 - b1)}
    # b1 never changes: the new state holds the same tensor (no copy; a donated step's
    # write-back of it is a copy onto itself, which torch skips).
    return scalars, {"b1": b1, "weight_sum": weight_sum, "max_lr": max_lr}


def _body(o, x):
    # optax: x = (y − (1−b1)·z)/b1; z' = z + u; x' = (1−c)·x + c·z'; y' = b1·x' + (1−b1)·z';
    # u = y' − y. The same value is (c·b1 + 1 − b1)·u − c·(y − z): written so it loses no
    # digits to differences of param-sized values (y' − y).
    return x.keep * x.u - x.ck * (x.p - x.z), {"z": x.z + x.u}


def _stage(learning_rate: ScalarOrSchedule, b1: float, weight_lr_power: Float,
           state_dtype: torch.dtype | None) -> GradientTransformation:
    rule = Rule(
        "schedule_free",
        _body,
        state_class=ScheduleFreeState,
        slots=(Slot("z", from_params=True, dtype=state_dtype),),
        hparams={"learning_rate": learning_rate, "b1": b1, "weight_lr_power": weight_lr_power},
        domains={"b1": _B1},
        counted=True,
        uses_params=True,
        schedule_at_t=True,  # optax reads the schedule at its step_count, count + 1
        running={"b1": "b1", "weight_sum": 0.0, "max_lr": 0.0},
        advance=_advance,
    )
    return rule_transform(rule)


def _check_b1(where: str, b1: Any) -> float:
    if isinstance(b1, bool) or not isinstance(b1, (int, float)):
        raise TypeError(f"{where}: b1 must be a float in (0, 1], got {type(b1).__name__} "
                        f"{b1!r}")
    return float(b1)


def schedule_free(
    base_optimizer: GradientTransformation,
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    weight_lr_power: Float = 2.0,
    state_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Schedule-Free learning around ``base_optimizer`` (as optax.contrib.schedule_free):
    ``chain(base_optimizer, <Schedule-Free stage>)``.

    With u the base optimizer's update (switch its momentum off: ``b1=0`` for Adam), y the
    params and t the step (1 first)::

        max_lr ← max(max_lr, learning_rate(t)); w = max_lr**weight_lr_power;
        Σw ← Σw + w; c = w/Σw (0 where 0/0);
        z' = z + u; x = (y − (1−b1)·z)/b1; x' = (1−c)·x + c·z'; u ← b1·x' + (1−b1)·z' − y

    computed as u ← (c·b1 + 1 − b1)·u − c·(y − z). Evaluate the model at x:
    :func:`schedule_free_eval_params`. z starts as a copy of the params; 8-bit and 16-bit
    state formats (``quantize_states``) store the base optimizer's states, never z (a
    rounded z would move y) unless ``state_dtype`` asks for it. Σw, max_lr and b1 are 0-d
    fp32 tensors of the state, moved on the params' device without a host read.

    Args:
        base_optimizer: the transform whose updates step z (e.g. ``ftopt.sgd(lr)``).
        learning_rate: the base optimizer's learning rate (a float, 0-d tensor or schedule
            of the step), read for the averaging weights.
        b1: the interpolation weight, in (0, 1] (default: 0.9).
        weight_lr_power: the power of max_lr in the averaging weights (default: 2.0).
        state_dtype: the storage dtype of z (default: ``None``, the params' compute dtype;
            else torch.float32, torch.bfloat16 or torch.float16).
    """
    return chain(*_parts("schedule_free", base_optimizer, learning_rate, b1, weight_lr_power,
                         state_dtype))


def _nearest_only(where: str, state_rounding: str) -> None:
    """Schedule-Free rounds its states to nearest: z (a copy of the params) is stored in
    ``state_dtype`` by the stage itself, not by :func:`ftopt.quantize_states`."""
    if state_rounding != "nearest":
        raise ValueError(f"{where}: state_rounding must be 'nearest' (Schedule-Free's "
                         f"states are not rounded stochastically), got {state_rounding!r}")


def _parts(where: str, base_optimizer: GradientTransformation, learning_rate, b1,
           weight_lr_power, state_dtype) -> list[GradientTransformation]:
    b1 = _check_b1(where, b1)
    state_dtype = check_state_dtype(where, state_dtype)
    return [base_optimizer, _stage(learning_rate, b1, weight_lr_power, state_dtype)]


def _warmup(where: str, learning_rate: Any, warmup_steps: int | None) -> ScalarOrSchedule:
    if warmup_steps is None:
        return learning_rate
    if callable(learning_rate) or isinstance(learning_rate, torch.Tensor):
        raise TypeError(f"{where}: warmup_steps needs a float learning_rate (the warmup's "
                        f"peak), got {type(learning_rate).__name__}")
    return warmup_constant_schedule(0.0, learning_rate, warmup_steps)


def schedule_free_sgd(
    learning_rate: ScalarOrSchedule = 1.0,
    warmup_steps: int | None = None,
    b1: float = 0.9,
    weight_decay: Float | None = None,
    weight_lr_power: Float = 2.0,
    state_dtype: torch.dtype | None = None,
    *,
    skip_zeros: bool = False,
    state_bits: int = 32,
    state_rounding: str = "nearest",
) -> GradientTransformation:
    """Schedule-Free SGD (as optax.contrib): ``schedule_free(chain(add_decayed_weights(wd),
    scale_by_learning_rate(lr)), lr, b1, weight_lr_power)``, the decay only where
    ``weight_decay`` is not ``None``. ``warmup_steps``: lr becomes
    ``warmup_constant_schedule(0, lr, warmup_steps)``. ``state_dtype``: the storage of z
    (as optax) and of the base states. Evaluate at :func:`schedule_free_eval_params`."""
    check_state_options("schedule_free_sgd", state_bits, state_dtype, state_rounding)
    _nearest_only("schedule_free_sgd", state_rounding)
    lr = _warmup("schedule_free_sgd", learning_rate, warmup_steps)
    parts = [] if weight_decay is None else [add_decayed_weights(weight_decay)]
    base = chain(*parts, scale_by_learning_rate(lr))
    return finish(_parts("schedule_free_sgd", base, lr, b1, weight_lr_power, state_dtype),
                  skip_zeros, state_bits, state_dtype)


def schedule_free_adamw(
    learning_rate: ScalarOrSchedule = 0.0025,
    warmup_steps: int | None = None,
    b1: float = 0.9,
    b2: Float = 0.999,
    eps: Float = 1e-8,
    weight_decay: Float = 0.0,
    weight_lr_power: Float = 2.0,
    state_dtype: torch.dtype | None = None,
    *,
    skip_zeros: bool = False,
    state_bits: int = 32,
    state_rounding: str = "nearest",
) -> GradientTransformation:
    """Schedule-Free AdamW (as optax.contrib): ``schedule_free(chain(scale_by_adam(0, b2,
    eps), add_decayed_weights(wd), scale_by_learning_rate(lr)), lr, b1, weight_lr_power)``.

    The base is Adam without momentum, u/(√(nu/(1−b2ᵗ)) + eps) (optax writes it as
    ``scale_by_rms(b2, eps, eps_in_sqrt=False, bias_correction=True)``); its first moment,
    always the gradient, is Adam's ``mu`` slot. ``warmup_steps``: lr becomes
    ``warmup_constant_schedule(0, lr, warmup_steps)``. ``state_dtype``: the storage of z
    (as optax) and of the base states."""
    check_state_options("schedule_free_adamw", state_bits, state_dtype, state_rounding)
    _nearest_only("schedule_free_adamw", state_rounding)
    lr = _warmup("schedule_free_adamw", learning_rate, warmup_steps)
    base = chain(scale_by_adam(0.0, b2, eps), add_decayed_weights(weight_decay),
                 scale_by_learning_rate(lr))
    return finish(_parts("schedule_free_adamw", base, lr, b1, weight_lr_power, state_dtype),
                  skip_zeros, state_bits, state_dtype)


def _find_state(state: Any) -> ScheduleFreeState:
    found = []

    def walk(x):
        if isinstance(x, ScheduleFreeState):
            found.append(x)
        elif isinstance(x, (tuple, list)):
            for item in x:
                walk(item)
        elif isinstance(x, dict):
            for item in x.values():
                walk(item)

    walk(state)
    if len(found) != 1:
        what = "none" if not found else f"{len(found)}"
        raise ValueError(f"schedule_free_eval_params needs the state of a schedule_free "
                         f"transform (one ScheduleFreeState in it), found {what} in a "
                         f"{type(state).__name__}")
    return found[0]


def schedule_free_eval_params(state: Any, params: Any) -> Any:
    """The params to evaluate a Schedule-Free model at (as optax.contrib):
    x = (y − (1−b1)·z)/b1, computed as y + (1−b1)/b1·(y − z) in the compute dtype and
    rounded to each param's dtype.

    Args:
        state: the state of :func:`schedule_free` or of an alias (a chain's state that
            holds one :class:`ScheduleFreeState`).
        params: the params y the state was stepped with.
    """
    sf = _find_state(state)
    paths, flat, spec = tree_lib.flatten_with_paths(params)
    z_flat = tree_lib.flatten_like(spec, sf.z, "state z", paths)
    out = []
    for path, y, z in zip(paths, flat, z_flat):
        if not isinstance(y, torch.Tensor) or not isinstance(z, torch.Tensor) \
                or y.shape != z.shape:
            raise ValueError(f"params at {path}: expected a tensor shaped like state z "
                             f"{tuple(getattr(z, 'shape', ()))}, got "
                             f"{getattr(y, 'shape', type(y).__name__)}")
        wide = torch.promote_types(torch.promote_types(y.dtype, z.dtype), torch.float32)
        b1 = sf.b1.to(device=y.device, dtype=wide)
        yw = y.to(wide)
        out.append((yw + (1 - b1) / b1 * (yw - z.to(wide))).to(y.dtype))
    return tree_lib.unflatten(spec, out)
