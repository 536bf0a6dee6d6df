"""Wrappers of whole optimizers, as optax: ``MultiSteps`` (gradient accumulation) and
``inject_hyperparams`` (hyperparameters held in the state, changeable between steps).

Both run their own bookkeeping eagerly with torch ops and call the inner transform's
``update``, which fuses as usual (``backend=`` reaches it). ``ftopt.step`` of an
``inject_hyperparams`` optimizer runs its inner transform's step: the same fused kernel
as the plain chain, the state's hyperparameters read as kernel scalars. Inside another
transform, the fused backend walks into the wrapper (:meth:`_Injected.fused_inner`) and
calls :meth:`_Injected.load` and :meth:`_Injected.advance` around the whole step.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ftopt import tree as tree_lib
from ftopt._counts import (
    host_count,
    host_value,
    mark_device_decided,
    remember_count,
    remember_value,
)
from ftopt.base import GradientTransformation, check_transform, register_owner, register_state
from ftopt.combine import update_keywords
from ftopt.domains import check_int
from ftopt.rules import check_param, checked_params
from ftopt.update import step
from ftopt.validate import check_count, check_layout, check_leaf

__all__ = ["MultiSteps", "MultiStepsState", "InjectHyperparamsState", "inject_hyperparams"]


@register_state
class MultiStepsState(NamedTuple):
    """The state of :class:`MultiSteps` (optax's layout).

    Attributes:
        mini_step: micro-steps accumulated since the last inner step (0-d int32).
        gradient_step: inner steps taken (0-d int32).
        inner_opt_state: the inner transform's state.
        acc_grads: the accumulated gradients (a tree like the params, fp32 or wider).
    """

    mini_step: torch.Tensor
    gradient_step: torch.Tensor
    inner_opt_state: Any
    acc_grads: Any


def _count(value: int, device) -> torch.Tensor:
    out = torch.full((), value, dtype=torch.int32, device=device)
    remember_count(out, value)
    return out


def _read(count: torch.Tensor) -> int:
    """A counter's value: from the host mirror when known (no device read), else read."""
    known = host_count(count)
    return int(count) if known is None else known


def _device_of(tree: Any) -> torch.device | None:
    leaves = [t for t in tree_lib.leaves(tree) if isinstance(t, torch.Tensor)]
    return leaves[0].device if leaves else None


class MultiSteps:
    """Gradient accumulation over ``k`` micro-steps (optax.MultiSteps).

    On each call the gradient enters the accumulator: acc ← acc + (g − acc)/(n + 1) with
    ``use_grad_mean`` (the running mean of the ``n + 1`` gradients so far), else
    acc ← acc + g. On micro-steps 1 … k−1 the update is zero (``-0.0``: ``p + u`` keeps
    every param bit-identical) and the inner state is kept; on the k-th, the inner
    transform runs on the accumulated gradient, its update is returned, and the
    accumulator is reset. ``k = every_k_schedule(gradient_step)`` (an int or a function
    of the inner step count).

    ``should_skip_update_fn(updates, gradient_step, params) -> (skip, _)``: where ``skip``
    (a 0-d bool tensor) holds, the call changes nothing (optax's predicate; e.g. a
    non-finite gradient). The counters are read on the host from a mirror (no device read
    after ``init``); with ``should_skip_update_fn`` they are decided on the device and read
    each step.

    A ``None`` gradient leaf leaves that leaf's accumulator and inner state as they are
    (its update is ``None``), also on the k-th call.

    ``skip_zeros`` (SPEC §3, on the raw gradient of each call): where a micro-gradient is
    exactly zero the element's accumulator is kept bit-identical (a skipped micro-step does
    not count in its mean), and on the k-th call the element's update is zero and its
    accumulator and inner state are kept, so its accumulated gradient carries over to the
    next window.
    """

    mask_aware = True
    unfused_reason = ("MultiSteps runs eagerly: it accumulates gradients and calls the inner "
                      "transform (whose update fuses) every k micro-steps")

    def __init__(self, opt: GradientTransformation, every_k_schedule: int | Callable[[Any], int],
                 use_grad_mean: bool = True,
                 should_skip_update_fn: Callable | None = None):
        check_transform(opt, "MultiSteps opt")
        if not callable(every_k_schedule):
            check_int("MultiSteps", "every_k_schedule", every_k_schedule, minimum=1)
        self.inner = opt
        self.every_k_schedule = every_k_schedule
        self.use_grad_mean = bool(use_grad_mean)
        self.should_skip_update_fn = should_skip_update_fn
        register_owner(self)

    @property
    def transforms(self) -> tuple[GradientTransformation, ...]:
        return (self.inner,)

    def rebuild(self, transforms: Sequence[GradientTransformation]) -> GradientTransformation:
        return MultiSteps(transforms[0], self.every_k_schedule, self.use_grad_mean,
                          self.should_skip_update_fn).gradient_transformation()

    def gradient_transformation(self) -> GradientTransformation:
        """This object as a ``GradientTransformation``."""
        return GradientTransformation(self.init, self.update)

    def _k(self, gradient_step: int) -> int:
        k = self.every_k_schedule
        return int(k(gradient_step)) if callable(k) else k

    def init(self, params) -> MultiStepsState:
        paths, flat, _ = checked_params(params)
        inner_state = self.inner.init(params)
        device = _device_of(params)
        acc = tree_lib.map(lambda p: torch.zeros_like(p, dtype=torch.promote_types(
            p.dtype, torch.float32)), params)
        return MultiStepsState(_count(0, device), _count(0, device), inner_state, acc)

    def has_updated(self, state: MultiStepsState) -> torch.Tensor:
        """Whether the last call ran the inner step (a 0-d bool tensor, as optax)."""
        return (state.mini_step == 0) & (state.gradient_step > 0)

    def _flatten(self, updates, state: MultiStepsState, params):
        """Grads, accumulators, params and zero mask as flat lists over the params' tree
        (the accumulators' without params), checked leaf by leaf before anything is
        computed: errors name the leaf's path."""
        ref, against = (params, "params") if params is not None else (state.acc_grads,
                                                                      "state acc_grads")
        paths, ref_flat, spec = tree_lib.flatten_with_paths(ref)
        grads = tree_lib.flatten_like(spec, updates, "grads", paths, against)
        acc = tree_lib.flatten_like(spec, state.acc_grads, "state acc_grads", paths, against)
        for path, g, a, r in zip(paths, grads, acc, ref_flat):
            if not isinstance(a, torch.Tensor):
                raise TypeError(f"state acc_grads at {path}: expected a tensor, got "
                                f"{type(a).__name__}")
            check_layout("state acc_grads", path, a)
            if not a.is_floating_point():
                raise TypeError(f"state acc_grads at {path}: expected a floating-point "
                                f"tensor, got {a.dtype}")
            if params is not None:
                check_param(path, r)
                if a.shape != r.shape:
                    raise ValueError(f"state acc_grads at {path}: shape {tuple(a.shape)} "
                                     f"does not match the param's shape: expected "
                                     f"{tuple(r.shape)}")
            if g is not None:
                check_leaf(path, g, r if params is not None else a)
        return spec, paths, grads, acc

    def update(self, updates, state, params=None, **extra):
        """One micro-step (see the class docstring)."""
        if not isinstance(state, MultiStepsState):
            raise ValueError(f"MultiSteps expects a MultiStepsState, got "
                             f"{type(state).__name__} (a state made by another transform?)")
        spec, paths, grads, acc = self._flatten(updates, state, params)
        zero = extra.get("zero_mask")
        zero_flat = (tree_lib.flatten_like(spec, zero, "zero_mask", paths)
                     if zero is not None else [None] * len(grads))
        mini, step = _read(state.mini_step), _read(state.gradient_step)
        n = mini + 1

        def accumulate(a, g, z):
            if g is None:  # no gradient: the accumulator is kept as it is
                return a
            new = a + (g.to(a.dtype) - a) / n if self.use_grad_mean else a + g.to(a.dtype)
            return new if z is None else torch.where(z, a, new)

        new_acc = [accumulate(a, g, z) for a, g, z in zip(acc, grads, zero_flat)]
        device = state.mini_step.device
        if n < self._k(step):
            out = tree_lib.unflatten(spec, [None if g is None else torch.full_like(
                g, -0.0, dtype=torch.promote_types(g.dtype, torch.float32)) for g in grads])
            new = MultiStepsState(_count(n, device), state.gradient_step,
                                  state.inner_opt_state, tree_lib.unflatten(spec, new_acc))
        else:
            inner_in = tree_lib.unflatten(spec, [None if g is None else a
                                                 for a, g in zip(new_acc, grads)])
            out, inner_state = self.inner.update(inner_in, state.inner_opt_state, params,
                                                 **extra)
            # Reset, except where nothing entered (None) or the element was skipped.
            reset = [a if g is None else (torch.zeros_like(a) if z is None
                                          else torch.where(z, a, torch.zeros_like(a)))
                     for a, g, z in zip(new_acc, grads, zero_flat)]
            new = MultiStepsState(_count(0, device), _count(step + 1, device), inner_state,
                                  tree_lib.unflatten(spec, reset))
        if self.should_skip_update_fn is not None:
            skip, _ = self.should_skip_update_fn(updates, state.gradient_step, params)
            skip = torch.as_tensor(skip, device=device)
            out = tree_lib.map(lambda u: torch.where(skip, torch.full_like(u, -0.0), u), out)
            new = tree_lib.map(lambda n_, o: _keep(skip, n_, o), new, state)
        return out, new


def _keep(skip: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    out = torch.where(skip.to(new.device), old, new)
    if out.ndim == 0 and not out.is_floating_point():
        mark_device_decided(out)  # a counter chosen on the device: never read on the host
    return out


@register_state
class InjectHyperparamsState(NamedTuple):
    """The state of :func:`inject_hyperparams` (optax's layout).

    Attributes:
        count: steps taken (0-d int32; schedules are called with it).
        hyperparams: name -> 0-d fp32 tensor on the params' device. Change a value between
            steps and the next step uses it: assign a number
            (``state.hyperparams["learning_rate"] = 1e-4``: a fused step passes it to the
            kernel as an argument, no device work), or change a tensor in place
            (``.fill_(1e-4)``) or put in a new one: read on the device, no host read (the
            first such fused step compiles the kernel variant that reads its scalars from
            a buffer, once). No value change compiles anything else.
        inner_state: the inner transform's state.
    """

    count: torch.Tensor
    hyperparams: dict
    inner_state: Any


class _Injected:
    """The object behind :func:`inject_hyperparams`: the inner transform is built once
    per device with 0-d tensors ("holders") as its numeric hyperparameters; each step
    loads the state's values into them (a host number where the value is known on the
    host, else a copy on the device: never a host read).

    ``ftopt.step`` runs :meth:`wrapper_step`: the holders are loaded, the inner
    transform's own step runs (fused where it can be: the same kernel as the plain
    chain, the holders read as kernel scalars) and the count and schedules move on.
    """

    unfused_reason = ("inject_hyperparams inside another transform fuses once its state "
                      "is made (init) for params on one device; here it runs eagerly, its "
                      "inner update fused")
    step_note = ("inject_hyperparams: the inner transform's step, its hyperparameters read "
                 "from the state as kernel scalars (host numbers where known, else a device "
                 "buffer)")

    def __init__(self, factory: Callable[..., GradientTransformation], static: dict,
                 numeric: dict):
        self.factory, self.static, self.numeric = factory, static, numeric
        self.built: dict[Any, tuple[GradientTransformation, dict]] = {}
        register_owner(self)

    def _inner(self, device) -> tuple[GradientTransformation, dict]:
        key = str(device)
        if key not in self.built:
            holders = {k: torch.zeros((), dtype=torch.float32, device=device)
                       for k in self.numeric}
            for k, v in self.numeric.items():
                holders[k].copy_(torch.as_tensor(v(0) if callable(v) else v))
            inner = self.factory(**self.static, **holders)
            check_transform(inner, "inject_hyperparams: the factory's result")
            self.built[key] = (inner, holders)
        return self.built[key]

    @property
    def update_keywords(self) -> tuple[str, ...]:
        """The inner transform's (once built, found in :attr:`built`; before, one built
        from the initial values and not kept)."""
        if self.built:
            return ()
        return tuple(update_keywords(self.factory(**self.static, **{
            k: v(0) if callable(v) else v for k, v in self.numeric.items()})))

    def fused_inner(self) -> GradientTransformation | None:
        """The inner transform a fused step inside another transform runs
        (:func:`ftopt.stages.chain_stages` with ``injected=True`` walks into it): the one
        built by ``init``, if built for one device only, else ``None``."""
        if len(self.built) != 1:
            return None
        return next(iter(self.built.values()))[0]

    def stepped_inner(self, device) -> GradientTransformation:
        """The transform whose step :meth:`wrapper_step` runs for params on ``device``
        (``ftopt.explain`` shows its plan)."""
        return self._inner(device)[0]

    def _scheduled(self, k: str, count, known: int | None) -> float | torch.Tensor:
        """Hyperparameter ``k`` at step count ``count`` (``known``: its host value): a host
        number (fp32-rounded) where its value is known on the host, else a 0-d tensor."""
        v = self.numeric[k]
        if callable(v):
            v = v(known if known is not None else count)
        if isinstance(v, torch.Tensor):
            return v.reshape(()) if v.requires_grad else v.detach().reshape(())
        return _fp32(v)

    def init(self, params) -> InjectHyperparamsState:
        device = _device_of(params)
        inner, _ = self._inner(device)
        count = _count(0, device)
        hyper = {k: _as_tensor(self._scheduled(k, count, 0), device) for k in self.numeric}
        return InjectHyperparamsState(count, hyper, inner.init(params))

    def load(self, state) -> GradientTransformation:
        """Checks ``state`` (before anything is written), loads its hyperparameters into
        the holders and returns the inner transform."""
        if not isinstance(state, InjectHyperparamsState):
            raise ValueError(f"inject_hyperparams expects an InjectHyperparamsState, got "
                             f"{type(state).__name__} (a state made by another transform?)")
        check_count("inject_hyperparams", state.count)
        if not isinstance(state.hyperparams, dict):
            raise ValueError(f"inject_hyperparams: state.hyperparams must be a dict, got "
                             f"{type(state.hyperparams).__name__}")
        for k in self.numeric:
            if k not in state.hyperparams:
                raise ValueError(f"inject_hyperparams: state.hyperparams has no {k!r}")
            _check_value(k, state.hyperparams[k])
        inner, holders = self._inner(state.count.device)
        capturing = (state.count.device.type == "cuda"
                     and torch.cuda.is_current_stream_capturing())
        for k, holder in holders.items():
            value = state.hyperparams[k]
            if isinstance(value, torch.Tensor):
                known = None if capturing else host_value(value)
                if known is None:
                    holder.copy_(value)  # on the device; the holder's mirror is forgotten
                    continue
            else:
                known = _fp32(value)
            if host_value(holder) != known:
                holder.fill_(known)
                remember_value(holder, known)
        return inner

    def advance(self, state, inner_state, donate: bool) -> InjectHyperparamsState:
        """The state after a step: the count advanced, schedules called with it, numbers
        the caller put in ``state.hyperparams`` made tensors (donated: in place)."""
        device = state.count.device
        known = host_count(state.count)
        count = state.count.add_(1) if donate else state.count + 1
        if known is not None:
            remember_count(count, known + 1)
        hyper = state.hyperparams if donate else dict(state.hyperparams)
        for k, v in self.numeric.items():
            old = hyper[k]
            if not callable(v):  # plain values stay as the caller left them
                if not isinstance(old, torch.Tensor):
                    hyper[k] = _as_tensor(_fp32(old), device)
                continue
            value = self._scheduled(k, count, None if known is None else known + 1)
            if not (donate and isinstance(old, torch.Tensor)):
                hyper[k] = _as_tensor(value, device)
            elif isinstance(value, torch.Tensor):
                old.copy_(value)
            else:
                old.fill_(value)
                remember_value(old, value)
        return InjectHyperparamsState(count, hyper, inner_state)

    def update(self, updates, state, params=None, **extra):
        """The inner transform's update with the state's hyperparameters."""
        inner = self.load(state)
        out, inner_state = inner.update(updates, state.inner_state, params, **extra)
        return out, self.advance(state, inner_state, False)

    def wrapper_step(self, params, grads, state, *, donate: bool = False,
                     backend: str = "auto"):
        """``ftopt.step`` of the wrapped optimizer: the inner transform's step (fused
        where it can be) with the state's hyperparameters, then the count and schedules
        move on. Donated: every tensor of ``state`` is written in place."""
        inner = self.load(state)
        new_params, inner_state = step(inner, params, grads, state.inner_state,
                                       donate=donate, backend=backend)
        return new_params, self.advance(state, inner_state, donate)


def _as_tensor(value: float | torch.Tensor, device) -> torch.Tensor:
    """A 0-d fp32 tensor on ``device`` holding ``value``; a number's value is mirrored on
    the host (a fused step passes it to the kernel as an argument)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float32).reshape(())
    out = torch.full((), value, dtype=torch.float32, device=device)
    remember_value(out, value)
    return out


def _fp32(value) -> float:
    """``value`` rounded to fp32, as a 0-d fp32 tensor holds it."""
    return struct.unpack("f", struct.pack("f", float(value)))[0]


def _check_value(k: str, value) -> None:
    """A value of ``state.hyperparams``: a number or a 0-d floating-point tensor."""
    where = f"inject_hyperparams: state.hyperparams[{k!r}]"
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            raise TypeError(f"{where}: expected a floating-point tensor, got {value.dtype}")
        if value.ndim != 0:
            raise ValueError(f"{where}: expected a 0-d tensor, got shape "
                             f"{tuple(value.shape)}")
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: expected a number or a 0-d floating-point tensor, got "
                        f"{type(value).__name__}")


def inject_hyperparams(
    inner_factory: Callable[..., GradientTransformation],
    static_args: str | Sequence[str] = (),
) -> Callable[..., GradientTransformation]:
    """Moves an optimizer's numeric hyperparameters into its state (optax's
    ``inject_hyperparams``): ``inject_hyperparams(ftopt.adam)(learning_rate=1e-3)``.

    Every keyword that is a number, a 0-d tensor or a schedule (a function of the step
    count) becomes a 0-d fp32 tensor in ``state.hyperparams``; a schedule is evaluated with
    the count on every step. The inner transform is built once with tensor hyperparameters,
    so changing a value in the state between steps takes effect at the next step (see
    :class:`InjectHyperparamsState`). ``ftopt.step`` runs the inner transform's step (the
    same fused kernel as the plain chain), also inside another transform (a ``chain``
    after a clip, a ``partition`` branch: the whole chain's kernels).
    Names in ``static_args`` and non-numeric values (masks, booleans)
    are passed to ``inner_factory`` as they are.
    """
    static_names = {static_args} if isinstance(static_args, str) else set(static_args)

    def build(**hparams) -> GradientTransformation:
        static, numeric = {}, {}
        for k, v in hparams.items():
            is_number = isinstance(v, (int, float)) and not isinstance(v, bool)
            is_scalar = isinstance(v, torch.Tensor) and v.ndim == 0 and v.is_floating_point()
            if k in static_names or not (is_number or is_scalar or callable(v)):
                static[k] = v
            else:
                numeric[k] = v
        obj = _Injected(inner_factory, static, numeric)
        return GradientTransformation(obj.init, obj.update)

    return build
