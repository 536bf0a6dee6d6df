"""Host mirror of step counts, so per-step scalars need no device synchronisation.

A step count is a 0-d integer tensor on the params' device. When ftopt creates a count
tensor it remembers its value here (keyed by the tensor object, dropped when the tensor
dies), so the next step computes bias corrections on the host without reading the device.
A count ftopt did not create (loaded from a checkpoint, or modified by the caller in
place) is read once.
"""

from __future__ import annotations

import weakref

import torch

_mirror: dict[int, tuple[weakref.ref, int, int]] = {}


def remember_count(count: torch.Tensor, value: int) -> None:
    """Record that ``count`` holds ``value``."""
    key = id(count)
    ref = weakref.ref(count, lambda _, key=key: _mirror.pop(key, None))
    _mirror[key] = (ref, value, count._version)


def host_count(count: torch.Tensor) -> int | None:
    """The value of ``count`` if known without reading the device, else ``None``."""
    entry = _mirror.get(id(count))
    if entry is None:
        return None
    ref, value, version = entry
    if ref() is not count or count._version != version:
        return None
    return value
