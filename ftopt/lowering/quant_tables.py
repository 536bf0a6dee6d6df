"""The tables the 8-bit kernels read, and the kernels' first guess of a code in torch.

:func:`kernel_table` is what a kernel reads for a dynamic map (its values, the float32
boundaries between neighbouring codes, the per-decade constants of the first guess);
:func:`arithmetic_codes` computes the kernels' arithmetic encoders operation for
operation, for the tests. How the kernels use them: :mod:`ftopt.lowering.quantized`.
"""

from __future__ import annotations

import functools

import torch

from ftopt.quant import dynamic_map

# log10(2): the decade of ``a`` is ``floor(log2(a) * LOG10_2) + 7``.
LOG10_2 = 0.3010299956639812

# The "poly" decade: log2(a) = e + log2(1 + t) for a = 2**e (1 + t), 0 <= t < 1, with
# log2(1 + t) ~ t (c1 + t (c2 + t (c3 + t c4))), a near-minimax fit whose error is at most
# 1.1e-4 in float32 (3.3e-5 decades; the codes do not move for 1e-4 decades:
# tests/test_quant_arith.py checks both). Plain float32 multiplies and adds on the float's
# bits: no libdevice ``log2f``, whose 11 fmas and per-element branch (for inf and NaN) the
# 8-bit kernels ran twice an element (static SASS of the 8-bit Adam kernel, 8 elements a
# thread: 3,586 instructions with log2f, 3,137 with this; benchmarks/sass_count.py).
POLY_LOG2 = (1.43901526927948, -0.6799482703208923, 0.32560446858406067,
             -0.08477398753166199)

