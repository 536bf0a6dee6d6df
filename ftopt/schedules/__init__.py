"""Schedules: plain callables ``schedule(count) -> value``, with optax's names and semantics.

An ``int`` count gives a ``float`` (float64 host math, for kernel scalars); a 0-d integer
tensor count gives a 0-d float32 tensor on its device (float64 for
:func:`ademamix_b3_warmup`, whose 1 − β3 float32 cannot hold), from torch ops only (no
``.item()``, no host sync: CUDA-graph capturable and traceable). The two agree up to
float32 rounding.
Integer work on the count comes before any float conversion, so large counts stay exact.

Every schedule checks its arguments when it is built, so a bad value fails there and not
as a NaN learning rate steps later: values (init, peak, end, alpha, ...) must be finite
real numbers, step counts and boundaries integers (an ``int``, or a float of integer
value such as ``1e4``; ``2.5`` raises ``TypeError``), and arguments the formula divides by
or raises to a power must be in range. What optax accepts
with a defined result is kept (``transition_steps <= 0`` gives a constant schedule, a
negative ``transition_begin`` counts as 0, ``join_schedules`` boundaries in any order).
Messages name the schedule and the argument: ``linear_schedule: end_value must be finite,
got nan``.
"""

from ftopt.schedules.cycles import (
    cosine_onecycle_schedule,
    linear_onecycle_schedule,
    piecewise_interpolate_schedule,
    sgdr_schedule,
    warmup_exponential_decay_schedule,
)
from ftopt.schedules.decays import (
    ScalarOrSchedule,
    Schedule,
    ademamix_alpha_warmup,
    ademamix_b3_warmup,
    constant_schedule,
    cosine_decay_schedule,
    exponential_decay,
    join_schedules,
    linear_schedule,
    piecewise_constant_schedule,
    polynomial_schedule,
    warmup_constant_schedule,
    warmup_cosine_decay_schedule,
)

__all__ = [
    "Schedule", "ScalarOrSchedule", "constant_schedule", "linear_schedule", "polynomial_schedule",
    "exponential_decay", "cosine_decay_schedule", "warmup_cosine_decay_schedule",
    "warmup_constant_schedule", "warmup_exponential_decay_schedule",
    "piecewise_constant_schedule", "piecewise_interpolate_schedule", "join_schedules",
    "linear_onecycle_schedule", "cosine_onecycle_schedule", "sgdr_schedule",
    "ademamix_alpha_warmup", "ademamix_b3_warmup",
]  # fmt: skip
