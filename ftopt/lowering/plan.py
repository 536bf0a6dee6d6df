"""Planner: decides, per step, whether a chain runs fused and why not."""

from __future__ import annotations


def fused_step_or_reason(tx, params, grads, state, donate, backend):
    return None, "the fused backend is not available"
