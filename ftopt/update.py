"""``apply_updates`` and ``step``: the entry points that change params."""

from __future__ import annotations

from typing import Any

import torch

from ftopt import dispatch, shards
from ftopt import tree as tree_lib
from ftopt._counts import device_decided, host_count, mark_device_decided, remember_count
from ftopt.aliasing import check_disjoint
from ftopt.base import GradientTransformation, check_transform
from ftopt.numerics import keep_nan_bits

__all__ = ["apply_updates", "step"]

_BACKENDS = ("auto", "fused", "eager")


def _apply_leaf(path: str, p, u):
    if u is None:
        return p
    if not isinstance(u, torch.Tensor) or not isinstance(p, torch.Tensor):
        raise TypeError(f"apply_updates at {path}: expected tensors, got "
                        f"{type(p).__name__} and {type(u).__name__}")
    complex_pair = p.is_complex() and u.is_complex()  # (split_real_and_imaginary's)
    if not complex_pair and (not p.is_floating_point() or not u.is_floating_point()):
        which, t = ("param", p) if not p.is_floating_point() else ("update", u)
        raise TypeError(f"apply_updates at {path}: expected a floating-point {which}, got "
                        f"{t.dtype}")
    if p.layout != torch.strided or u.layout != torch.strided:
        which, t = ("param", p) if p.layout != torch.strided else ("update", u)
        raise TypeError(f"apply_updates at {path}: the {which} is a sparse tensor "
                        f"({t.layout}); expected dense tensors (densify with .to_dense())")
    if u.shape != p.shape:
        raise ValueError(f"apply_updates at {path}: update shape {tuple(u.shape)} does not "
                         f"match param shape {tuple(p.shape)}")
    if u.device != p.device:
        raise ValueError(f"apply_updates at {path}: update on {u.device}, expected the "
                         f"param's device {p.device}")
    least = torch.complex64 if p.is_complex() else torch.float32
    compute = torch.promote_types(torch.promote_types(p.dtype, u.dtype), least)
    out = (p.to(compute) + u.to(compute)).to(p.dtype)
    if p.dtype in (torch.float16, torch.bfloat16):  # p + (-0.0) is p, a NaN's bits too
        out = keep_nan_bits(p, out)
    return out


def apply_updates(params: Any, updates: Any) -> Any:
    """p ← p + u for every leaf, in fp32 (or wider), rounded once to the param's dtype
    (complex params and updates, as :func:`ftopt.split_real_and_imaginary` gives: in
    complex64 or wider).

    A ``None`` update leaves its param unchanged. Pure: returns new tensors.
    """
    paths, flat_p, spec = tree_lib.flatten_with_paths(params)
    flat_u = tree_lib.flatten_like(spec, updates, "updates", paths)
    return tree_lib.unflatten(spec, [_apply_leaf(*a) for a in zip(paths, flat_p, flat_u)])


def step(
    tx: GradientTransformation,
    params: Any,
    grads: Any,
    state: Any,
    *,
    donate: bool = False,
    backend: str = "auto",
    **extra: Any,
) -> tuple[Any, Any]:
    """One optimizer step: ``update`` then ``apply_updates``, fused where it can be.

    Args:
        tx: the transform.
        params, grads, state: pytrees (grads may hold ``None`` for "no gradient").
        donate: the caller gives up ``params`` and ``state``: they are updated in place
            and the same tensor objects are returned. With ``donate=False`` nothing passed
            in is modified.
        backend: ``"auto"`` (fused Triton kernels where :func:`ftopt.explain` says so,
            eager otherwise), ``"fused"`` (raise if the step cannot fuse) or ``"eager"``.
        **extra: keywords of ``tx.update`` (the loss as ``value=`` for ``polyak_sgd``,
            ``momo`` and the line searches, with ``grad=`` and ``value_fn=``; ``obj_fn=``
            for ``sophia``; ``grad_fn=`` for ``sam``'s opaque mode): the step then runs
            eagerly, as ``tx.update(grads, state, params, **extra)`` and
            ``apply_updates``.

    Returns:
        ``(new_params, new_state)``.
    """
    check_transform(tx, "step: argument tx")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if extra:
        return _step_with(tx, params, grads, state, donate, backend, extra)
    compiling = torch.compiler.is_compiling()
    wrapper_step = getattr(getattr(tx.update, "__self__", None), "wrapper_step", None)
    if wrapper_step is not None and not compiling:
        # A wrapper whose bookkeeping runs around its inner transform's step
        # (inject_hyperparams): that step fuses as the plain chain's does.
        return wrapper_step(params, grads, state, donate=donate, backend=backend)
    if not donate and not compiling:
        distributed = dispatch.loaded("distributed")
        if distributed is not None:
            # DTensors stepped before: their unwrap and rewrap, cached.
            result = distributed.cached_call(tx, params, grads, state, backend)
            if result is not None:
                return result
    if compiling:  # (no tree scan inside a trace)
        fused = dispatch.backend("fused") if backend != "eager" else None
    else:
        fused = dispatch.fused_for(backend, params)
    if fused is not None and not compiling:
        distributed = dispatch.loaded("distributed") if donate else None
        if distributed is not None:
            # DTensors stepped before: the cached step over their local tensors.
            result = distributed.cached_step(tx, params, grads, state, backend)
            if result is not None:
                return result
        # A cached fused step first: its tensor check proves the leaves plain tensors, so
        # the common step pays for no DTensor scan (a flatten of both trees).
        result = fused.cached_step(tx, params, grads, state, donate, backend)
        if result is not None:
            return result
    if shards.any_dtensor(params, grads):  # FSDP2 & co.: each rank steps its shards
        return _distributed().step(tx, params, grads, state, donate, backend)
    if compiling:
        compiled = dispatch.backend("compile")
        if compiled is not None:
            return compiled.compiled_step(tx, params, grads, state, donate, backend)
    if backend != "eager" and (fused is not None or backend == "fused"):
        if fused is None:
            reason = dispatch.missing("fused")
        else:
            result, reason = fused.step(tx, params, grads, state, donate, backend,
                                        cached=False)
            if result is not None:
                return result
        if backend == "fused":
            raise RuntimeError(f"step(backend='fused') cannot fuse: {reason}")
    return _eager_step(tx, params, grads, state, donate)


