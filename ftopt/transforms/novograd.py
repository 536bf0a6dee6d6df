"""NovoGrad's preconditioning: ``scale_by_novograd`` (a per-leaf second moment).

NovoGrad keeps one second moment per *leaf*, not per element: ``nu`` is the EMA of the
squared norm of the leaf's update. It is a per-leaf slot of an elementwise rule
(:class:`ftopt.rules.Slot` with ``per_leaf=True``), so the whole of ``scale_by_novograd``
is two rules, written once for every backend:

* **allocated** by ``init`` as one 0-d tensor per leaf, in the param's compute dtype
  (fp32 for 16-bit params, fp64 for fp64 ones), on the param's device;
* **checkpointed** as any state: plain tensors in a NamedTuple (``torch.save`` and
  :func:`ftopt.state_dict` need nothing more);
* **never quantized**: ``quantize_states``, ``state_bits=8`` and ``state_dtype`` store the
  per-element ``mu`` in 8 or 16 bits and leave ``nu`` (4 bytes a leaf) in fp32;
* **skip_zeros** (SPEC §3 for a per-leaf state, :func:`ftopt.program.trace_chain`): a
  leaf whose raw gradient is all zero keeps its ``nu`` bit for bit; in a leaf that is
  only partly zero, ``nu`` advances from the norm of the whole leaf, in which the skipped
  elements count as the zeros they are (the same norm a norm-based transform sees); the
  skipped elements' update is ``-0.0`` and their ``mu`` keeps its bits, as for every
  per-element state.

How it runs: the norm is ``o.leaf_norm``, as LAMB's and Fromage's. Fused, the chain is
one program: a reduction pass writes each leaf's sum of squares (and, with skip_zeros,
its count of non-zero gradients) to a small device buffer, then one kernel per group
computes ``nu`` and the denominator per leaf from it, divides, runs the momentum, the
weight decay and whatever follows (the learning rate), and the first program of each
leaf stores its new ``nu``: no torch op per leaf and no host synchronisation, whatever
the number of leaves. On local shards of DTensors the sums of squares are summed over
the mesh before the kernel reads them (:mod:`ftopt.shards`), so a split leaf's ``nu`` is
that of the whole leaf. Eager, the same bodies run on tensors (torch's norms).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ftopt.base import GradientTransformation, register_state
from ftopt.combine import chain
from ftopt.domains import NONNEG, UNIT_OPEN
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule, Slot

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


def _first_step(t, h) -> dict:
    """``first``: 1.0 on the first step (t = 1), else 0.0 (a device tensor where the count
    is only on the device: no host read); ``one_minus_b2`` in float64 (in a kernel from an
    fp32 b2, 1 − 0.999 would be 1.3e-5 off)."""
    first = (t == 1).to(torch.float64) if isinstance(t, torch.Tensor) else float(t == 1)
    return {"first": first, "one_minus_b2": 1 - h["b2"]}


def _leaf_moment_body(o, x):
    norm = o.leaf_norm(x.u)
    square = norm * norm
    # ‖u‖² on the first step, else (1−b2)·‖u‖² + b2·nu (optax's ``update_moment``).
    nu = o.where(x.first > 0.5, square, x.one_minus_b2 * square + x.b2 * x.nu)
    return x.u / (o.sqrt(nu + x.eps_root) + x.eps), {"nu": nu}


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
    optax's ``ScaleByNovogradState(count, mu, nu)`` split between two rules, the per-leaf
    one and the per-element one (see the module docstring for how they run, how ``nu`` is
    kept and what ``skip_zeros`` does to it). ``state_bits=8`` and ``state_dtype`` apply to
    ``mu``; ``nu`` stays in fp32.

    Args:
        b1: decay of the first moment, in [0, 1) (default: 0.9).
        b2: decay of the per-leaf second moment, in [0, 1) (default: 0.25).
        eps: added to the denominator outside the square root, >= 0 (default: 1e-8).
        eps_root: added inside the square root, >= 0 (default: 0.0).
        weight_decay: wd, >= 0 (default: 0.0), added to the normalised update before the
            momentum (NovoGrad's decay).
    """
    second = rule_transform(Rule(
        "scale_by_novograd",
        _leaf_moment_body,
        state_class=LeafSecondMomentState,
        slots=(Slot("nu", signed=False, per_leaf=True),),
        hparams={"b2": b2, "eps": eps, "eps_root": eps_root},
        domains={"b2": UNIT_OPEN, "eps": NONNEG, "eps_root": NONNEG},
        scalars=_first_step,
        counted=True,
    ))
    momentum = rule_transform(Rule(
        "scale_by_novograd",
        _momentum_body,
        state_class=NovogradMomentumState,
        slots=(Slot("mu"),),
        hparams={"b1": b1, "weight_decay": weight_decay},
        domains={"b1": UNIT_OPEN, "weight_decay": NONNEG},
        uses_params=True,
    ))
    return chain(second, momentum)
