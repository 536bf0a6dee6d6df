"""The core's one door to its backends.

The core (types, rules, transforms, combinators, ``step``) never imports a backend.
Backends install themselves here by role and module name, in ``ftopt/__init__.py``, and
are imported on first use, so ``import ftopt`` does not import Triton:

* ``fused``: runs a step or an update as generated kernels (:mod:`ftopt.lowering`). Its
  ``step``/``update`` return ``(result, None)``, or ``(None, reason)``: a declared
  "cannot run this" that ``backend="auto"`` falls back on and ``explain`` prints. Its
  ``compiled_step`` is ``step`` under ``torch.compile``.
* ``chunked``: runs eager steps and rule bodies as programs over cache-sized chunks of
  all leaves on the CPU (:mod:`ftopt.chunked`); ``None`` where it does not apply.
* ``distributed``: runs a step or an update whose leaves are ``DTensor`` shards (FSDP2
  and the like) on each rank's local tensors (:mod:`ftopt.distributed`); the core calls
  it when :func:`ftopt.shards.any_dtensor` finds one.

A backend whose module cannot be imported (no Triton) leaves its role empty, and
:func:`missing` says why.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
from typing import Any

import torch

from ftopt import shards
from ftopt import tree as tree_lib
from ftopt.base import GradientTransformation

__all__ = ["install", "backend", "loaded", "missing", "fused_for", "eager_updates",
           "in_eager_update", "update_entry"]

_MODULES: dict[str, str] = {}  # role -> module name
_LOADED: dict[str, Any] = {}
_FAILED: dict[str, str] = {}


def install(role: str, module: str, *, now: bool = False) -> None:
    """Make ``module`` the backend of ``role``: imported on first use, or ``now`` (a
    backend looked up while ``torch.compile`` traces must already be loaded: Dynamo does
    not trace an import)."""
    _MODULES[role] = module
    _LOADED.pop(role, None)
    _FAILED.pop(role, None)
    if now:
        backend(role)


def backend(role: str) -> Any:
    """The backend module of ``role``, or ``None`` (none installed, or its import failed:
    :func:`missing` says why)."""
    found = _LOADED.get(role)
    if found is not None or role in _FAILED:
        return found
    name = _MODULES.get(role)
    if name is None:
        _FAILED[role] = f"no {role} backend is installed"
        return None
    try:
        found = importlib.import_module(name)
    except ImportError as err:  # an optional dependency (Triton) is not there
        hint = ""
        if (err.name or "").split(".")[0] == "triton":
            hint = ("; install Triton for fused steps on a GPU: pip install 'ftopt[gpu]' "
                    "(CUDA, ROCm and XPU builds of torch ship it)")
        _FAILED[role] = f"the {role} backend cannot be imported ({err}){hint}"
        return None
    _LOADED[role] = found
    return found


def loaded(role: str) -> Any:
    """The backend module of ``role`` if it has been imported already, else ``None``."""
    return _LOADED.get(role)


def missing(role: str) -> str | None:
    """Why :func:`backend` gives ``None`` for ``role`` (``None`` if it gives a backend)."""
    return None if backend(role) is not None else _FAILED[role]


def fused_for(choice: str, *trees: Any) -> Any:
    """The fused backend for a step or update asked with ``backend=choice`` over
    ``trees``, or ``None``. ``"auto"`` fuses only on an accelerator, so while no step has
    loaded the backend, ``"auto"`` over leaves that are all on the CPU (or meta) runs
    eagerly without importing it: a CPU-only program never imports Triton."""
    if choice == "eager":
        return None
    found = _LOADED.get("fused")
    if found is not None or choice != "auto":
        return found if found is not None else backend("fused")
    for tree in trees:
        for leaf in tree_lib.leaves(tree):
            if isinstance(leaf, torch.Tensor) and leaf.device.type not in ("cpu", "meta"):
                return backend("fused")
    return None


# Set while updates run eagerly: the updates a chain (or an eager step) calls inside its
# own eager update run eagerly too, instead of each fusing on its own.
_IN_EAGER_UPDATE = contextvars.ContextVar("ftopt_in_eager_update", default=False)
_UPDATE_BACKENDS = ("auto", "fused", "eager")


@contextlib.contextmanager
def eager_updates():
    """Within it, ``update`` calls run eagerly."""
    token = _IN_EAGER_UPDATE.set(True)
    try:
        yield
    finally:
        _IN_EAGER_UPDATE.reset(token)


def in_eager_update() -> bool:
    return _IN_EAGER_UPDATE.get()


def update_entry(obj: Any, updates: Any, state: Any, params: Any, extra: dict, run_eager):
    """``update`` of a chain or rule transform called by the user: fused where it can be
    (a ``backend`` keyword, as for :func:`ftopt.step`, forces a path), else
    ``run_eager()``. Updates nested in an eager one run eagerly."""
    if _IN_EAGER_UPDATE.get():
        return run_eager()
    choice = extra.get("backend", "auto")
    if choice not in _UPDATE_BACKENDS:
        raise ValueError(f"backend must be one of {_UPDATE_BACKENDS}, got {choice!r}")
    compiling = torch.compiler.is_compiling()
    distributed = loaded("distributed") if not compiling else None
    if distributed is not None:
        # DTensors updated before: their unwrap and rewrap, cached.
        result = distributed.cached_update(obj, updates, state, params, extra)
        if result is not None:
            return result
    fusible = choice != "eager" and set(extra) <= {"backend"} and not compiling
    fused = fused_for(choice, updates, params) if fusible else None
    tx = GradientTransformation(obj.init, obj.update) if fused is not None else None
    if fused is not None:
        # A cached fused update proves its leaves plain tensors: no DTensor scan.
        result = fused.cached_update(tx, updates, state, params, choice)
        if result is not None:
            return result
    if shards.any_dtensor(updates, params):  # each rank updates its shards
        distributed = backend("distributed")
        if distributed is None:
            raise RuntimeError(f"DTensor updates: {missing('distributed')}")
        return distributed.update(obj, updates, state, params, extra)
    if fusible and (fused is not None or choice == "fused"):
        if fused is None:
            reason = missing("fused")
        else:
            result, reason = fused.update(tx, updates, state, params, choice, cached=False)
            if result is not None:
                return result
        if choice == "fused":
            raise RuntimeError(f"update(backend='fused') cannot fuse: {reason}")
    with eager_updates():
        return run_eager()
