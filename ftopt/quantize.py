"""``quantize_states``: 8-bit blockwise (or 16-bit float) storage for every per-element
state of a chain."""

from __future__ import annotations

from typing import Any

import torch

from ftopt.base import GradientTransformation, check_transform
from ftopt.domains import check_int
from ftopt.rule_transform import RuleTransform
from ftopt.rules import QuantConfig
from ftopt.stochastic import check_state_rounding, stochastic_rule

__all__ = ["quantize_states"]


#: The dtypes ``state_dtype`` accepts (``None``: the params' compute dtype).
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _rebuild(tx: GradientTransformation, quant: QuantConfig | None,
             store: torch.dtype | None, rounding: str = "nearest") -> GradientTransformation:
    obj = getattr(tx.update, "__self__", None)
    if isinstance(obj, RuleTransform):
        new = obj.with_quant(quant, store)
        if rounding == "stochastic" and new.store is not None:
            new = RuleTransform(stochastic_rule(new.rule), new.quant, new.store)
        return new.as_transform()
    if callable(getattr(obj, "with_quant", None)):
        # (a stage with per-element states of its own, Prodigy's, stores them as asked too)
        if rounding == "stochastic":
            raise ValueError(f"quantize_states: state_rounding='stochastic' is not "
                             f"supported by {type(obj).__name__}; use "
                             f"state_rounding='nearest'")
        return obj.with_quant(quant, store).as_transform()
    children = getattr(obj, "transforms", None)
    if children is not None and hasattr(obj, "rebuild"):
        return obj.rebuild([_rebuild(t, quant, store, rounding) for t in children])
    return tx


def check_state_dtype(where: str, state_dtype: Any) -> torch.dtype | None:
    """``state_dtype`` if it is ``None`` or one of :data:`STATE_DTYPES`, else raises."""
    if state_dtype is None or state_dtype in STATE_DTYPES:
        return state_dtype
    if not isinstance(state_dtype, torch.dtype):
        raise TypeError(f"{where}: state_dtype must be a torch.dtype or None, got "
                        f"{type(state_dtype).__name__} {state_dtype!r}")
    raise ValueError(f"{where}: state_dtype must be torch.float32, torch.bfloat16 or "
                     f"torch.float16, got {state_dtype}")


def quantize_states(
    tx: GradientTransformation, bits: int = 8, block_size: int = 256, min_size: int = 4096,
    state_dtype: torch.dtype | None = None, state_rounding: str = "nearest",
) -> GradientTransformation:
    """Stores the per-element float states of ``tx`` as 8-bit blockwise codes, or in a
    16-bit float dtype.

    Every state slot of a leaf with at least ``min_size`` elements becomes uint8 codes
    into bitsandbytes' dynamic map (signed for mu/trace/m1/m2, unsigned for nu/rms/rss)
    plus one fp32 absmax per ``block_size`` consecutive elements; smaller leaves keep fp32
    state. A step dequantizes (code·absmax), runs the fp32 math, sets each block's absmax
    to max|new state| and re-encodes each element to the nearest code.

    Args:
        tx: the transform (a chain of ftopt transforms).
        bits: 8, or 32 to return ``tx`` with 32-bit states.
        block_size: elements per absmax, a positive int (default: 256). The fused kernels
            also need it to divide their tile; another size runs eagerly (see
            :func:`ftopt.explain`).
        min_size: smallest leaf with 8-bit state, an int >= 0 (default: 4096).
        state_dtype: the dtype of every per-element float state that is not 8-bit (all of
            them with ``bits=32``, the leaves below ``min_size`` with ``bits=8``):
            ``torch.bfloat16`` or ``torch.float16`` store it in 16 bits (the math stays
            fp32: each state is read exactly, updated in fp32 and rounded to nearest once
            per store), ``torch.float32`` in 32; ``None`` (default): the params' compute
            dtype (fp32, or fp64 for fp64 params). Steps with bf16/fp16 states run fused
            as well as eagerly.
        state_rounding: how 16-bit states are rounded at each store: ``"nearest"``
            (default; nearest even) or ``"stochastic"`` (bf16 only, with ``bits=32``: the
            fp32 value plus 16 random low bits, truncated; unbiased, so that a state whose
            per-step change is below half an ulp, Adam's v with b2 = 0.999, still moves
            on average). The random bits are a hash of the step count, the leaf's
            position, the slot and the element's position: the same bits fused and
            eagerly, no generator state (see :mod:`ftopt.stochastic`). Every stage with
            per-element state must keep a step count (Adam's and most others do;
            ``trace`` does not).

    Raises:
        TypeError: an argument that is not an int (``bool`` and floats included), a
            ``state_dtype`` that is not a ``torch.dtype``.
        ValueError: ``bits`` not 8 or 32, ``block_size`` < 1 or ``min_size`` < 0, a
            ``state_dtype`` other than fp32, bf16 and fp16; ``state_rounding`` not
            ``"nearest"`` or ``"stochastic"``, or ``"stochastic"`` without bf16 states,
            with ``bits=8`` or with a stage that keeps no step count.
    """
    check_transform(tx, "quantize_states: argument tx")
    bits = check_int("quantize_states", "bits", bits)
    if bits not in (8, 32):
        raise ValueError(f"quantize_states: bits must be 8 or 32, got {bits}")
    block_size = check_int("quantize_states", "block_size", block_size, minimum=1)
    min_size = check_int("quantize_states", "min_size", min_size, minimum=0)
    store = check_state_dtype("quantize_states", state_dtype)
    rounding = check_state_rounding("quantize_states", state_rounding, store, bits)
    quant = None if bits == 32 else QuantConfig(bits, block_size, min_size)
    return _rebuild(tx, quant, store, rounding)
