"""NovoGrad's preconditioning: ``scale_by_novograd`` (a per-leaf second moment).

NovoGrad keeps one second moment per *leaf*, not per element: ``nu`` is the EMA of the
squared norm of the leaf's update. That state lives here, in :class:`LeafSecondMoment`,
and nowhere else (the per-leaf state kind of ftopt):

* **allocated** by ``init`` as one 0-d tensor per leaf, in the param's compute dtype
  (fp32 for 16-bit params, fp64 for fp64 ones), on the param's device;
* **checkpointed** as any state: plain tensors in a NamedTuple (``torch.save`` and
  :func:`ftopt.state_dict` need nothing more);
* **never quantized**: ``quantize_states``, ``state_bits=8`` and ``state_dtype`` store the
  per-element ``mu`` in 8 or 16 bits and leave ``nu`` (4 bytes a leaf) in fp32;
* **skip_zeros** (SPEC §3 for a per-leaf state): a leaf whose raw gradient is all zero
  keeps its ``nu`` bit for bit; in a leaf that is only partly zero, ``nu`` advances from
  the norm of the whole leaf, in which the skipped elements count as the zeros they are
  (the same norm a norm-based transform sees); the skipped elements' update is ``-0.0``
  and their ``mu`` keeps its bits, as for every per-element state.

How it runs: the norm and the new ``nu`` are a stage with torch ops (a matrix stage,
:mod:`ftopt.matrix`), batched over the leaves of one dtype and device: one
``_foreach_norm``, the ``nu`` of every leaf updated as one stacked vector (the new 0-d
``nu`` leaves are views of it), no host synchronisation (the first step is a ``where``
on the count when the count is only on the device). The momentum, the weight decay and
whatever follows in a chain (the learning rate) are an elementwise rule. On the eager
backend the stage also divides (one ``_foreach_div`` by the denominators). On the fused
backend it does not (:meth:`LeafSecondMoment.leaf_divisors`): it hands the vector of
denominators √(nu + eps_root) + eps to the kernel that runs the rest of the chain
(segments, see :mod:`ftopt.lowering.segments`), which reads it as a per-leaf value and
divides the raw gradient itself, zero-gradient elements skipped there too; a step is
one ``_foreach_norm`` (two with ``skip_zeros``: max |g| = 0 finds the all-zero leaves),
a few ops on the stacked vectors and one kernel launch, whatever the number of leaves.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ftopt import eager, shards
from ftopt import tree as tree_lib
from ftopt._counts import host_count, remember_count
from ftopt.base import GradientTransformation, register_owner, register_state
from ftopt.combine import chain
from ftopt.domains import NONNEG, UNIT_OPEN, check_hparam
from ftopt.matrix import check_shards, flatten_call
from ftopt.program import skip_update
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule, Slot, check_param, compute_dtype, state_dtype
from ftopt.validate import check_count, check_layout, check_leaf

__all__ = ["LeafSecondMomentState", "NovogradMomentumState", "scale_by_novograd"]

Float = float | torch.Tensor


@register_state
class LeafSecondMomentState(NamedTuple):
    """NovoGrad's step count and, per leaf, the 0-d EMA of the squared update norm."""

    count: torch.Tensor
    nu: Any


@register_state
class NovogradMomentumState(NamedTuple):
    """NovoGrad's first moment (per element, the accumulated normalised updates)."""

    mu: Any


