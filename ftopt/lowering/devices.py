"""Whether Triton runs ftopt's kernels on a device, found once per device, before its
first fused call.

:func:`ftopt.lowering.plan.call_reason` admits CUDA, ROCm and XPU tensors, and not every
such device runs Triton's kernels: Triton targets NVIDIA GPUs of compute capability 7.0
and newer (a Pascal card, P100 or GTX 10x0, is 6.x), and its first compile on a machine
builds a launcher with the machine's C compiler (which slim containers lack) and calls
the device's assembler. Rather than fail inside Triton in the middle of a step, the first
fused call on a device checks its capability, then compiles and launches a one-element
probe kernel (its output is not read: no synchronisation). Where either fails, the
device's reason is kept for the process: ``backend="auto"`` then runs eagerly, with one
warning naming the reason, ``backend="fused"`` raises it, and ``ftopt.explain`` prints
it. Nothing is checked while a CUDA graph is captured (a launch there is recorded, not
run) nor under the Triton interpreter (which runs on the CPU).
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from ftopt.lowering import codegen, tiles

__all__ = ["MIN_CAPABILITY", "device_guard", "forget", "unsupported"]

#: The oldest NVIDIA compute capability Triton compiles for.
MIN_CAPABILITY = (7, 0)

_PROBE_SOURCE = ("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
                 "def ftopt_probe(out, value):\n    tl.store(out, value)\n")
_PROBE_VALUE = 7

_FOUND: dict[str, str | None] = {}  # str(device) -> its reason, or None: it runs kernels


def device_guard(device: torch.device):
    """Makes ``device`` the current one while kernels launch (Triton launches on the
    current device and stream); nothing to do when it already is."""
    module = getattr(torch, device.type, None)
    current = getattr(module, "current_device", None)
    if device.index is None or current is None or current() == device.index:
        return contextlib.nullcontext()
    return module.device(device.index)


def unsupported(device: torch.device) -> str | None:
    """Why Triton cannot run ftopt's kernels on ``device`` (``None``: it can), found on
    the first call for the device and kept; a device found unsupported is named in one
    warning, the first time."""
    key = str(device)
    if key in _FOUND:
        return _FOUND[key]
    if tiles.INTERPRETING or device.type == "cpu" or _capturing(device):
        return None
    reason = _reason(device)
    _FOUND[key] = reason
    if reason is not None:
        warnings.warn(f"ftopt: fused steps are off on {key}, steps there run eagerly: "
                      f"{reason}", RuntimeWarning, stacklevel=2)
    return reason


def _capturing(device: torch.device) -> bool:
    return (device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.is_current_stream_capturing())


def _reason(device: torch.device) -> str | None:
    if device.type == "cuda" and torch.version.hip is None:
        major, minor = _capability(device)
        if (major, minor) < MIN_CAPABILITY:
            want = ".".join(map(str, MIN_CAPABILITY))
            return (f"Triton compiles for NVIDIA GPUs of compute capability {want} or "
                    f"newer; {device} is {major}.{minor}")
    try:
        _probe(device)
    except Exception as err:  # kept as the device's reason: auto runs eagerly, fused raises
        text = str(err).strip().splitlines()
        return (f"Triton could not compile and launch a probe kernel on {device} "
                f"({type(err).__name__}: {text[0] if text else ''}); Triton needs a C "
                "compiler (gcc or clang, or set CC) and the GPU's toolkit")
    return None


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _probe(device: torch.device) -> torch.Tensor:
    """Compiles and launches a kernel that stores one number; returns its output, unread
    (a read would synchronise: a first step may run where that is an error, under
    ``torch.cuda.set_sync_debug_mode("error")``)."""
    kernel = codegen.compile_source(_PROBE_SOURCE, "ftopt_probe")
    out = torch.zeros(1, dtype=torch.int32, device=device)
    with device_guard(device):
        kernel[(1,)](out, _PROBE_VALUE)
    return out


def forget() -> None:
    """Drops what was found (tests; a process whose toolchain was mended)."""
    _FOUND.clear()
