"""Fromage's step: the learning rate and the shrink of the params by 1/√(1 + lr²).

:func:`ftopt.fromage` is ``chain(scale_by_trust_ratio(min_norm), fromage_step(lr))``;
this module holds the second part, an elementwise rule (so the whole chain fuses, the
trust ratio's norms in a reduction pass before the kernel). optax writes it as
``scale_by_learning_rate(lr·m)`` then ``add_decayed_weights(m − 1)`` with
m = 1/√(1 + lr²); ftopt's ``add_decayed_weights`` takes only wd >= 0, and m − 1 < 0.
"""

from __future__ import annotations

from ftopt.base import EmptyState, GradientTransformation
from ftopt.domains import NONNEG
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule
from ftopt.schedules import ScalarOrSchedule
from ftopt.transforms.scaling import ScaleByScheduleState

__all__ = ["fromage_step"]


def _fromage_scalars(t, h):
    lr = h["learning_rate"]
    mult = 1 / (1 + lr * lr) ** 0.5
    return {"step_size": -lr * mult, "shrink": mult - 1}


def _fromage_body(o, x):
    return x.u * x.step_size + x.shrink * x.p, {}


def fromage_step(learning_rate: ScalarOrSchedule) -> GradientTransformation:
    """u ← −lr·m·u + (m − 1)·p with m = 1/√(1 + lr²), so that p + u = m·(p − lr·u).

    ``learning_rate``: a float >= 0, a 0-d tensor or a schedule of the step count (0 on
    the first step, as optax's ``scale_by_learning_rate``).
    """
    scheduled = callable(learning_rate)
    return rule_transform(Rule(
        "fromage_step",
        _fromage_body,
        state_class=ScaleByScheduleState if scheduled else EmptyState,
        hparams={"learning_rate": learning_rate},
        domains={"learning_rate": NONNEG},
        scalars=_fromage_scalars,
        counted=scheduled,
        uses_params=True,
    ))
