"""Optimizers with matrix stages (:mod:`ftopt.matrix`): ``adafactor``, ``muon``,
``normuon``, ``sm3`` and ``soap``.

optax signatures and defaults, plus the keyword-only ``skip_zeros``, ``state_bits`` and
``state_dtype`` every alias takes (:mod:`ftopt.alias`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optree
import torch

from ftopt.alias import adamw, chain_alias, check_state_options, finish
from ftopt.base import GradientTransformation
from ftopt.combine import partition
from ftopt.matrix_views import leaf_dims
from ftopt.quantize import STATE_DTYPES
from ftopt.schedules import ScalarOrSchedule
from ftopt.transforms import (
    add_decayed_weights,
    ema,
    scale,
    scale_by_learning_rate,
)
from ftopt.transforms.factored import (
    clip_by_block_rms,
    scale_by_factored_rms,
    scale_by_param_block_rms,
)
from ftopt.transforms.muon import DEFAULT_NS_COEFFS, scale_by_muon, scale_by_shape
from ftopt.transforms.normuon import scale_by_normuon
from ftopt.transforms.sm3 import scale_by_sm3
from ftopt.transforms.soap import scale_by_soap
from ftopt.tree import map as tree_map

__all__ = ["adafactor", "muon", "normuon", "sm3", "soap"]

Float = float | torch.Tensor


def adafactor(
    learning_rate: ScalarOrSchedule | None = None,
    min_dim_size_to_factor: int = 128,
    decay_rate: float = 0.8,
    decay_offset: int = 0,
    multiply_by_parameter_scale: bool = True,
    clipping_threshold: Float | None = 1.0,
    momentum: Float | None = None,
    dtype_momentum: torch.dtype = torch.float32,
    weight_decay_rate: Float | None = None,
    eps: float = 1e-30,
    factored: bool = True,
    weight_decay_mask: Any = None,
    *,
    skip_zeros: bool = False,
    state_bits: int = 32,
    state_dtype: torch.dtype | None = None,
    state_rounding: str = "nearest",
) -> GradientTransformation:
    """Adafactor, as optax: ``chain(scale_by_factored_rms, clip_by_block_rms(threshold),
    scale_by_learning_rate(lr, flip_sign=False), scale_by_param_block_rms(), ema(momentum,
    debias=False), add_decayed_weights(weight_decay_rate, weight_decay_mask), scale(-1))``,
    each optional part present only when its argument is given (``learning_rate=None``:
    no learning rate, the relative step of ``multiply_by_parameter_scale`` alone).

    The factored second moments are a matrix stage (torch, batched by shape); every
    stage after it fuses into one kernel.

    State storage: the momentum (``ema``) is the only per-element state of the elementwise
    stages, and the one ``dtype_momentum``, ``state_dtype`` and ``state_bits`` act on.
    ``dtype_momentum`` (optax's name) is ``state_dtype`` for it: fp32, bf16 or fp16 (the
    math stays fp32, the value is rounded once per store); giving both with different
    dtypes is an error. ``state_bits=8`` stores the momentum of leaves with >= 4096
    elements as 8-bit blockwise codes (SPEC §5; smaller leaves keep ``state_dtype``). The
    second moments (``v_row``, ``v_col``, and ``v`` of unfactored leaves) belong to the
    matrix stage and always stay in the params' compute dtype. Fused and eager agree for
    every layout, and ``skip_zeros`` keeps a 16-bit momentum bit for bit and an 8-bit one
    as for every 8-bit state (a block whose gradients are all zero is byte-identical).
    """
    check_state_options("adafactor", state_bits, state_dtype, state_rounding)
    _check_dtype_momentum(dtype_momentum, state_dtype)
    parts = [scale_by_factored_rms(factored, decay_rate, decay_offset,
                                   min_dim_size_to_factor, eps)]
    if clipping_threshold is not None:
        parts.append(clip_by_block_rms(clipping_threshold))
    if learning_rate is not None:
        parts.append(scale_by_learning_rate(learning_rate, flip_sign=False))
    if multiply_by_parameter_scale:
        parts.append(scale_by_param_block_rms())
    if momentum is not None:
        parts.append(ema(momentum, debias=False))
        if state_dtype is None and dtype_momentum != torch.float32:
            state_dtype = dtype_momentum
    if weight_decay_rate is not None:
        parts.append(add_decayed_weights(weight_decay_rate, weight_decay_mask))
    parts.append(scale(-1.0))
    return finish(parts, skip_zeros, state_bits, state_dtype, state_rounding)


def _check_dtype_momentum(dtype_momentum: Any, state_dtype: torch.dtype | None) -> None:
    """Raise unless ``dtype_momentum`` is a storage dtype that agrees with ``state_dtype``."""
    if not isinstance(dtype_momentum, torch.dtype):
        raise TypeError(f"adafactor: dtype_momentum must be a torch.dtype, got "
                        f"{type(dtype_momentum).__name__} {dtype_momentum!r}")
    if dtype_momentum not in STATE_DTYPES:
        raise ValueError(f"adafactor: dtype_momentum must be torch.float32, torch.bfloat16 "
                         f"or torch.float16, got {dtype_momentum}")
    if (state_dtype is not None and dtype_momentum != torch.float32
            and dtype_momentum != state_dtype):
        raise ValueError(f"adafactor: dtype_momentum={dtype_momentum} and state_dtype="
                         f"{state_dtype} disagree; give one of them")


def _is_matrix(params: Any) -> Any:
    return tree_map(lambda p: "muon" if isinstance(p, torch.Tensor) and p.ndim == 2
                    else "adam", params)


def _named_matrices(dims: Any):
    """Labels of :func:`muon`'s partition from ``muon_weight_dimension_numbers``: "muon"
    where a leaf has dimension numbers, "adam" where it has ``None``."""
    def labels(params: Any) -> Any:
        found = iter(leaf_dims("muon", dims, params))

        def label(param: Any) -> str | None:
            leaf = next(found)  # (one per position, a None param's too)
            if param is None:
                return None  # a param held as None is an empty subtree: no label
            return "muon" if leaf is not None else "adam"
        return optree.tree_map(label, params, none_is_leaf=True, namespace="ftopt")
    return labels


def muon(
    learning_rate: ScalarOrSchedule,
    ns_coeffs: Sequence = DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    beta: Float = 0.95,
    eps: float = 1e-8,
    weight_decay: Float = 0.0,
    weight_decay_mask: Any = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: str = "frobenius",
    adam_b1: Float = 0.9,
    adam_b2: Float = 0.999,
    adam_eps_root: Float = 0.0,
    adam_weight_decay: Float = 0.0,
    adam_learning_rate: ScalarOrSchedule | None = None,
    consistent_rms: float | None = None,
    ns_dtype: torch.dtype | None = None,
    muon_weight_dimension_numbers: Any = None,
    skip_zeros: bool = False,
    state_bits: int = 32,
    state_dtype: torch.dtype | None = None,
    state_rounding: str = "nearest",
) -> GradientTransformation:
    """Muon, as optax.contrib.muon: 2-D leaves get ``chain(scale_by_muon(...),
    scale_by_shape(consistent_rms), add_decayed_weights(weight_decay, weight_decay_mask),
    scale_by_learning_rate(learning_rate))``, every other leaf ``adamw(adam_learning_rate
    or learning_rate, adam_b1, adam_b2, eps, adam_eps_root, adam_weight_decay,
    nesterov=nesterov)``, through :func:`ftopt.partition` (labels ``"muon"``/``"adam"``).

    ``ns_dtype`` (see :func:`scale_by_muon`): ``None`` runs the Newton-Schulz iterations
    in bfloat16 on CUDA and in fp32 elsewhere. Leaves of one shape are orthogonalised in
    one batched ``bmm`` chain. A ``partition`` runs its parts one after the other: the
    step is eager (foreach) torch ops around the batched matrix stage; the ``"muon"``
    chain alone fuses its elementwise stages (see :func:`ftopt.explain`).

    ``muon_weight_dimension_numbers`` (as optax's; :class:`ftopt.MuonDimensionNumbers`
    for every leaf, a tree of them and ``None`` like the params or a prefix of them, or a
    function of the params giving one): the leaves with dimension numbers get Muon, each
    batch index of them one matrix (a stack of experts ``(E, in, out)`` with
    ``MuonDimensionNumbers(1, 2)``), and the ``None`` leaves AdamW.
    """
    check_state_options("muon", state_bits, state_dtype, state_rounding)
    stage = scale_by_muon(ns_coeffs, ns_steps, beta, eps, nesterov=nesterov,
                          adaptive=adaptive, preconditioning=preconditioning,
                          ns_dtype=ns_dtype,
                          weight_dimension_numbers=muon_weight_dimension_numbers)
    return _matrices_and_adam(stage, locals())


def _matrices_and_adam(stage: GradientTransformation, kw: dict) -> GradientTransformation:
    """Muon's and NorMuon's partition: the matrix leaves get ``chain(stage,
    scale_by_shape, add_decayed_weights, scale_by_learning_rate)``, the others AdamW
    (``kw``: the alias's arguments)."""
    dims, storage = kw["muon_weight_dimension_numbers"], (
        kw["skip_zeros"], kw["state_bits"], kw["state_dtype"], kw["state_rounding"])
    matrix_part = finish([
        stage,
        scale_by_shape(kw["consistent_rms"], dims),
        add_decayed_weights(kw["weight_decay"], kw["weight_decay_mask"]),
        scale_by_learning_rate(kw["learning_rate"]),
    ], *storage)
    adam_lr = kw["adam_learning_rate"]
    adam_part = adamw(kw["learning_rate"] if adam_lr is None else adam_lr, kw["adam_b1"],
                      kw["adam_b2"], kw["eps"], kw["adam_eps_root"], kw["adam_weight_decay"],
                      nesterov=kw["nesterov"], skip_zeros=storage[0], state_bits=storage[1],
                      state_dtype=storage[2], state_rounding=storage[3])
    labels = _is_matrix if dims is None else _named_matrices(dims)
    return partition({"muon": matrix_part, "adam": adam_part}, labels)


def normuon(
    learning_rate: ScalarOrSchedule,
    ns_coeffs: Sequence | str = DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    beta: Float = 0.95,
    beta2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: Float = 0.0,
    weight_decay_mask: Any = None,
    *,
    nesterov: bool = True,
    preconditioning: str = "frobenius",
    adam_b1: Float = 0.9,
    adam_b2: Float = 0.999,
    adam_eps_root: Float = 0.0,
    adam_weight_decay: Float = 0.0,
    adam_learning_rate: ScalarOrSchedule | None = None,
    muon_weight_dimension_numbers: Any = None,
    normuon_scale: float = 0.2,
    consistent_rms: float | None = None,
    ns_dtype: torch.dtype | None = None,
    skip_zeros: bool = False,
    state_bits: int = 32,
    state_dtype: torch.dtype | None = None,
    state_rounding: str = "nearest",
) -> GradientTransformation:
    """NorMuon, as optax.contrib.normuon: :func:`muon` with
    :func:`ftopt.scale_by_normuon` (Muon's update, each row normalised by a running
    mean of its squares, each matrix rescaled to RMS ``normuon_scale``) in place of
    ``scale_by_muon``; the same partition (matrices, and AdamW for every other leaf) and
    the same arguments, plus ``beta2`` and ``normuon_scale``.

    The row moments belong to the matrix stage and stay in the params' compute dtype
    whatever ``state_bits`` and ``state_dtype`` say (they hold one value a row).
    """
    check_state_options("normuon", state_bits, state_dtype, state_rounding)
    stage = scale_by_normuon(ns_coeffs, ns_steps, beta, beta2, eps, nesterov=nesterov,
                             preconditioning=preconditioning, ns_dtype=ns_dtype,
                             weight_dimension_numbers=muon_weight_dimension_numbers,
                             normuon_scale=normuon_scale)
    return _matrices_and_adam(stage, locals())


@chain_alias
def sm3(learning_rate: ScalarOrSchedule, momentum: Float = 0.9) -> list[GradientTransformation]:
    """SM3 (Anil et al. 2019), as optax: ``chain(scale_by_sm3(momentum),
    scale_by_learning_rate(lr))`` (optax scales by ``-lr``; a schedule works here too).
    Its accumulators and momentum belong to the matrix stage and stay in the params'
    compute dtype whatever ``state_bits`` and ``state_dtype`` say."""
    return [scale_by_sm3(momentum), scale_by_learning_rate(learning_rate)]


@chain_alias
def soap(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.95,
    b2: float = 0.95,
    shampoo_beta: float = -1.0,
    eps: float = 1e-8,
    weight_decay: Float = 0.0,
    mask: Any = None,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
    precondition_1d: bool = False,
    mu_dtype: torch.dtype | None = None,
) -> list[GradientTransformation]:
    """SOAP (Vyas et al. 2024), as optax.contrib: ``chain(scale_by_soap(...),
    add_decayed_weights(weight_decay, mask), scale_by_learning_rate(lr))``: Adam in the
    eigenbasis of Shampoo's preconditioner (:func:`ftopt.scale_by_soap`). Its moments and
    factors belong to the matrix stage and stay as ``mu_dtype`` (default: the params'
    compute dtype) and fp32 whatever ``state_bits`` and ``state_dtype`` say; the decay and
    the learning rate fuse."""
    return [scale_by_soap(b1, b2, shampoo_beta, eps, precondition_frequency,
                          max_precond_dim, precondition_1d, mu_dtype),
            add_decayed_weights(weight_decay, mask),
            scale_by_learning_rate(learning_rate)]