class LeafSecondMoment:
    """The per-leaf stage of :func:`scale_by_novograd` (see the module docstring):
    nu ← ‖u‖² on the first step, else b2·nu + (1−b2)·‖u‖²; u ← u/(√(nu + eps_root) + eps).
    """

    matrix_stage = True
    mask_aware = True
    divides_leaves = True  # fused: the next kernel divides by the per-leaf denominators
    name = "scale_by_novograd"

    def __init__(self, b2: Float, eps: Float, eps_root: Float):
        self.b2, self.eps, self.eps_root = b2, eps, eps_root
        register_owner(self)

    def check_shards(self, paths, u_flat) -> None:
        """The norm reads the whole leaf: its shards may split no dim."""
        check_shards(self.name, "leaf", lambda u: True, paths, u_flat)

    def init(self, params) -> LeafSecondMomentState:
        paths, flat, spec = tree_lib.flatten_with_paths(params)
        for path, p in zip(paths, flat):
            check_param(path, p)
        nu = [torch.zeros((), dtype=state_dtype(p), device=p.device) for p in flat]
        device = tree_lib.state_device(flat)
        count = torch.zeros((), dtype=torch.int32, device=device)
        remember_count(count, 0)
        return LeafSecondMomentState(count, tree_lib.unflatten(spec, nu))

    def check_state(self, state: Any, u_flat, p_flat, spec, paths) -> None:
        """Raise (naming the leaf's path) unless ``state`` holds a count and one 0-d float
        tensor per leaf, on the update's device."""
        if not isinstance(state, LeafSecondMomentState):
            raise TypeError(f"{self.name}: expected a LeafSecondMomentState, got "
                            f"{type(state).__name__}")
        check_count(self.name, state.count)
        nu_flat = tree_lib.flatten_like(spec, state.nu, "state nu", paths)
        for i, u in enumerate(u_flat):
            if u is None:
                continue
            check_leaf(paths[i], u, p_flat[i], p_flat[i] is not None)
            s, where = nu_flat[i], f"state nu at {paths[i]}"
            if not isinstance(s, torch.Tensor):
                raise TypeError(f"{where}: expected a 0-d tensor, got {type(s).__name__}")
            check_layout("state nu", paths[i], s)
            if not s.is_floating_point():
                raise TypeError(f"{where}: expected a floating-point tensor, got {s.dtype}")
            if s.ndim != 0:
                raise ValueError(f"{where}: expected a 0-d tensor (one value per leaf), got "
                                 f"shape {tuple(s.shape)}")
            if s.device != u.device:
                raise ValueError(f"{where}: on {s.device}, expected {u.device}")

    def update(self, updates, state, params=None, **extra):
        call = flatten_call(updates, params, extra)
        spec, paths, u_flat, p_flat, zero_flat = (call.spec, call.paths, call.u_flat,
                                                  call.p_flat, call.zero_flat)
        self.check_state(state, u_flat, p_flat, spec, paths)
        self.check_shards(paths, u_flat)
        out, new = self.run_flat(u_flat, zero_flat, state, p_flat, spec, paths)
        return tree_lib.unflatten(spec, out), new

    def run_flat(self, u_flat, zero_flat, state, p_flat, spec, paths):
        """The normalised updates and the new state for flat leaves (:mod:`ftopt.matrix`):
        per (dtype, device) group of leaves, one ``_foreach_norm``, the new ``nu`` of every
        leaf as one vector, one ``_foreach_div`` by the denominators; the new ``nu`` leaves
        are views of that vector."""
        del p_flat
        nu_flat = tree_lib.flatten_like(spec, state.nu, "state nu", paths)
        first, new_count = _first_step(state.count)
        out, new_nu = list(u_flat), list(nu_flat)
        groups: dict[tuple, list[int]] = {}
        for i, u in enumerate(u_flat):
            if u is not None:
                groups.setdefault((compute_dtype(u), u.device), []).append(i)
        if not groups:
            return out, LeafSecondMomentState(new_count, state.nu)
        for (dtype, _), leaves in groups.items():
            us = [u_flat[i].to(dtype) for i in leaves]
            zeros = None if zero_flat is None else [zero_flat[i] for i in leaves]
            results, nus = self._normalise(us, zeros, [nu_flat[i] for i in leaves], first)
            for j, i in enumerate(leaves):
                out[i], new_nu[i] = results[j], nus[j]
        return out, LeafSecondMomentState(new_count, tree_lib.unflatten(spec, new_nu))

    def _normalise(self, us: list, zeros: list | None, olds: list, first: Any):
        """One group's normalised updates and new ``nu`` (views of one vector)."""
        mode = eager.choose_mode(us + [v for v in (self.b2, self.eps, self.eps_root)
                                       if isinstance(v, torch.Tensor)])
        norms = torch.stack(eager.EagerOps(mode).leaf_norm(eager.elem(us, mode)).items)
        kept = None if zeros is None else torch.stack([z.all() for z in zeros])
        denominators, nu = self._denominators(norms, kept, olds, first)
        denominators = denominators.unbind()
        if mode == "foreach":
            results = list(torch._foreach_div(us, denominators))
        else:
            results = [u / d for u, d in zip(us, denominators)]
        if zeros is not None:
            results = [skip_update(r, z) for r, z in zip(results, zeros)]
        return results, nu

    def _denominators(self, norms: torch.Tensor, kept: torch.Tensor | None, olds: list,
                      first: Any) -> tuple[torch.Tensor, tuple]:
        """Per leaf of a group, ``√(nu + eps_root) + eps`` (one vector) and the new ``nu``
        leaves (views of one vector in ``nu``'s dtype) from the leaves' norms; ``kept``:
        per leaf, whether its raw gradient is all zero (its ``nu`` stays as it was)."""
        old = torch.stack(olds)
        old_wide = old.to(norms.dtype)
        nu = _lerp_or_first(old_wide, norms * norms, self.b2, first)
        if kept is not None:  # a leaf whose raw gradient is all zero keeps its nu
            nu = torch.where(kept, old_wide, nu)
        denominators = torch.sqrt(nu + _as(self.eps_root, nu)) + _as(self.eps, nu)
        return denominators, nu.to(old.dtype).unbind()

    def leaf_divisors(self, u_flat, raw_flat, state, spec, paths):
        """The stage in a segmented fused step that divides in the next kernel
        (:mod:`ftopt.lowering.segments`): the updates pass through, and per (dtype,
        device) group of leaves ``(leaves, denominators)`` (one fp32 vector, the divisor
        of each of ``leaves`` in order) goes to the kernel, which reads it as a per-leaf
        value; and the new state. ``raw_flat``: the raw gradients of a skip_zeros chain
        (``None`` otherwise): a leaf whose raw gradient is all zero (max |g| = 0; NaN is
        not zero) keeps its ``nu``. One ``_foreach_norm`` per group (two with
        skip_zeros) and a few ops on the stacked vectors, whatever the number of leaves:
        no per-leaf op, no host synchronisation."""
        nu_flat = tree_lib.flatten_like(spec, state.nu, "state nu", paths)
        first, new_count = _first_step(state.count)
        new_nu = list(nu_flat)
        groups: dict[tuple, list[int]] = {}
        for i, u in enumerate(u_flat):
            if u is not None:
                groups.setdefault((compute_dtype(u), u.device), []).append(i)
        divisors = []
        for (dtype, _), leaves in groups.items():
            norms = _leaf_norms([u_flat[i] for i in leaves], dtype)
            kept = None
            if raw_flat is not None:
                largest = torch._foreach_norm([raw_flat[i] for i in leaves], float("inf"))
                kept = torch.stack(largest) == 0
            denominators, nus = self._denominators(norms, kept,
                                                   [nu_flat[i] for i in leaves], first)
            for j, i in enumerate(leaves):
                new_nu[i] = nus[j]
            divisors.append((leaves, denominators.to(torch.float32)))
        nu = tree_lib.unflatten(spec, new_nu) if groups else state.nu
        return divisors, LeafSecondMomentState(new_count, nu)


