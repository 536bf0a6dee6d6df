"""8-bit blockwise quantization of optimizer states (eager reference).

A tensor ``x`` is flattened and cut into blocks of ``block_size`` consecutive elements
(the last block may be partial). Block ``b`` stores ``absmax[b] = max_i |x_i|`` in fp32
and every element stores a uint8 index ``c_i`` into a sorted 256-entry code ``q``
(bitsandbytes' dynamic map)::

    v_i = clamp(x_i / absmax[b], -1, 1)          (v_i = 0 where absmax[b] == 0)
    c_i = nearest(v_i)                           (tie rule below)
    x_hat_i = q[c_i] * absmax[b]

Tie rule (exact, float32): let ``hi`` be the first index with ``q[hi] >= v`` (clamped
to ``[1, K-1]``) and ``lo = hi - 1``. The element takes ``hi`` iff
``fl32(q[hi] - v) < fl32(v - q[lo])``, otherwise ``lo``. So an exact tie, and any
near-tie whose two distances round to the same float32, goes to the LOWER index. This
equals ``argmin_k fl32(|v - q[k]|)`` with first-index tie breaking (``torch.argmin``)
for the dynamic maps, whose code gaps are far above float32 rounding of ``v - q[k]``.
(A ``bucketize`` against float32 midpoints, as in bitsandbytes' default backend, picks
the farther code for ~50 float32 values per map lying within a few ulps of a midpoint.)
The fused backend must compute ``x / absmax`` with round-to-nearest division
(``tl.math.div_rn``) and the two distances in float32 to reproduce the codes bit-exactly.

An all-zero block (``absmax == 0``) encodes every element to the code of 0.0 and
dequantizes to exactly 0 (no 0/0).

Non-finite values stay in their element: a block's absmax is the largest *finite*
magnitude in it (0 if it has none), a NaN is encoded as the code of 0.0 and +-Inf as the
code of +-1 (the block's extreme). So a NaN or Inf gradient element (which makes its
param element non-finite on every backend) cannot turn the other 255 states of its block
into NaN, as a NaN absmax would. The fused kernels follow the same rule.

Note: the signed map holds +1.0 but not -1.0, so re-quantizing a dequantized block whose
largest magnitude is negative shrinks its absmax to ``0.99297 * absmax``; re-quantization
is idempotent only when the block's extreme element is positive (always, for the
unsigned map on non-negative data), barring float32 underflow of ``q[c] * absmax``.
"""

from __future__ import annotations

import functools
import weakref

import torch

__all__ = [
    "create_dynamic_map",
    "dynamic_map",
    "block_absmax",
    "expand_absmax",
    "nearest_code",
    "encode_with_absmax",
    "quantize_blockwise",
    "dequantize_blockwise",
    "absmax_layout",
]