# |v| >= _THRESHOLDS[k - 1] puts v in decade k or above.
_THRESHOLDS = [10.0 ** (k - 7) for k in range(1, 7)]


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def guess_constants(signed: bool) -> tuple[list[float], list[float], list[float]]:
    """Float32 thresholds and per-decade ``A``, ``C`` of the first guess.

    In decade ``d`` (scale ``s = 10**(d-6)``, ``n`` bins of width ``0.9 s / n``) code ``k``
    of the decade sits at position ``t = (a / s - 0.1) * n / 0.9 - 0.5 = k``, and the
    decade's codes start after ``base`` (the index of the last code below it):
    ``lo = base + floor(t) + 1 = trunc(a * A - C)`` as ``t + 1 > 0``.
    """
    a_consts, c_consts = [], []
    for d in range(7):
        n = 2 ** d if signed else 2 ** (d + 1)
        base = 126 + n if signed else n - 2
        a_consts.append(_f32(10.0 ** (6 - d) * n / 0.9))
        c_consts.append(_f32(0.1 * n / 0.9 - 0.5 - base))
    return [_f32(t) for t in _THRESHOLDS], a_consts, c_consts


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 keys in the order of the values (-0.0 just below +0.0)."""
    bits = x.to(torch.float32).view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF) - 1, bits)


def _from_ordered(keys: torch.Tensor) -> torch.Tensor:
    bits = torch.where(keys < 0, (-(keys + 1)) | -0x80000000, keys)
    return bits.to(torch.int32).view(torch.float32)


def boundaries(qmap: torch.Tensor) -> torch.Tensor:
    """Per ``lo`` in 0..254, the smallest float32 ``v`` with
    ``qmap[lo+1] - v < v - qmap[lo]`` (float32): the nearest-code rule of the table search
    takes ``lo + 1`` exactly for ``v >= boundaries[lo]``. (+inf where it never does.)"""
    q = qmap.to(torch.float32).cpu()
    q0, q1 = q[:-1], q[1:]

    def upper_nearer(v: torch.Tensor) -> torch.Tensor:
        return (q1 - v) < (v - q0)

    # The predicate is false at q0 and true at q1 where q1 > q0; bisect in between.
    lo, hi = _ordered(q0), _ordered(q1)
    never = ~upper_nearer(q1)
    for _ in range(40):
        mid = (lo + hi).div(2, rounding_mode="floor")
        take = upper_nearer(_from_ordered(mid))
        hi = torch.where(take, mid, hi)
        lo = torch.where(take, lo, mid)
        if bool((hi - lo <= 1).all()):
            break
    out = _from_ordered(hi)
    return torch.where(never, torch.full_like(out, float("inf")), out)


def kernel_table(qmap: torch.Tensor) -> torch.Tensor:
    """What the kernels read for a map: its 256 values, then its 255 boundaries
    (:func:`boundaries`) and one +inf, then the first guess's per-decade ``A`` (7 and a
    pad) and ``C`` (7 and a pad) of the "log2" encoder, on ``qmap``'s device (528 floats).
    The map is signed when its first code is negative."""
    b = boundaries(qmap)
    _, a_consts, c_consts = guess_constants(bool(qmap[0] < 0))
    guess = torch.tensor(a_consts + [0.0] + c_consts + [0.0], dtype=torch.float32)
    return torch.cat([qmap.to(torch.float32).cpu(), b, b.new_full((1,), float("inf")),
                      guess]).to(qmap.device)


@functools.cache
def table(signed: bool, device: torch.device) -> torch.Tensor:
    """The kernels' table of the default signed or unsigned map on ``device``, cached
    (:func:`kernel_table`); read-only."""
    return kernel_table(dynamic_map(signed, "cpu")).to(device)


def arithmetic_codes(v: torch.Tensor, qmap: torch.Tensor, signed: bool,
                     slack: float = 0.0, decade: str = "compare",
                     wobble: float = 0.0) -> torch.Tensor:
    """The kernel's arithmetic encoders in torch, operation for operation (float32).

    ``v``: normalised values (finite, in [-1, 1]); ``qmap``: the default dynamic map of
    ``signed``. Returns int64 codes. ``decade``: "compare" (the six thresholds, encoder
    "arithmetic") or "log2" (encoder "log2"). ``slack`` moves the guess ``a * A - C`` and
    ``wobble`` the "log2" decade estimate before its floor, in decades (tests only: the
    codes must not depend on them for ``|slack| <= 0.25``, ``|wobble| <= 1e-4``; a GPU's
    approximate ``log2`` errs by far less than that, and a decade taken one off next to a
    threshold moves the guess by less than a hundredth of a code, as the guess is
    continuous across decades).
    """
    v = v.to(torch.float32)
    a = v.abs() if signed else torch.clamp_min(v, 0.0)
    thresholds, a_consts, c_consts = guess_constants(signed)
    if decade in ("log2", "poly"):
        log2 = torch.log2(a) if decade == "log2" else poly_log2(a)
        d = torch.floor(log2 * LOG10_2 + (7.0 + wobble)).clamp(0.0, 6.0).long()
        big = torch.tensor(a_consts, dtype=torch.float32, device=v.device)[d]
        off = torch.tensor(c_consts, dtype=torch.float32, device=v.device)[d]
    else:
        big, off = torch.full_like(a, a_consts[0]), torch.full_like(a, c_consts[0])
        for threshold, big_d, off_d in zip(thresholds, a_consts[1:], c_consts[1:]):
            reached = a >= threshold
            big = torch.where(reached, big_d, big)
            off = torch.where(reached, off_d, off)
    lo = (a * big - off + slack).to(torch.int32)
    if signed:
        lo = torch.where(v < 0.0, torch.clamp_min(253 - lo, 0), lo)
    lo = lo.long()
    return torch.where(v >= kernel_table(qmap).to(v.device)[256 + lo], lo + 1, lo)


def poly_log2(a: torch.Tensor) -> torch.Tensor:
    """:data:`POLY_LOG2`'s estimate of ``log2(max(a, 1e-30))`` for float32 ``a >= 0``, as
    the "poly" kernels compute it (float32, operation for operation)."""
    bits = torch.clamp_min(a.to(torch.float32), 1e-30).view(torch.int32)
    t = ((bits & 8388607) | 1065353216).view(torch.float32) - 1.0
    c1, c2, c3, c4 = POLY_LOG2
    return ((bits >> 23) - 127).to(torch.float32) + t * (((c4 * t + c3) * t + c2) * t + c1)
