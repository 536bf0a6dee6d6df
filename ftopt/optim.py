"""``ftopt.Optimizer``: an ftopt transform behind the ``torch.optim.Optimizer`` interface."""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Iterable
from itertools import repeat
from typing import Any

import optree
import torch

from ftopt import dispatch, param_groups
from ftopt.base import GradientTransformation, check_transform
from ftopt.group_run import GroupRun, Lane, params_tree
from ftopt.param_state import param_views, plan_load
from ftopt.step_hooks import hooked
from ftopt.update import step as ftopt_step

__all__ = ["Optimizer"]

_GROUP_KEYS = ("params", "param_names")
_BACKENDS = ("auto", "fused", "eager")
_grad_of = operator.attrgetter("grad")


def _to_torch_names(hparams: dict, betas_default: tuple | None) -> dict:
    """``learning_rate`` -> ``lr``; ``b1``/``b2`` -> ``betas`` where the factory has both."""
    out = dict(hparams)
    if "learning_rate" in out:
        if "lr" in out:
            raise ValueError("give lr or learning_rate, not both")
        out["lr"] = out.pop("learning_rate")
    if betas_default is not None and ("b1" in out or "b2" in out):
        if "betas" in out:
            raise ValueError("give betas or b1/b2, not both")
        b1, b2 = betas_default[:2]
        out["betas"] = (out.pop("b1", b1), out.pop("b2", b2))
    return out