def create_dynamic_map(
    signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8
) -> torch.Tensor:
    """bitsandbytes' dynamic quantization map: ``2**total_bits`` sorted float32 values.

    With ``E = max_exponent_bits`` and ``N = total_bits - 1``, decade ``i = 0..E-1``
    (scale ``10**(i - E + 1)``, i.e. 1e-6 ... 1 for the defaults) splits ``[0.1, 1]`` into
    ``2**(i + N - E)`` equal bins (twice as many when unsigned) and contributes the bin
    midpoints times the scale (and their negatives when signed). ``2**(N - E) - 1`` extra
    midpoints join the last decade, then 0 and 1.0 are added, the list is padded with
    zeros to ``2**total_bits`` entries and sorted.

    Defaults, signed: 127 negatives, 0 at index 127, 128 positives; range
    ``[-0.99296875, 1.0]``; smallest magnitude 5.5e-7. Unsigned: 0, then 255 positives
    from 3.25e-7 to 1.0.

    Args:
      signed: include negative values (default: True).
      max_exponent_bits: number of decades (default: 7).
      total_bits: code width; at most 8 so that codes fit in uint8 (default: 8).
    """
    if not 2 <= total_bits <= 8:
        raise ValueError(f"total_bits must be in [2, 8], got {total_bits}")
    non_sign_bits = total_bits - 1
    if not 1 <= max_exponent_bits <= non_sign_bits:
        raise ValueError(
            f"max_exponent_bits must be in [1, {non_sign_bits}], got {max_exponent_bits}"
        )
    extra_bits = non_sign_bits - max_exponent_bits

    def midpoints(bins: int, scale: float) -> list[float]:
        # Edges, midpoints and scaling all in float32 arithmetic, as bitsandbytes does, so
        # that the map matches its map bit for bit (float64 math rounds differently).
        edges = torch.linspace(0.1, 1.0, bins + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        return (torch.tensor(scale, dtype=torch.float32) * mids).tolist()

    values: list[float] = []
    for i in range(max_exponent_bits):
        scale = 10.0 ** (i - max_exponent_bits + 1)
        bins = 2 ** (i + extra_bits + (0 if signed else 1))
        mids = midpoints(bins, scale)
        values += mids + ([-m for m in mids] if signed else [])
    if extra_bits > 0:
        mids = midpoints(2**extra_bits - 1, 1.0)
        values += mids + ([-m for m in mids] if signed else [])
    values += [0.0, 1.0]
    size = 2**total_bits
    if len(values) > size:  # pragma: no cover - impossible for valid arguments
        raise AssertionError(f"dynamic map has {len(values)} > {size} entries")
    values += [0.0] * (size - len(values))
    return torch.tensor(sorted(values), dtype=torch.float32)


@functools.cache
def _cached_map(signed: bool, device: torch.device) -> torch.Tensor:
    return create_dynamic_map(signed).to(device)


def dynamic_map(signed: bool, device: torch.device | str | None = None) -> torch.Tensor:
    """The default 8-bit signed or unsigned dynamic map on ``device``, cached.

    One tensor per ``(signed, device)``; treat it as read-only.
    """
    # Normalize "cuda" to "cuda:0" etc. so both spellings share one cache entry.
    device = torch.empty(0, device=device).device
    return _cached_map(bool(signed), device)


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def block_absmax(x: torch.Tensor, block_size: int = 256) -> torch.Tensor:
    """``absmax[b] = max |x_i|`` over block ``b`` of the flattened ``x``; fp32, ``(ceil(n/B),)``.

    A partial last block is padded with zeros, which do not change its maximum.
    """
    _check_block_size(block_size)
    flat = x.reshape(-1).to(torch.float32).abs()
    # Non-finite magnitudes do not count (see the module docstring).
    flat = torch.where(flat < float("inf"), flat, torch.zeros((), dtype=flat.dtype))
    if flat.numel() % block_size == 0:  # whole blocks: no padded copy
        return flat.view(-1, block_size).amax(dim=1)
    num_blocks = -(-flat.numel() // block_size)
    padded = flat.new_zeros(num_blocks * block_size)
    padded[: flat.numel()] = flat
    return padded.view(num_blocks, block_size).amax(dim=1)


def expand_absmax(absmax: torch.Tensor, numel: int, block_size: int = 256) -> torch.Tensor:
    """Per-element absmax of a flattened tensor of ``numel`` elements: ``absmax[i // B]``."""
    _check_block_size(block_size)
    return absmax.repeat_interleave(block_size)[:numel]


def nearest_code(v: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """uint8 index of the nearest entry of the sorted ``qmap`` to each ``v`` (lower on ties).

    ``hi = clamp(searchsorted(qmap, v), 1, K-1)``, ``lo = hi - 1``; take ``hi`` iff
    ``qmap[hi] - v < v - qmap[lo]`` in float32. Values beyond either end of the map
    get the end code; a NaN gets ``K - 2`` (``hi`` clamped to ``K - 1``, the comparison
    false). Computed through the map's bucket table (:func:`_bucket_table`), which gives
    these codes for every float32 value, where the map has one.
    """
    return _codes(v.to(torch.float32), qmap, finite=False)


def _codes(v: torch.Tensor, qmap: torch.Tensor, finite: bool) -> torch.Tensor:
    """uint8 codes of float32 ``v``: through the map's bucket table where it has one and
    ``v`` is a plain tensor outside ``torch.func``, else by the search. ``finite``: the
    caller has no NaN in ``v`` (the table gives a NaN inf's code, patched otherwise)."""
    table = _bucket_table(qmap)
    if table is None or _traced(v):
        return _searched_code(v.contiguous(), _checked_map(qmap)).to(torch.uint8)
    codes = _table_code(v, table)
    if finite:
        return codes
    return torch.where(v == v, codes, torch.full((), qmap.numel() - 2, dtype=torch.uint8,
                                                 device=codes.device))


def _checked_map(qmap: torch.Tensor) -> torch.Tensor:
    size = qmap.numel()
    if not 2 <= size <= 256:
        raise ValueError(f"qmap must have 2..256 entries for uint8 codes, got {size}")
    return qmap.to(torch.float32).contiguous()


def _searched_code(v: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """The tie rule of :func:`nearest_code` by binary search: int64 codes."""
    hi = torch.searchsorted(qmap, v).clamp_(1, qmap.numel() - 1)
    lo = hi - 1
    return torch.where((qmap[hi] - v) < (v - qmap[lo]), hi, lo)


# The bucket table of a map: float32 values split by the top ``bits`` of their bit
# pattern into buckets (intervals of values); a bucket's code is its lower end's, plus
# one from a threshold on where the code steps up, where it does. Built from
# _searched_code itself (the code is monotone in v, so a bucket whose two ends' codes
# differ by at most one steps once, at the first value of the higher code, found by
# bisection), for the fewest bits (12 to 20) at which every bucket steps at most once:
# 15 for the signed dynamic map, 16 for the unsigned one. Every one of the 2**32 float32
# patterns then gets the searched code (benchmarks/quant_table_exhaustive.py); four
# elementwise ops and two gathers in place of a search: 4M elements on two CPU threads,
# 12-22 ms against 99-198 ms (benchmarks/RESULTS.md, 2026-12-05).
_TABLE_BITS = range(12, 21)
_TABLES: dict[int, tuple] = {}  # id(map) -> (weakref to it, its _version, its table)


def _as_float(patterns: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns in [0, 2**32) as float32 values."""
    wrapped = torch.where(patterns >= 2**31, patterns - 2**32, patterns)
    return wrapped.to(torch.int32).view(torch.float32)


def _bucket_table(qmap: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """``(bits, base codes, thresholds)`` of a map, on its device (``None``: a map too
    dense for 20 bits, or one on the meta device), cached per map tensor (raises for a
    map of a size that uint8 codes cannot index)."""
    checked = _checked_map(qmap)
    if qmap.device.type == "meta":
        return None
    found = _TABLES.get(id(qmap))
    if found is not None and found[0]() is qmap and found[1] == qmap._version:
        return found[2]
    table = _build_table(checked.cpu())
    if table is not None:
        table = (table[0], table[1].to(qmap.device), table[2].to(qmap.device))
    key = id(qmap)
    _TABLES[key] = (weakref.ref(qmap, lambda _, key=key: _TABLES.pop(key, None)),
                    qmap._version, table)
    return table


def _build_table(qmap: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    for bits in _TABLE_BITS:
        table = _table_at(qmap, bits)
        if table is not None:
            return bits, *table
    return None


def _table_at(qmap: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(base codes, thresholds)`` of buckets of ``bits`` bits, or ``None`` where a
    bucket steps more than once."""
    width = 1 << (32 - bits)
    start = torch.arange(1 << bits, dtype=torch.int64) * width
    end = start + width - 1
    negative = start >= 2**31  # the patterns of a negative bucket descend in value

    def code_at(offset: torch.Tensor) -> torch.Tensor:  # the code at an offset in value order
        return _searched_code(_as_float(torch.where(negative, end - offset, start + offset)),
                              qmap)

    low, high = code_at(torch.zeros_like(start)), code_at(torch.full_like(start, width - 1))
    nan = _as_float(end).isnan()  # +-inf and the NaNs: inf's code (a NaN is patched)
    if not bool(((high - low <= 1) | nan).all()):
        return None
    a, b = torch.zeros_like(start), torch.full_like(start, width - 1)
    while bool((a < b).any()):  # the first offset of the higher code
        mid = (a + b) // 2
        up = code_at(mid) == high
        a, b = torch.where(up, a, mid + 1), torch.where(up, mid, b)
    first = _as_float(torch.where(negative, end - a, start + a))
    thresholds = torch.where((high != low) & ~nan, first, torch.tensor(float("nan")))
    base = torch.where(nan, _searched_code(_as_float(start), qmap), low)
    return base.to(torch.uint8), thresholds


def _table_code(v: torch.Tensor, table: tuple[int, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """uint8 codes of float32 ``v`` from a bucket table (a NaN gets inf's code)."""
    bits, base, thresholds = table
    bucket = ((v.view(torch.int32) >> (32 - bits)) & ((1 << bits) - 1)).reshape(-1)
    code = base.index_select(0, bucket).view(v.shape)
    return code + (v >= thresholds.index_select(0, bucket).view(v.shape)).to(torch.uint8)


def _traced(v: torch.Tensor) -> bool:
    """Inside a torch.func transform, or a tensor subclass: these take the search (the
    table's bit view and gathers are for plain tensors)."""
    return (torch._C._functorch.peek_interpreter_stack() is not None
            or type(v) is not torch.Tensor)


def encode_with_absmax(x: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """Codes of ``x`` given its (new) block absmax, broadcast against ``x`` per element.

    ``c = nearest(clamp(x / absmax, -1, 1))``; where ``absmax == 0`` (or is not > 0)
    ``v = 0``, so an all-zero block never divides 0 by 0. A NaN ``x / absmax`` is
    encoded as 0, +-Inf as +-1.

    Args:
      x: values to encode (upcast to float32).
      absmax: per-element absmax broadcastable to ``x`` (e.g. :func:`expand_absmax`).
      qmap: sorted code values (e.g. :func:`dynamic_map`).

    Returns:
      uint8 codes with the broadcast shape of ``x`` and ``absmax``.
    """
    x = x.to(torch.float32)
    absmax = absmax.to(torch.float32)
    positive = absmax > 0
    safe = torch.where(positive, absmax, torch.ones_like(absmax))
    zero = torch.zeros((), dtype=torch.float32, device=x.device)
    v = torch.nan_to_num(torch.where(positive, x / safe, zero), nan=0.0).clamp_(-1.0, 1.0)
    return _codes(v, qmap, finite=True)  # (no NaN is left)


def quantize_blockwise(
    x: torch.Tensor, qmap: torch.Tensor, block_size: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to uint8 codes with one fp32 absmax per block.

    Args:
      x: tensor of any shape (upcast to float32); flattened into blocks of
        ``block_size`` consecutive elements.
      qmap: sorted code values (e.g. ``dynamic_map(signed, x.device)``).
      block_size: elements per block (default: 256).

    Returns:
      ``(codes, absmax)``: uint8 codes with ``x``'s shape and float32 absmax of shape
      ``(ceil(x.numel() / block_size),)``.
    """
    absmax = block_absmax(x, block_size)
    if x.numel() % block_size == 0:  # whole blocks: the absmax broadcast along each
        blocks = x.reshape(-1, block_size)
        return encode_with_absmax(blocks, absmax[:, None], qmap).view(x.shape), absmax
    per_element = expand_absmax(absmax, x.numel(), block_size)
    codes = encode_with_absmax(x.reshape(-1), per_element, qmap)
    return codes.view(x.shape), absmax


def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor, block_size: int = 256
) -> torch.Tensor:
    """``x_hat_i = qmap[codes_i] * absmax[i // block_size]``; float32 with ``codes``' shape."""
    flat = codes.reshape(-1).to(torch.int32)
    _check_block_size(block_size)
    expected = -(-flat.numel() // block_size)
    if absmax.numel() != expected:
        raise ValueError(
            f"absmax has {absmax.numel()} entries, expected {expected} for "
            f"{flat.numel()} codes in blocks of {block_size}"
        )
    values = qmap.to(torch.float32).index_select(0, flat)
    absmax = absmax.reshape(-1).to(torch.float32)
    if flat.numel() % block_size == 0:  # whole blocks: the absmax broadcast along each
        return (values.view(-1, block_size) * absmax[:, None]).view(codes.shape)
    per_element = expand_absmax(absmax, flat.numel(), block_size)
    return (values * per_element).view(codes.shape)


def absmax_layout(shape: torch.Size | tuple, block_size: int = 256) -> tuple[int, ...]:
    """The shape of the absmax of a tensor of ``shape`` in sharded states and checkpoints.

    ``(shape[0], row // block_size)`` when a row (the ``shape[1:]`` slice) is a whole
    number of blocks, so the absmax shards on dim 0 exactly as the tensor does; otherwise
    the flat ``(ceil(numel / block_size),)``. The values are those of the flat absmax of
    :func:`quantize_blockwise`, in the same order.
    """
    shape = tuple(shape)
    numel = 1
    for n in shape:
        numel *= n
    if len(shape) >= 2 and shape[0] > 0:
        row = numel // shape[0]
        if row % block_size == 0:
            return (shape[0], row // block_size)
    return (-(-numel // block_size),)
