"""Host mirror of step counts (and of hyperparameter tensors whose value the caller
knows), so per-step scalars need no device synchronisation.

A step count is a 0-d integer tensor on the params' device. When ftopt creates a count
tensor it remembers its value here (keyed by the tensor object, dropped when the tensor
dies), so the next step computes bias corrections on the host without reading the device.
A count ftopt did not create (loaded from a checkpoint, or modified by the caller in
place) is read once. A count whose value was decided on the device (``apply_if_finite``
keeps or advances it on a device flag) is marked :func:`device_decided`: it is never read,
and the steps that use it compute their scalars on the device.
"""

from __future__ import annotations

import weakref

import torch

_mirror: dict[int, tuple[weakref.ref, int, int]] = {}
# Keyed by id (a WeakSet would compare tensors with ``==``, which reads the device).
_device_decided: dict[int, weakref.ref] = {}
# (registry, key) of the tensors that died since the last purge. A weak reference's
# callback runs wherever the garbage collector does, also while torch.compile traces a
# function that reads these dicts (Dynamo then found a key gone that it had seen:
# KeyError): the callbacks only append here, and the dicts change in ftopt's own calls.
_dead: list[tuple[dict, int]] = []


def _forget(registry: dict, key: int):
    return lambda _: _dead.append((registry, key))


def _purge() -> None:
    """Drop the entries of the tensors that died (unless the key is a new tensor's)."""
    while _dead:
        registry, key = _dead.pop()
        entry = registry.get(key)
        ref = entry[0] if isinstance(entry, tuple) else entry
        if ref is not None and ref() is None:
            del registry[key]


def remember_count(count: torch.Tensor, value: int) -> None:
    """Record that ``count`` holds ``value``."""
    if not torch.compiler.is_compiling() and _dead:  # (in a trace: neither read)
        _purge()
    key = id(count)
    entry = _mirror.get(key)
    if entry is not None and entry[0]() is count:  # (every step: the same weak reference)
        _mirror[key] = (entry[0], value, count._version)
        return
    _mirror[key] = (weakref.ref(count, _forget(_mirror, key)), value, count._version)


def new_count(value: int, device) -> torch.Tensor:
    """A 0-d int32 count on ``device`` holding ``value``, its value remembered."""
    out = torch.full((), value, dtype=torch.int32, device=device)
    remember_count(out, value)
    return out


def host_count(count: torch.Tensor) -> int | None:
    """The value of ``count`` if known without reading the device, else ``None``."""
    entry = _mirror.get(id(count))
    if entry is None:
        return None
    ref, value, version = entry
    if ref() is not count or count._version != version:
        return None
    return value


def remember_value(tensor: torch.Tensor, value: float) -> None:
    """Record that the 0-d hyperparameter ``tensor`` holds ``value`` (as for counts: an
    in-place change of the tensor, which bumps its version, forgets it). The fused path
    then passes the value as a kernel argument with no device work; see
    :func:`ftopt.Optimizer.step`, which writes its groups' live values this way."""
    remember_count(tensor, value)


def mirror_records(keys: tuple) -> tuple:
    """The host-mirror records of the live tensors whose ids are ``keys`` (one C-level
    pass): a record is replaced whenever a value is recorded, so while a tensor's record
    (by identity) and version stay the same, so does its :func:`host_value`."""
    return tuple(map(_mirror.get, keys))


def host_value(tensor: torch.Tensor) -> float | None:
    """The value of a tensor recorded by :func:`remember_value`, if still current."""
    return host_count(tensor)


def mark_device_decided(count: torch.Tensor) -> None:
    """Record that ``count``'s value was chosen on the device: reading it would wait for
    the device, so no step reads it (see the module docstring)."""
    if not torch.compiler.is_compiling() and _dead:  # (in a trace: neither read)
        _purge()
    key = id(count)
    _mirror.pop(key, None)
    _device_decided[key] = weakref.ref(count, _forget(_device_decided, key))


def device_decided(count: torch.Tensor) -> bool:
    """Whether ``count`` was marked by :func:`mark_device_decided`."""
    ref = _device_decided.get(id(count))
    return ref is not None and ref() is count