def _factory_defaults(factory: Callable) -> tuple[dict, tuple | None]:
    """The factory's defaults of simple type, in torch names; and its default betas."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return {}, None
    found = {name: p.default for name, p in signature.parameters.items()
             if p.default is not inspect.Parameter.empty
             and (p.default is None or isinstance(p.default, (bool, int, float, str)))}
    betas = None
    if "b1" in signature.parameters and "b2" in signature.parameters:
        betas = (found.pop("b1", 0.9), found.pop("b2", 0.999))
        found["betas"] = betas
    return found, betas


class Optimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that steps with an ftopt transform.

    Each step runs one donated :func:`ftopt.step` per param group, or one over all
    groups whose transforms are the same chain of rules (:mod:`ftopt.param_groups`): in
    place, as one fused Triton kernel per (device, dtype) group on a GPU
    (``backend="auto"``), eagerly on the CPU.

    Example::

        opt = ftopt.Optimizer(model.parameters(), ftopt.adamw, lr=1e-3,
                              weight_decay=0.1)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
        loss.backward(); opt.step(); opt.zero_grad(); sched.step()

    Args:
        params: tensors, ``(name, tensor)`` pairs (``model.named_parameters()``: the
            transform then sees a dict by name, which masks may use), or param-group
            dicts, as for any torch optimizer.
        tx: a ``GradientTransformation`` (used as is by every group: its hyperparameters
            are fixed, and the groups hold no ``lr``), or a factory such as
            ``ftopt.adamw`` called once per group with the group's hyperparameters.
        backend: as for :func:`ftopt.step` (default: ``"auto"``).
        **hyperparameters: the defaults of every group (factory only), in torch's names
            or ftopt's: ``lr`` is the factory's ``learning_rate``, ``betas=(b1, b2)`` its
            ``b1``, ``b2`` (a third beta is ``b3``); any other name (``weight_decay``,
            ``eps``, ``momentum``, ``decay``, ``state_bits``, ...) is passed as is. The
            factory's own defaults of simple type fill the rest, so groups show them.

    Live hyperparameters: every float hyperparameter of a group (``lr``, ``betas``,
    ``weight_decay``, ...) is handed to the factory as a 0-d tensor on the group's
    device (the CPU where its params span several), and each step copies the group's
    current value into it. A torch LR scheduler
    (``LambdaLR``, ``CosineAnnealingLR``, ``OneCycleLR`` with its ``betas``) that writes
    ``group["lr"]`` thus changes the next step without rebuilding the transform or
    recompiling a kernel. The tensors are float64 (float32 on MPS): the per-step scalars
    (1 − b2, the bias corrections) are then computed as from Python floats, and a
    live hyperparameter gives the same result as a fixed one. A change of any other
    hyperparameter (``nesterov``, ``state_bits``) rebuilds the group's transform; its
    state must fit the new one.

    Differences from torch's optimizers: a param whose ``grad`` is ``None`` is skipped
    (its params and state are left as they are), but ftopt keeps one step count per
    param group (per transform), which counts the steps where any param of the group had
    a gradient; every param of a group gets state at its first step. ``step`` takes no
    ``grad_scaler``: under ``torch.amp.GradScaler`` the scaler unscales the gradients and
    skips steps with infinite ones itself.

    ``state_dict()`` is torch's format: ``{"state": {index: {slot: tensor}},
    "param_groups": [...]}`` (slot names: :mod:`ftopt.param_state`; 8-bit slots as
    ``<slot>.codes`` and ``<slot>.absmax``). ``load_state_dict`` copies the states onto
    each param's device, checks every entry first (a mismatch raises, naming the param
    index and slot, and changes nothing) and resumes bit-exactly.
    """

    def __init__(
        self,
        params: Iterable[Any],
        tx: GradientTransformation | Callable[..., GradientTransformation],
        *,
        backend: str = "auto",
        **hyperparameters: Any,
    ) -> None:
        if backend not in _BACKENDS:
            raise ValueError(f"ftopt.Optimizer: backend must be one of {_BACKENDS}, got "
                             f"{backend!r}")
        if isinstance(tx, GradientTransformation):
            check_transform(tx, "ftopt.Optimizer: argument tx")
            if hyperparameters:
                raise TypeError(
                    f"ftopt.Optimizer: hyperparameters {sorted(hyperparameters)} need a "
                    "factory (ftopt.Optimizer(params, ftopt.adamw, lr=...)); a built "
                    "transform keeps its own")
            self._factory, self._betas_default, defaults = None, None, {}
        elif callable(tx):
            self._factory = tx
            defaults, self._betas_default = _factory_defaults(tx)
            defaults.update(self._rename(hyperparameters, "ftopt.Optimizer"))
        else:
            check_transform(tx, "ftopt.Optimizer: argument tx")
        self._tx = tx
        self._backend = backend
        self._runs: list[GroupRun] = []
        self._joiner = param_groups.GroupJoiner()
        self._lane: Lane | None = None  # the last step, bound to its tensors (see step)
        # Live values whose device write waits (see _write_deferred): by the tensor's id,
        # the tensor and its latest number.
        self._deferred: dict[int, tuple[torch.Tensor, float]] = {}
        super().__init__(params, defaults)

    def _rename(self, hparams: dict, where: str) -> dict:
        try:
            return _to_torch_names(hparams, self._betas_default)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None

    # -- groups ------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (as torch), with its own transform and state."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        where = f"ftopt.Optimizer: param group {len(self.param_groups)}"
        extra = {k: v for k, v in param_group.items() if k not in _GROUP_KEYS}
        if self._factory is None and extra:
            raise TypeError(f"{where}: hyperparameters {sorted(extra)} need a factory as tx")
        group = {k: v for k, v in param_group.items() if k in _GROUP_KEYS}
        group.update(self._rename(extra, where))
        super().add_param_group(group)
        names = group.get("param_names")
        if names is not None and len(set(names)) != len(names):
            self.param_groups.pop()
            raise ValueError(f"{where}: param names are not unique")
        for i, p in enumerate(group["params"]):
            if not p.is_floating_point():
                self.param_groups.pop()
                raise TypeError(f"{where}: param {i} is {p.dtype}; expected a "
                                "floating-point tensor")
        run = GroupRun(tuple(k for k in group if k not in _GROUP_KEYS))
        try:
            run.build(group, self._factory, self._tx, where)
            _check_reads(run.reads, where)
        except Exception:
            self.param_groups.pop()
            raise
        self._runs.append(run)

    # -- step --------------------------------------------------------------------------

    @hooked  # with gradients off, as torch.no_grad() (step_hooks.py)
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step of every param group (params with ``grad=None`` are skipped).

        Args:
            closure: re-evaluates the model and returns the loss; called under
                ``torch.enable_grad()`` before the step. A transform that reads the loss
                (``polyak_sgd``, ``momo``, ``reduce_on_plateau``: ``update``'s
                ``value=``) gets the closure's, and needs one.

        Returns:
            The closure's loss, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        runs, groups = self._runs, self.param_groups
        # A group's hyperparameters are checked where they changed (by identity: a
        # scheduler writes a new float), in every group before any group steps.
        stale = [(i, keys) for i, (run, group) in enumerate(zip(runs, groups))
                 if (keys := run.changed(group))]
        copy_in = [runs[i].refresh(groups[i], keys, self._factory,
                                   f"ftopt.Optimizer.step: param group {i}")
                   for i, keys in stale]
        # Transforms that read the loss step group by group, eagerly, with no lane.
        value = _loss_for(runs, loss)
        lane = self._lane
        if lane is not None and value is None:
            # The last step's tables, bound to the same groups' tensors: the gradients in
            # leaf order, every tensor checked (fits), this step's scalars, the launches.
            bounds = lane.bounds
            if (lane.holds(runs, groups, self._joiner.joined)
                    and not torch.compiler.is_compiling()
                    and all([b.fits(b.grads()) for b in bounds])):
                deferred = self._deferred
                for (i, keys), copy in zip(stale, copy_in):
                    if copy:  # (every group has gradients: the tables' leaves have)
                        runs[i].copy_live(groups[i], copy, deferred)
                    runs[i].remember(groups[i], keys)
                for b in bounds:
                    b.launch(self._write_deferred if deferred else None)
                return loss
            self._lane = None
        if self._deferred:
            self._write_deferred()
        grads_of = [list(map(_grad_of, group["params"])) for group in groups]
        for (i, keys), copy in zip(stale, copy_in):
            if not copy or any(map(operator.is_not, grads_of[i], repeat(None))):
                if copy:  # (a group without gradients: copied when it steps)
                    runs[i].copy_live(groups[i], copy)
                runs[i].remember(groups[i], keys)
        # Groups that are the same chain of rules: one fused partition (param_groups.py).
        fresh = None if value is not None else self._joiner.step(runs, groups, grads_of,
                                                                 self._backend)
        if fresh is not None:
            for index in fresh:
                self._show_state(index)
            joined = self._joiner.joined
            if joined is not None and joined.reason is None:
                self._bind([(joined.tx, joined.params, joined.state)])
            return loss
        every = True  # (every group stepped: the steps may be bound)
        for index, (run, group, grads) in enumerate(zip(runs, groups, grads_of)):
            if not any(map(operator.is_not, grads, repeat(None))):
                every = False
                continue
            params = run.params_tree(group)
            names = group.get("param_names")
            grad_tree = dict(zip(names, grads)) if names is not None else grads
            fresh = run.state is None
            state = run.tx.init(params) if fresh else run.state
            extra = {"value": value} if run.reads else {}
            try:
                _, state = ftopt_step(run.tx, params, grad_tree, state, donate=True,
                                      backend=self._backend, **extra)
            except (TypeError, ValueError, RuntimeError) as err:
                raise type(err)(f"ftopt.Optimizer.step: param group {index}: {err}") \
                    from err
            run.state = state
            if fresh:
                self._show_state(index)
        if every and value is None:
            self._bind([(run.tx, run.tree, run.state) for run in runs])
        return loss

    def _write_deferred(self) -> None:
        """Write the live values that bound steps left on the host into their tensors.

        A bound step's kernel takes its hyperparameters as host numbers (the live
        tensors' host mirrors), so a scheduler's new float is only recorded there and
        the tensor's write (a kernel launch on a GPU) waits for the first step that reads
        the tensor on its device: a bound step whose scalars are computed there, or any
        other step (eager, or not bound), which writes them all first."""
        for tensor, value in self._deferred.values():
            param_groups.fill_live(tensor, value)
        self._deferred.clear()

    def _bind(self, steps: list) -> None:
        """Bind the steps just taken, ``(transform, params tree, state)`` each (the
        groups' partition, or every group's own), to their tensors (:class:`ftopt.
        group_run.Lane`), where each was a donated fused step whose tables the next step
        may use."""
        fused = dispatch.loaded("fused") if self._backend != "eager" else None
        if fused is None or not all(
                getattr(getattr(tx.update, "__self__", None), "wrapper_step", None) is None
                and fused.has_prepared_step(tx, self._backend) for tx, _, _ in steps):
            return  # (a wrapper steps its inner transform, with its own bookkeeping)
        bounds = []
        for tx, params, state in steps:
            bound = fused.bind_step(tx, params, state, self._backend)
            if bound is None:
                return
            if not bound.fits(bound.grads()):
                bound.refuse()
                return
            bounds.append(bound)
        self._lane = Lane(self._runs, self._joiner.joined, tuple(bounds))

    def _show_state(self, index: int) -> None:
        """Point ``self.state[p]`` at the group's state tensors (see :mod:`param_state`)."""
        group, run = self.param_groups[index], self._runs[index]
        views, _ = param_views(run.state, params_tree(group))
        by_index = dict(zip(_leaf_order(params_tree(group)), views))
        for i, p in enumerate(group["params"]):
            self.state[p] = by_index[i]

    # -- checkpoints -------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` (torch's format): hyperparameters and states.

        Every state is checked (names, shapes, dtypes, one step count per group) before
        anything is written, and copied onto its param's device in the dtype the
        transform keeps (fp32 states, uint8 codes, integer counts).
        """
        state_dict = dict(state_dict)
        self._write_deferred()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        if not isinstance(state_dict, dict) or {"state", "param_groups"} - set(state_dict):
            raise ValueError("ftopt.Optimizer.load_state_dict: expected a dict with 'state' "
                             "and 'param_groups'")
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"ftopt.Optimizer.load_state_dict: {len(saved_groups)} param "
                             f"groups saved, the optimizer has {len(self.param_groups)}")
        groups, runs, copies = [], [], []
        for index, (mine, saved) in enumerate(zip(self.param_groups, saved_groups)):
            where = f"ftopt.Optimizer.load_state_dict: param group {index}"
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError(f"{where}: {len(saved['params'])} params saved, the group "
                                 f"has {len(mine['params'])}")
            group = {**{k: v for k, v in saved.items() if k not in _GROUP_KEYS},
                     "params": mine["params"]}
            if "param_names" in mine:
                group["param_names"] = mine["param_names"]
            run = GroupRun(self._runs[index].keys)
            if missing := [k for k in run.keys if k not in group]:
                raise ValueError(f"{where}: the checkpoint lacks hyperparameters {missing}")
            run.build(group, self._factory, self._tx, where)
            entries = [saved_state.get(i) for i in saved["params"]]
            if any(e for e in entries):
                params = params_tree(group)
                with torch.no_grad():
                    run.state = run.tx.init(params)
                views, shared = param_views(run.state, params)
                order = _leaf_order(params)
                copies += plan_load(views, shared, [entries[i] for i in order],
                                    [saved["params"][i] for i in order])
            groups.append(group)
            runs.append(run)
        with torch.no_grad():
            for dst, src in copies:
                dst.copy_(src)
        self.param_groups[:] = groups
        self._runs[:] = runs
        self._joiner.joined = None
        self._lane = None
        self.state.clear()
        for index, run in enumerate(runs):
            if run.state is not None:
                self._show_state(index)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)


def _leaf_order(params: Any) -> list[int]:
    """The index in the group of each leaf of the params tree (a dict is sorted by name)."""
    if isinstance(params, dict):
        position = {name: i for i, name in enumerate(params)}
        return [position[path[0]] for path in
                optree.tree_paths(params, none_is_leaf=False, namespace="ftopt")]
    return list(range(len(params)))


def _loss_for(runs: list, loss: Any) -> Any:
    """The loss that groups whose transform reads it get as ``value=`` (detached), or
    ``None`` where no group's does; a clear error where one does and there is none."""
    for index, run in enumerate(runs):
        if run.reads:
            if loss is None:
                raise TypeError(f"ftopt.Optimizer.step: param group {index}: its transform "
                                "reads the loss (update's value=): call step(closure) with "
                                "a closure that computes the loss, calls backward and "
                                "returns it")
            return loss.detach() if isinstance(loss, torch.Tensor) else loss
    return None


def _check_reads(reads: frozenset, where: str) -> None:
    """A transform whose update needs a function of the params (a line search's
    ``value_fn=``, Sophia's ``obj_fn=``, opaque SAM's ``grad_fn=``) cannot step here:
    torch's optimizer API passes the loss at most (``value=``, from the closure)."""
    others = sorted(reads - {"value"})
    if others:
        needs = ", ".join(k + "=" for k in others)
        raise TypeError(f"{where}: the transform's update needs {needs}, which torch's "
                        "optimizer API cannot pass (step(closure) gives the loss, value=, "
                        "only); step it with tx.update or ftopt.step(tx, params, grads, "
                        "state, ...) and those keywords instead")
