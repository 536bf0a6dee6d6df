"""``quantize_states``: 8-bit blockwise storage for every per-element state of a chain."""

from __future__ import annotations

from ftopt.base import GradientTransformation, check_transform
from ftopt.domains import check_int
from ftopt.rule_transform import RuleTransform
from ftopt.rules import QuantConfig

__all__ = ["quantize_states"]


def _rebuild(tx: GradientTransformation, quant: QuantConfig | None) -> GradientTransformation:
    obj = getattr(tx.update, "__self__", None)
    if isinstance(obj, RuleTransform):
        return obj.with_quant(quant).as_transform()
    children = getattr(obj, "transforms", None)
    if children is not None and hasattr(obj, "rebuild"):
        return obj.rebuild([_rebuild(t, quant) for t in children])
    return tx


def quantize_states(
    tx: GradientTransformation, bits: int = 8, block_size: int = 256, min_size: int = 4096
) -> GradientTransformation:
    """Stores the per-element float states of ``tx`` as 8-bit blockwise codes.

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

    Raises:
        TypeError: an argument that is not an int (``bool`` and floats included).
        ValueError: ``bits`` not 8 or 32, ``block_size`` < 1 or ``min_size`` < 0.
    """
    check_transform(tx, "quantize_states: argument tx")
    bits = check_int("quantize_states", "bits", bits)
    if bits not in (8, 32):
        raise ValueError(f"quantize_states: bits must be 8 or 32, got {bits}")
    block_size = check_int("quantize_states", "block_size", block_size, minimum=1)
    min_size = check_int("quantize_states", "min_size", min_size, minimum=0)
    quant = None if bits == 32 else QuantConfig(bits, block_size, min_size)
    return _rebuild(tx, quant)
