"""Optimizers as short chains of transforms (optax signatures and defaults).

Every alias takes keyword-only ``skip_zeros`` (see :func:`ftopt.skip_zeros`),
``state_bits`` (32, or 8 for 8-bit blockwise states, see :func:`quantize_states`) and
``state_dtype`` (``torch.bfloat16`` or ``torch.float16``: per-element float states that
are not 8-bit stored in 16 bits, math in fp32, one rounding per store; see
:func:`quantize_states`) and ``state_rounding`` (``"nearest"``, the default, or
``"stochastic"`` for bf16 states; see :mod:`ftopt.stochastic`).

Hyperparameters passed through to a transform are checked by it at construction (see
:mod:`ftopt.domains`); the alias checks its own: ``momentum`` (the decay of ``trace``,
>= 0, as torch.optim.SGD) and ``state_bits``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ftopt.base import GradientTransformation
from ftopt.combine import chain, masked
from ftopt.combine import skip_zeros as skip_zeros_marker
from ftopt.domains import NONNEG, check_hparam
from ftopt.quantize import check_state_dtype, quantize_states
from ftopt.schedules import ScalarOrSchedule
from ftopt.stochastic import check_state_rounding
from ftopt.transforms import (
    add_decayed_weights,
    scale_by_adam,
    scale_by_ademamix,
    scale_by_learning_rate,
    scale_by_lion,
    scale_by_rms,
    scale_by_rss,
    scale_by_stddev,
    scale_by_trust_ratio,
    trace,
)

__all__ = ["adagrad", "adam", "adamw", "ademamix", "lamb", "lars", "lion", "rmsprop", "sgd"]

Float = float | torch.Tensor


def _check_momentum(alias: str, momentum: Any) -> None:
    if momentum is not None:
        check_hparam(alias, "momentum (the decay of trace)", momentum, NONNEG)


def check_state_options(alias: str, state_bits: Any, state_dtype: Any = None,
                        state_rounding: Any = "nearest") -> None:
    """Raise unless ``state_bits`` (an alias' keyword) is 8 or 32, ``state_dtype`` is
    ``None`` or a storage dtype :func:`ftopt.quantize_states` takes and ``state_rounding``
    is ``"nearest"`` or ``"stochastic"`` (the latter with bf16 states only)."""
    if not isinstance(state_bits, int) or isinstance(state_bits, bool):
        raise TypeError(f"{alias}: state_bits must be 8 or 32, got "
                        f"{type(state_bits).__name__} {state_bits!r}")
    if state_bits not in (8, 32):
        raise ValueError(f"{alias}: state_bits must be 8 or 32, got {state_bits}")
    check_state_rounding(alias, state_rounding, check_state_dtype(alias, state_dtype),
                         state_bits)


def finish(parts: list, skip_zeros: bool, state_bits: int,
           state_dtype: torch.dtype | None = None,
           state_rounding: str = "nearest") -> GradientTransformation:
    """An alias' chain of ``parts``: skip-aware with ``skip_zeros``, 8-bit states with
    ``state_bits=8``, 16-bit state storage with ``state_dtype`` (rounded as
    ``state_rounding`` says)."""
    if skip_zeros:
        parts.append(skip_zeros_marker())
    tx = chain(*parts)
    if state_bits == 32 and state_dtype is None:
        return tx
    return quantize_states(tx, bits=state_bits, state_dtype=state_dtype,
                           state_rounding=state_rounding)


_KEYWORD = inspect.Parameter.KEYWORD_ONLY
# What every alias takes after its own arguments (annotations as strings, as the alias
# modules write theirs).
STATE_OPTIONS = (
    inspect.Parameter("skip_zeros", _KEYWORD, default=False, annotation="bool"),
    inspect.Parameter("state_bits", _KEYWORD, default=32, annotation="int"),
    inspect.Parameter("state_dtype", _KEYWORD, default=None, annotation="torch.dtype | None"),
    inspect.Parameter("state_rounding", _KEYWORD, default="nearest", annotation="str"),
)


def chain_alias(
    build: Callable[..., list[GradientTransformation]],
) -> Callable[..., GradientTransformation]:
    """Make ``build`` (an alias' own arguments -> the parts of its chain) the alias.

    The alias also takes the keyword-only ``skip_zeros``, ``state_bits`` and
    ``state_dtype``: they are checked before ``build`` runs (errors name the alias), and the
    parts become one chain through :func:`finish`. It keeps ``build``'s name and docstring;
    its signature (``inspect.signature``, ``help()``) is ``build``'s plus the four options.
    """
    name = build.__name__
    signature = inspect.signature(build)
    taken = [option.name for option in STATE_OPTIONS if option.name in signature.parameters]
    if taken:
        raise TypeError(f"{name}: chain_alias adds {taken} itself; leave them out of the "
                        f"signature")

    @functools.wraps(build)
    def alias(*args: Any, skip_zeros: bool = False, state_bits: int = 32,
              state_dtype: torch.dtype | None = None, state_rounding: str = "nearest",
              **kwargs: Any) -> GradientTransformation:
        check_state_options(name, state_bits, state_dtype, state_rounding)
        return finish(build(*args, **kwargs), skip_zeros, state_bits, state_dtype,
                      state_rounding)

    alias.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[*signature.parameters.values(), *STATE_OPTIONS],
        return_annotation="GradientTransformation")
    # Evaluated here, so that typing.get_type_hints resolves them in any alias module.
    own = {key: value for key, value in build.__annotations__.items() if key != "return"}
    alias.__annotations__ = {**own, "skip_zeros": bool, "state_bits": int,
                             "state_dtype": torch.dtype | None, "state_rounding": str,
                             "return": GradientTransformation}
    return alias


@chain_alias
def sgd(
    learning_rate: ScalarOrSchedule,
    momentum: Float | None = None,
    nesterov: bool = False,
) -> list[GradientTransformation]:
    """SGD, with optional (Nesterov) momentum: ``chain(trace(momentum), lr)``."""
    _check_momentum("sgd", momentum)
    parts = [] if momentum is None else [trace(momentum, nesterov)]
    return [*parts, scale_by_learning_rate(learning_rate)]


@chain_alias
def adam(
    learning_rate: ScalarOrSchedule,
    b1: Float = 0.9,
    b2: Float = 0.999,
    eps: Float = 1e-8,
    eps_root: Float = 0.0,
    *,
    nesterov: bool = False,
) -> list[GradientTransformation]:
    """Adam: ``chain(scale_by_adam(b1, b2, eps, eps_root), scale_by_learning_rate(lr))``."""
    return [scale_by_adam(b1, b2, eps, eps_root, nesterov=nesterov),
            scale_by_learning_rate(learning_rate)]


@chain_alias
def adamw(
    learning_rate: ScalarOrSchedule,
    b1: Float = 0.9,
    b2: Float = 0.999,
    eps: Float = 1e-8,
    eps_root: Float = 0.0,
    weight_decay: Float = 1e-4,
    mask: Any = None,
    *,
    nesterov: bool = False,
) -> list[GradientTransformation]:
    """AdamW: ``chain(scale_by_adam, add_decayed_weights(wd, mask), scale_by_learning_rate)``.

    The decay is multiplied by the learning rate: p ← p − lr·(m̂/(√v̂+eps) + wd·p), which
    is torch.optim.AdamW and bitsandbytes' Adam/AdamW.
    """
    return [scale_by_adam(b1, b2, eps, eps_root, nesterov=nesterov),
            add_decayed_weights(weight_decay, mask),
            scale_by_learning_rate(learning_rate)]


@chain_alias
def lion(
    learning_rate: ScalarOrSchedule,
    b1: Float = 0.9,
    b2: Float = 0.99,
    weight_decay: Float = 1e-3,
    mask: Any = None,
) -> list[GradientTransformation]:
    """Lion: ``chain(scale_by_lion(b1, b2), add_decayed_weights(wd, mask), lr)``."""
    return [scale_by_lion(b1, b2), add_decayed_weights(weight_decay, mask),
            scale_by_learning_rate(learning_rate)]


@chain_alias
def rmsprop(
    learning_rate: ScalarOrSchedule,
    decay: Float = 0.9,
    eps: Float = 1e-8,
    initial_scale: float = 0.0,
    eps_in_sqrt: bool = True,
    centered: bool = False,
    momentum: Float | None = None,
    nesterov: bool = False,
) -> list[GradientTransformation]:
    """RMSprop: ``chain(scale_by_rms(...), lr, trace(momentum))`` (optax's order);
    ``centered``: :func:`scale_by_stddev` in place of ``scale_by_rms`` (torch.optim's
    ``centered=True`` with ``eps_in_sqrt=False``)."""
    _check_momentum("rmsprop", momentum)
    scale = scale_by_stddev if centered else scale_by_rms
    parts = [scale(decay, eps, initial_scale, eps_in_sqrt=eps_in_sqrt),
             scale_by_learning_rate(learning_rate)]
    if momentum is not None:
        parts.append(trace(momentum, nesterov))
    return parts


@chain_alias
def adagrad(
    learning_rate: ScalarOrSchedule,
    initial_accumulator_value: float = 0.1,
    eps: Float = 1e-7,
) -> list[GradientTransformation]:
    """Adagrad: ``chain(scale_by_rss(initial_accumulator_value, eps), lr)``."""
    return [scale_by_rss(initial_accumulator_value, eps),
            scale_by_learning_rate(learning_rate)]


@chain_alias
def lamb(
    learning_rate: ScalarOrSchedule,
    b1: Float = 0.9,
    b2: Float = 0.999,
    eps: Float = 1e-6,
    eps_root: Float = 0.0,
    weight_decay: Float = 0.0,
    mask: Any = None,
) -> list[GradientTransformation]:
    """LAMB: ``chain(scale_by_adam, add_decayed_weights, scale_by_trust_ratio, lr)``."""
    return [scale_by_adam(b1, b2, eps, eps_root), add_decayed_weights(weight_decay, mask),
            scale_by_trust_ratio(), scale_by_learning_rate(learning_rate)]


@chain_alias
def lars(
    learning_rate: ScalarOrSchedule,
    weight_decay: Float = 0.0,
    weight_decay_mask: Any = True,
    trust_coefficient: Float = 0.001,
    eps: Float = 0.0,
    trust_ratio_mask: Any = True,
    momentum: Float = 0.9,
    nesterov: bool = False,
) -> list[GradientTransformation]:
    """LARS (optax order): ``chain(add_decayed_weights, masked(scale_by_trust_ratio),
    lr, trace(momentum))``."""
    _check_momentum("lars", momentum)
    return [
        add_decayed_weights(weight_decay, mask=_all_or(weight_decay_mask)),
        _maybe_masked(scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps),
                      trust_ratio_mask),
        scale_by_learning_rate(learning_rate),
        trace(momentum, nesterov),
    ]


def _all_or(mask: Any) -> Any:
    return None if mask is True else mask


def _maybe_masked(tx: GradientTransformation, mask: Any) -> GradientTransformation:
    return tx if mask is True else masked(tx, mask)


@chain_alias
def ademamix(
    learning_rate: ScalarOrSchedule,
    b1: Float = 0.9,
    b2: Float = 0.999,
    b3: ScalarOrSchedule = 0.9999,
    alpha: ScalarOrSchedule = 5.0,
    eps: Float = 1e-8,
    eps_root: Float = 0.0,
    weight_decay: Float = 0.0,
    mask: Any = None,
) -> list[GradientTransformation]:
    """AdEMAMix (as optax.contrib): ``chain(scale_by_ademamix, add_decayed_weights, lr)``."""
    return [scale_by_ademamix(b1, b2, b3, alpha, eps, eps_root),
            add_decayed_weights(weight_decay, mask), scale_by_learning_rate(learning_rate)]
