"""Experimental modules, with optax's ``optax.experimental`` names: :mod:`aggregating`
(aggregators of per-element gradients, gradient accumulation, and the mean and variance
of per-element gradients tracked beside an optimizer)."""

from __future__ import annotations

from ftopt.experimental import aggregating

__all__ = ["aggregating"]