def _leaf_norms(us: list, dtype: torch.dtype) -> torch.Tensor:
    """‖u‖ of each leaf, summed in ``dtype`` (16-bit updates are not copied first), as one
    vector; on local shards the eager norms, which sum the squares over the ranks."""
    if shards.in_local_shards():
        items = eager.elem([u.to(dtype) for u in us], "foreach")
        return torch.stack(eager.EagerOps("foreach").leaf_norm(items).items)
    return torch.stack(torch._foreach_norm(us, 2.0, dtype=dtype))


def _as(value: Any, like: torch.Tensor) -> Any:
    return value.to(like.dtype) if isinstance(value, torch.Tensor) else value


def _lerp_or_first(old: torch.Tensor, square: torch.Tensor, b2: Any, first: Any):
    """‖u‖² on the first step, else (1−b2)·‖u‖² + b2·nu (optax's ``update_moment``)."""
    b2 = _as(b2, old)
    mixed = (1 - b2) * square + b2 * old
    if isinstance(first, bool):
        return square if first else mixed
    return torch.where(first, square, mixed)


def _first_step(count: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """Whether this is the first step (a bool when the count is known on the host, else a
    0-d bool tensor: no device read) and the new count."""
    known = host_count(count)
    if known is None and count.device.type == "cpu" and not eager.functorch_active():
        known = int(count)
    new_count = count + 1
    if known is None:
        return count == 0, new_count
    remember_count(new_count, known + 1)
    return known == 0, new_count


def _momentum_body(o, x):
    mu = x.b1 * x.mu + (x.u + x.weight_decay * x.p)
    return mu, {"mu": mu}


def scale_by_novograd(
    b1: Float = 0.9,
    b2: Float = 0.25,
    eps: Float = 1e-8,
    eps_root: Float = 0.0,
    weight_decay: Float = 0.0,
) -> GradientTransformation:
    """NovoGrad's preconditioning, as optax: a per-leaf second moment, a first moment.

    Per leaf, with t the step count after increment: nu ← ‖u‖² if t = 1, else
    b2·nu + (1−b2)·‖u‖² (one value per leaf); per element:
    mu ← b1·mu + u/(√(nu + eps_root) + eps) + wd·p (mu starts at 0, so the first step
    gives mu = u/(√(nu + eps_root) + eps) + wd·p, as optax); u ← mu.

    The state is ``(LeafSecondMomentState(count, nu), NovogradMomentumState(mu))``:
    optax's ``ScaleByNovogradState(count, mu, nu)`` split between the per-leaf stage and
    the elementwise rule (see the module docstring for how each runs, how ``nu`` is kept
    and what ``skip_zeros`` does to it). ``state_bits=8`` and ``state_dtype`` apply to
    ``mu``; ``nu`` stays in fp32.

    Args:
        b1: decay of the first moment, in [0, 1) (default: 0.9).
        b2: decay of the per-leaf second moment, in [0, 1) (default: 0.25).
        eps: added to the denominator outside the square root, >= 0 (default: 1e-8).
        eps_root: added inside the square root, >= 0 (default: 0.0).
        weight_decay: wd, >= 0 (default: 0.0), added to the normalised update before the
            momentum (NovoGrad's decay).
    """
    for name, value, domain in (("b2", b2, UNIT_OPEN), ("eps", eps, NONNEG),
                                ("eps_root", eps_root, NONNEG)):
        check_hparam("scale_by_novograd", name, value, domain)
    stage = LeafSecondMoment(b2, eps, eps_root)
    momentum = rule_transform(Rule(
        "scale_by_novograd",
        _momentum_body,
        state_class=NovogradMomentumState,
        slots=(Slot("mu"),),
        hparams={"b1": b1, "weight_decay": weight_decay},
        domains={"b1": UNIT_OPEN, "weight_decay": NONNEG},
        uses_params=True,
    ))
    return chain(GradientTransformation(stage.init, stage.update), momentum)
