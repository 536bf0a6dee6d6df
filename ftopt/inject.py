"""optax's ``inject_hyperparams``: an optimizer's numeric hyperparameters held in its
state, changeable between steps, scheduled by the step count or by a stateful schedule
(:mod:`ftopt.schedules.stateful`).

The wrapper's bookkeeping runs eagerly with torch ops around the inner transform's
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
from ftopt._counts import host_count, host_value, new_count, remember_count, remember_value
from ftopt.base import GradientTransformation, check_transform, register_owner, register_state
from ftopt.combine import update_keywords
from ftopt.eager import known_count
from ftopt.schedules.stateful import StatefulSchedule
from ftopt.update import step
from ftopt.validate import check_count

__all__ = ["InjectHyperparamsState", "InjectStatefulHyperparamsState", "inject_hyperparams",
           "inject_stateful_hyperparams"]


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


@register_state
class InjectStatefulHyperparamsState(NamedTuple):
    """The state of :func:`inject_hyperparams` with a stateful schedule, and of
    :func:`inject_stateful_hyperparams` (optax's layout).

    Attributes:
        count: steps taken (0-d int32).
        hyperparams: as :class:`InjectHyperparamsState`'s; a stateful schedule's entry
            holds the value of the last step (from ``init``: its value at its initial
            state), and changing it has no effect.
        hyperparams_states: name -> the state of that hyperparameter's stateful schedule.
        inner_state: the inner transform's state.
    """

    count: torch.Tensor
    hyperparams: dict
    hyperparams_states: dict
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
                 numeric: dict, stateful: dict, keep_states: bool):
        self.factory, self.static, self.numeric = factory, static, numeric
        self.stateful: dict[str, StatefulSchedule] = stateful
        # The state's type: InjectStatefulHyperparamsState (its inner_state field 3), or
        # InjectHyperparamsState (field 2; the path :mod:`ftopt.stages` walks into).
        self.keep_states = keep_states or bool(stateful)
        self.inner_field = 3 if self.keep_states else 2
        self.built: dict[Any, tuple[GradientTransformation, dict]] = {}
        register_owner(self)

    def _initial(self) -> dict:
        """Each numeric hyperparameter's value at step 0, from the host."""
        out = {k: v(0) if callable(v) else v for k, v in self.numeric.items()}
        out.update({k: _value(k, f(f.init())) for k, f in self.stateful.items()})
        return out

    def _inner(self, device) -> tuple[GradientTransformation, dict]:
        key = str(device)
        if key not in self.built:
            initial = self._initial()
            holders = {k: torch.zeros((), dtype=torch.float32, device=device)
                       for k in initial}
            for k, v in initial.items():
                holders[k].copy_(torch.as_tensor(v))
            inner = self.factory(**self.static, **holders)
            check_transform(inner, "inject_hyperparams: the factory's result")
            self.built[key] = (inner, holders)
        return self.built[key]

    @property
    def update_keywords(self) -> tuple[str, ...]:
        """The inner transform's (once built, found in :attr:`built`; before, one built
        from the initial values and not kept), and those the stateful schedules read."""
        own = tuple(k for f in self.stateful.values()
                    for k in getattr(f, "update_keywords", ()))
        if self.built:
            return own
        return own + tuple(update_keywords(self.factory(**self.static, **self._initial())))

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

    def init(self, params) -> InjectHyperparamsState | InjectStatefulHyperparamsState:
        device = tree_lib.state_device(tree_lib.leaves(params))
        inner, _ = self._inner(device)
        count = new_count(0, device)
        hyper = {k: _as_tensor(self._scheduled(k, count, 0), device) for k in self.numeric}
        if not self.keep_states:
            return InjectHyperparamsState(count, hyper, inner.init(params))
        states = {k: _on_device(f.init(), device) for k, f in self.stateful.items()}
        hyper.update({k: _as_tensor(_value(k, f(states[k])), device)
                      for k, f in self.stateful.items()})
        return InjectStatefulHyperparamsState(count, hyper, states, inner.init(params))

    def _scheduled_now(self, state, extra: dict) -> dict:
        """The stateful schedules' values for the step about to run, checked."""
        extra = _for_schedules(extra)
        return {k: _value(k, f(state.hyperparams_states[k], **extra))
                for k, f in self.stateful.items()}

    def load(self, state, extra: dict | None = None) -> GradientTransformation:
        """Checks ``state`` (before anything is written), loads its hyperparameters (a
        stateful schedule's: its value now, given the step's keywords ``extra``) into the
        holders and returns the inner transform."""
        kind = InjectStatefulHyperparamsState if self.keep_states else InjectHyperparamsState
        if not isinstance(state, kind):
            raise ValueError(f"inject_hyperparams expects an {kind.__name__}, got "
                             f"{type(state).__name__} (a state made by another transform?)")
        check_count("inject_hyperparams", state.count)
        if not isinstance(state.hyperparams, dict):
            raise ValueError(f"inject_hyperparams: state.hyperparams must be a dict, got "
                             f"{type(state.hyperparams).__name__}")
        for k in self.numeric:
            if k not in state.hyperparams:
                raise ValueError(f"inject_hyperparams: state.hyperparams has no {k!r}")
            _check_value(k, state.hyperparams[k])
        values = dict(state.hyperparams)
        if self.keep_states:
            if not isinstance(state.hyperparams_states, dict):
                raise ValueError(f"inject_hyperparams: state.hyperparams_states must be a "
                                 f"dict, got {type(state.hyperparams_states).__name__}")
            missing = sorted(set(self.stateful) - set(state.hyperparams_states))
            if missing:
                raise ValueError(f"inject_hyperparams: state.hyperparams_states has no "
                                 f"{missing[0]!r} (the state of its stateful schedule)")
            values.update(self._scheduled_now(state, extra or {}))
        inner, holders = self._inner(state.count.device)
        capturing = (state.count.device.type == "cuda"
                     and torch.cuda.is_current_stream_capturing())
        for k, holder in holders.items():
            value = values[k]
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

    def advance(self, state, inner_state, donate: bool, extra: dict | None = None):
        """The state after a step: the count advanced, schedules called with it, numbers
        the caller put in ``state.hyperparams`` made tensors (donated: in place); the
        stateful schedules' states updated with the step's keywords ``extra``, their
        entries the values the step used."""
        device = state.count.device
        known = known_count(state.count)
        used = self._scheduled_now(state, extra or {}) if self.stateful else {}
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
        if not self.keep_states:
            return InjectHyperparamsState(count, hyper, inner_state)
        states = state.hyperparams_states if donate else dict(state.hyperparams_states)
        for k, f in self.stateful.items():
            hyper[k] = _as_tensor(used[k], device)
            states[k] = _on_device(f.update(state.hyperparams_states[k],
                                            **_for_schedules(extra or {})), device)
        return InjectStatefulHyperparamsState(count, hyper, states, inner_state)

    def update(self, updates, state, params=None, **extra):
        """The inner transform's update with the state's hyperparameters."""
        inner = self.load(state, extra)
        out, inner_state = inner.update(updates, state.inner_state, params, **extra)
        return out, self.advance(state, inner_state, False, extra)

    def wrapper_step(self, params, grads, state, *, donate: bool = False,
                     backend: str = "auto"):
        """``ftopt.step`` of the wrapped optimizer: the inner transform's step (fused
        where it can be) with the state's hyperparameters, then the count and schedules
        move on. Donated: every tensor of ``state`` is written in place."""
        inner = self.load(state)
        new_params, inner_state = step(inner, params, grads, state.inner_state,
                                       donate=donate, backend=backend)
        return new_params, self.advance(state, inner_state, donate)


def _for_schedules(extra: dict) -> dict:
    """The step's keywords a stateful schedule sees: the caller's (not ftopt's own
    ``backend`` and ``zero_mask``)."""
    return {k: v for k, v in extra.items() if k not in ("backend", "zero_mask")}


def _on_device(tree: Any, device) -> Any:
    """A stateful schedule's state with its tensors on ``device`` (a count's host mirror
    kept)."""
    def move(x):
        if not isinstance(x, torch.Tensor) or x.device == torch.device(device):
            return x
        out = x.to(device)
        known = host_count(x) if x.ndim == 0 and not x.is_floating_point() else None
        if known is not None:
            remember_count(out, known)
        return out
    return tree_lib.map(move, tree)


def _value(k: str, value) -> float | torch.Tensor:
    """A stateful schedule's value for hyperparameter ``k``, checked."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.reshape(())
    _check_value(k, value, "the stateful schedule's value")
    return value if isinstance(value, torch.Tensor) else _fp32(value)


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


def _check_value(k: str, value, what: str = "") -> None:
    """A value of ``state.hyperparams`` (or ``what``): a number or a 0-d floating-point
    tensor."""
    where = f"inject_hyperparams: {what or f'state.hyperparams[{k!r}]'}"
    where += f" for {k!r}" if what else ""
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

    A keyword may also be a stateful schedule (:class:`ftopt.StatefulSchedule`: ``init``,
    ``update`` and ``__call__`` of its state and the step's keywords). Its state is kept
    in ``state.hyperparams_states`` (the state is then an
    :class:`InjectStatefulHyperparamsState`); each step uses its value at its state and
    the step's keywords, then updates its state with them.
    """
    return _injector(inner_factory, static_args, False)


def inject_stateful_hyperparams(
    inner_factory: Callable[..., GradientTransformation],
    static_args: str | Sequence[str] = (),
) -> Callable[..., GradientTransformation]:
    """:func:`inject_hyperparams` whose state is always an
    :class:`InjectStatefulHyperparamsState` (optax's ``inject_stateful_hyperparams``),
    also when no keyword is a stateful schedule. A plain schedule is called with the
    wrapper's count, as in :func:`inject_hyperparams` (the values optax's
    ``WrappedSchedule`` gives: :class:`ftopt.WrappedSchedule` wraps one explicitly)."""
    return _injector(inner_factory, static_args, True)


def _injector(inner_factory, static_args, keep_states: bool):
    if not callable(inner_factory):
        raise TypeError(f"inject_hyperparams: inner_factory must be callable, got "
                        f"{type(inner_factory).__name__}")
    static_names = {static_args} if isinstance(static_args, str) else set(static_args)

    def build(**hparams) -> GradientTransformation:
        static, numeric, stateful = {}, {}, {}
        for k, v in hparams.items():
            is_number = isinstance(v, (int, float)) and not isinstance(v, bool)
            is_scalar = isinstance(v, torch.Tensor) and v.ndim == 0 and v.is_floating_point()
            if k in static_names:
                static[k] = v
            elif isinstance(v, StatefulSchedule):
                stateful[k] = v
            elif is_number or is_scalar or callable(v):
                numeric[k] = v
            else:
                static[k] = v
        obj = _Injected(inner_factory, static, numeric, stateful, keep_states)
        return GradientTransformation(obj.init, obj.update)

    return build
