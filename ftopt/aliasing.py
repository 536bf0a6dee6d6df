"""Donated params must not share memory: a step that writes each in place would write
one param's result over another's (or read it half-updated)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["check_disjoint"]


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` that ``t``'s elements occupy (strides are >= 0)."""
    start = t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def check_disjoint(paths: Sequence[str], tensors: Sequence, what: str = "params") -> None:
    """Raises ``ValueError`` naming both paths if two of ``tensors`` overlap in memory.

    Views that interleave without sharing an element (``t[::2]`` and ``t[1::2]``) count
    as overlapping: their spans do. Empty tensors, sparse ones and tensors without storage
    (``meta``, wrapper subclasses) occupy nothing here.
    """
    spans = []
    for path, t in zip(paths, tensors):
        if (not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.numel() == 0
                or t.device.type == "meta"):
            continue  # (what is not a dense tensor is refused by the leaf checks)
        try:
            start, end = _span(t)
        except RuntimeError:  # a tensor without storage of its own (a wrapper subclass)
            continue
        spans.append((str(t.device), start, end, path))
    spans.sort()
    reach = None  # (device, end, path) of the span reaching furthest so far
    for device, start, end, path in spans:
        if reach is not None and reach[0] == device and start < reach[1]:
            raise ValueError(
                f"{what} at {reach[2]} and {path} share memory: a donated step writes "
                f"each in place, so they must not overlap (pass separate tensors, or "
                f"donate=False)")
        if reach is None or reach[0] != device or end > reach[1]:
            reach = (device, end, path)