def _distributed():
    found = dispatch.backend("distributed")
    if found is None:
        raise RuntimeError(f"DTensor params: {dispatch.missing('distributed')}")
    return found


def _step_with(tx, params, grads, state, donate: bool, backend: str, extra: dict):
    """A step whose ``update`` takes ``extra`` keywords: eager, on plain tensors."""
    if backend == "fused":
        raise RuntimeError(f"step(backend='fused') cannot fuse: the keywords "
                           f"{sorted(extra)} go to an eager update")
    if shards.any_dtensor(params, grads):
        raise TypeError(f"step: DTensor params with the keywords {sorted(extra)}: call "
                        "tx.update(grads, state, params, ...) and ftopt.apply_updates")
    return _eager_step(tx, params, grads, state, donate, extra)


def _eager_step(tx, params, grads, state, donate: bool, extra: dict | None = None):
    if donate:
        paths, flat, _ = tree_lib.flatten_with_paths(params)
        check_disjoint(paths, flat)
        # A donated step writes into the given tensors: never differentiable, so no
        # autograd graph is built for it (nn.Parameters in grad mode take the fast path).
        with torch.no_grad():
            return _eager(tx, params, grads, state, True, extra)
    return _eager(tx, params, grads, state, False, extra)


def _eager(tx, params, grads, state, donate: bool, extra: dict | None = None):
    # A chain of elementwise rules on the CPU: update + apply in one chunked pass.
    chunked = dispatch.backend("chunked") if not extra else None
    if chunked is not None:
        result = chunked.step(tx, params, grads, state, donate)
        if result is not None:
            return result
    with dispatch.eager_updates():  # the fused path was ruled out (or not asked for)
        updates, new_state = tx.update(grads, state, params, **(extra or {}))
    new_params = apply_updates(params, updates)
    if donate:
        return _write_back(params, new_params), _write_back(state, new_state)
    return new_params, new_state


def _write_back(old: Any, new: Any) -> Any:
    """Copy ``new`` into the donated tensors of ``old`` and return ``old``'s objects.

    A copied step count keeps what the host knows of the new one (its value, or that the
    device decides it): the next step then computes its scalars as it would from ``new``,
    with no device read (see :func:`ftopt.eager.known_count`)."""
    old_flat, old_spec = tree_lib.leaves(old), tree_lib.structure(old)
    new_flat = old_spec.flatten_up_to(new)
    kept = True
    with torch.no_grad():
        for o, n in zip(old_flat, new_flat):
            if not isinstance(o, torch.Tensor):
                kept = kept and o is n
            elif o is not n:
                o.copy_(n)
                if o.ndim == 0 and not o.is_floating_point():
                    _carry_count(o, n)
    if kept:
        return old
    # A leaf that is no tensor (a number the caller assigned into inject_hyperparams'
    # state) cannot be written in place: the new value takes its place.
    return tree_lib.unflatten(old_spec, [o if isinstance(o, torch.Tensor) else n
                                         for o, n in zip(old_flat, new_flat)])


def _carry_count(old: torch.Tensor, new: torch.Tensor) -> None:
    if device_decided(new):
        mark_device_decided(old)
        return
    known = host_count(new)
    if known is not None:
        remember_count(old, known)
