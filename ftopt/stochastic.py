"""Stochastic rounding of bf16 states (``state_rounding="stochastic"``).

A rule whose per-element states are stored in bf16 gets its body wrapped: each new slot
value (fp32) is dithered and truncated to a bf16 value before the store, which then
stores it exactly (the ordinary round-to-nearest store of a bf16 value is the identity),
so the eager and the fused backends, running the same body, give the same bits.

Dither then truncate: ``u = bits(x) + r`` with ``r`` in ``[0, 2**16)``, the bf16 value is
``u`` with its low 16 bits cleared. A value is rounded up with probability its distance
from the bf16 value below (in magnitude) over the ulp, so the rounding is unbiased. ``r``
is the top 16 bits of a counter-based hash (the finalizer of
:mod:`ftopt.transforms.noise`) of the step count, the leaf's position in the flattened
tree, the slot and the element's row-major position in its leaf (the full tensor's, on a
DTensor shard): no generator state, the same bits on every backend and every run.

Edge cases: NaN stays NaN; a finite value whose dithered value would be inf keeps its
truncated value (the largest finite bf16 of its sign); ±inf, ±0.0 and every value that is
exactly a bf16 stay as they are (their low 16 bits are 0, and ``r`` never carries).
skip_zeros stores the old (bf16) value where the gradient is zero: unchanged.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import torch

from ftopt.rules import Rule
from ftopt.transforms.noise import leaf_key, mix32

__all__ = ["ROUNDINGS", "check_state_rounding", "stochastic_rule", "round_bf16_stochastic"]

#: The values ``state_rounding`` accepts.
ROUNDINGS = ("nearest", "stochastic")

_HALF = 1 << 16
_BF16_MAX = 3.3895313892515355e38  # the largest finite bf16
_SLOT_SALT = 0x3C6EF372  # separates the words of a leaf's slots


def check_state_rounding(where: str, state_rounding: object, state_dtype: object,
                         state_bits: int = 32) -> str:
    """``state_rounding`` if it is valid with ``state_dtype`` and ``state_bits``, else
    raises (the message names the option and what is allowed)."""
    if not isinstance(state_rounding, str) or state_rounding not in ROUNDINGS:
        raise ValueError(f"{where}: state_rounding must be 'nearest' or 'stochastic', got "
                         f"{state_rounding!r}")
    if state_rounding == "stochastic":
        if state_dtype != torch.bfloat16:
            raise ValueError(f"{where}: state_rounding='stochastic' needs "
                             f"state_dtype=torch.bfloat16 (fp16 and fp32 states round to "
                             f"nearest), got state_dtype={state_dtype}")
        if state_bits != 32:
            raise ValueError(f"{where}: state_rounding='stochastic' needs state_bits=32 "
                             f"(8-bit states round to the nearest code), got "
                             f"state_bits={state_bits}")
    return state_rounding


def round_bf16_stochastic(o, value, word):
    """``value`` (fp32) rounded stochastically to a bf16 value (held in fp32), with the
    dither ``word >> 16`` (``word``: a 32-bit unsigned integer per element)."""
    bits = o.float_bits(value)
    dithered = o.from_bits(o.mul32(o.shr(o.add32(bits, o.shr(word, 16)), 16), _HALF))
    truncated = o.from_bits(o.mul32(o.shr(bits, 16), _HALF))
    out = o.where(o.abs(dithered) > _BF16_MAX, truncated, dithered)
    return o.where(value != value, value, out)  # NaN (whatever its payload) stays NaN


def _scalars(old):
    def scalars(t, h: dict) -> dict:
        base = old(t, h) if old is not None else {}
        return {**base, "sr_t_lo": t % _HALF, "sr_t_hi": t // _HALF}
    return scalars


def stochastic_rule(rule: Rule) -> Rule:
    """``rule`` with its per-element slots rounded stochastically to bf16 values before
    they are stored (see the module docstring). Raises ``ValueError`` for a rule that
    keeps no step count (the dither would repeat every step)."""
    if not rule.counted:
        raise ValueError(f"{rule.name}: state_rounding='stochastic' needs a step count "
                         f"(the dither changes every step); {rule.name} keeps none: use "
                         f"state_rounding='nearest'")
    # (A tuple: the planner keys a body by the values it closes over.)
    names = tuple((k, s.name) for k, s in enumerate(rule.slots)
                  if not s.per_leaf and not s.from_params)
    body = rule.body

    def stochastic_body(o, x):
        out = body(o, x)
        u, slots = out[0], dict(out[1])
        step = SimpleNamespace(seed_lo=0, seed_hi=0, t_lo=x.sr_t_lo, t_hi=x.sr_t_hi,
                               leaf=x.leaf)
        key = leaf_key(o, step)
        for k, name in names:
            if name in slots:
                slot_key = mix32(o, o.add32(key, (_SLOT_SALT * (k + 1)) & 0xFFFFFFFF))
                word = mix32(o, mix32(o, o.add32(x.index, slot_key)))
                slots[name] = round_bf16_stochastic(o, slots[name], word)
        return (u, slots, *out[2:])

    return replace(rule, body=stochastic_body, scalars=_scalars(rule.scalars), indexed=True)
