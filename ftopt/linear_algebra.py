"""optax's linear-algebra utilities (``optax._src.linear_algebra``) in torch:
:func:`power_iteration` (the dominant eigenpair of a matrix or of a matrix-vector
product over pytrees), :func:`matrix_inverse_pth_root` (Shampoo's coupled Newton
iteration for ``A^(-1/p)``) and :func:`nnls` (non-negative least squares by Polyak's
fast projected gradient).

These are utilities, not transforms: plain functions of tensors, run as eager torch ops.
optax runs its loops inside ``lax.while_loop``; here the loops are Python loops, and the
ones with a tolerance read one 0-d value on the host per iteration to decide whether to
go on (``nnls`` runs a fixed number of iterations and reads nothing).

``precision`` (optax: a ``jax.lax.Precision`` for the matmuls) is accepted and checked
but does not change how torch multiplies: torch's float32 matmul precision is a global
setting (``torch.set_float32_matmul_precision``, whose default ``"highest"`` matches
optax's default ``Precision.HIGHEST``), and these functions leave global state alone.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any

import torch

from ftopt import tree as tree_lib
from ftopt.domains import NONNEG, check_finite, check_int
from ftopt.sampling import Key, generator_for

__all__ = ["power_iteration", "matrix_inverse_pth_root", "nnls",
           "get_spectral_radius_upper_bound"]

# jax.lax.Precision's names and the strings JAX accepts for them.
_PRECISIONS = frozenset({"default", "high", "highest", "fastest", "bfloat16",
                         "tensorfloat32", "float32", "bfloat16_3x"})


def _check_precision(owner: str, precision: Any) -> None:
    name = getattr(precision, "name", precision)  # a jax.lax.Precision member, or a string
    if precision is not None and not (isinstance(name, str) and name.lower() in _PRECISIONS):
        raise ValueError(f"{owner}: precision must be None, a jax.lax.Precision or one of "
                         f"{sorted(_PRECISIONS)}, got {precision!r}")


def _square_matrix(owner: str, matrix: Any, argument: str = "matrix") -> torch.Tensor:
    if not isinstance(matrix, torch.Tensor):
        raise TypeError(f"{owner}: {argument} must be a tensor, got {type(matrix).__name__}")
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"{owner}: {argument} must be a square 2-D tensor, got shape "
                         f"{tuple(matrix.shape)}")
    if not (matrix.is_floating_point() or matrix.is_complex()):
        raise ValueError(f"{owner}: {argument} must be a floating tensor, got {matrix.dtype}")
    return matrix


# Tree arithmetic over flat lists of leaves (optax.tree's norm, scale and vdot).

def _norm(leaves: list[torch.Tensor]) -> torch.Tensor:
    """``sqrt(Σ |x|²)`` over every element of every leaf (``optax.tree.norm``)."""
    total = sum((x.real.square() + x.imag.square() if x.is_complex() else x.square()).sum()
                for x in leaves)
    return total.sqrt()


def _normalize(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    inv = 1.0 / _norm(leaves)
    return [inv * x for x in leaves]


def _vdot(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """``Σ conj(a)·b`` (``optax.tree.vdot``)."""
    return sum(((x.conj() if x.is_complex() else x) * y).sum() for x, y in zip(a, b))


def power_iteration(
    matrix: torch.Tensor | Callable[[Any], Any],
    *,
    v0: Any = None,
    num_iters: int = 100,
    error_tolerance: float = 1e-6,
    precision: Any = "highest",
    key: Key | None = None,
) -> tuple[torch.Tensor, Any]:
    r"""The dominant eigenvalue (largest in modulus) and its unit eigenvector, by power
    iteration (optax's ``power_iteration``; returns ``(eigenvalue, eigenvector)``).

    ``matrix`` is a square 2-D tensor ``M`` or a callable ``v ↦ M v`` over pytrees of
    tensors (a Hessian-vector product, say). From ``v = v0/‖v0‖`` and ``z = M v``,
    ``λ = 0``, each iteration sets ``v ← z/‖z‖``, ``z ← M v``, ``λ ← ⟨v, z⟩``; it stops
    after ``num_iters`` iterations or once ``|‖z − λ v‖ / λ| < error_tolerance``. It
    returns ``(λ, z/‖z‖)``: a 0-d tensor and a tree like ``v0`` (norms and inner products
    run over every leaf together). With ``num_iters=0`` that is ``(0, M v0/‖M v0‖)``.

    Args:
        matrix: a square tensor ``(n, n)`` or a matrix-vector-product callable.
        v0: the starting vector: a tensor ``(n,)`` for a tensor ``matrix`` (default: drawn
            uniformly in ``[-1, 1]`` with ``key``), a pytree of tensors, the callable's
            input, for a callable (required then).
        num_iters: the most iterations (an int >= 0).
        error_tolerance: the relative residual at which to stop (>= 0).
        precision: optax's matmul precision; checked, not applied (see the module
            docstring).
        key: the draw of the default ``v0``: an int seed or a ``torch.Generator``
            (``None``: seed 0, as optax's ``PRNGKey(0)``). The draw is torch's, not
            JAX's: the same seed gives another starting vector than optax's, so the
            iterates differ, not the limit.

    Raises:
        ValueError: ``v0`` missing for a callable, of the wrong shape for a tensor, or a
            product whose tree or shapes differ from ``v0``'s (naming the leaf's path).

    Example::

        eig, vec = ftopt.power_iteration(torch.tensor([[2.0, 0.0], [0.0, 1.0]]))
        # eig ≈ 2, vec ≈ ±[1, 0]

    The loop reads ``λ``'s residual test on the host once per iteration. A matrix whose
    dominant eigenvalue is not unique in modulus, or that is not diagonalizable, may not
    converge (as optax).
    """
    name = "power_iteration"
    num_iters = check_int(name, "num_iters", num_iters, 0, integral_floats=True)
    tol = check_finite(name, "error_tolerance", error_tolerance, NONNEG)
    _check_precision(name, precision)
    if callable(matrix) and not isinstance(matrix, torch.Tensor):
        if v0 is None:
            raise ValueError(f"{name}: v0 must be provided when `matrix` is a callable "
                             "(its tree structure is the callable's input)")
        mvp = matrix
    else:
        matrix = _square_matrix(name, matrix)
        n = matrix.shape[0]
        if v0 is None:
            gen = generator_for(name, 0 if key is None else key, matrix.device)
            real = matrix.real.dtype if matrix.is_complex() else matrix.dtype
            v0 = (2 * torch.rand(n, generator=gen, dtype=real, device=gen.device) - 1) \
                .to(device=matrix.device, dtype=matrix.dtype)
        elif not isinstance(v0, torch.Tensor) or tuple(v0.shape) != (n,):
            got = tuple(v0.shape) if isinstance(v0, torch.Tensor) else type(v0).__name__
            raise ValueError(f"{name}: v0 must be a tensor of shape ({n},) for a matrix of "
                             f"shape {tuple(matrix.shape)}, got {got}")
        dtype = torch.promote_types(matrix.dtype, v0.dtype)
        matrix, v0 = matrix.to(dtype), v0.to(dtype)
        mvp = functools.partial(torch.matmul, matrix)
    paths, flat, spec = tree_lib.flatten_with_paths(v0)
    if not flat:
        raise ValueError(f"{name}: v0 holds no tensor")
    for path, leaf in zip(paths, flat):
        if not isinstance(leaf, torch.Tensor) or not (leaf.is_floating_point()
                                                      or leaf.is_complex()):
            raise ValueError(f"{name}: v0 at {path} must be a floating tensor, got "
                             f"{getattr(leaf, 'dtype', type(leaf).__name__)}")

    def product(vs: list[torch.Tensor]) -> list[torch.Tensor]:
        out = tree_lib.flatten_like(spec, mvp(tree_lib.unflatten(spec, vs)),
                                    f"{name}: the matrix-vector product", paths, "v0")
        for path, v, z in zip(paths, vs, out):
            if not isinstance(z, torch.Tensor) or z.shape != v.shape:
                raise ValueError(f"{name}: the matrix-vector product at {path} must be a "
                                 f"tensor of v0's shape {tuple(v.shape)}, got "
                                 f"{getattr(z, 'shape', type(z).__name__)}")
        return out

    v = _normalize(flat)
    z = product(v)
    dtype = functools.reduce(torch.promote_types, [x.dtype for x in v + z])
    eig = torch.zeros((), dtype=dtype, device=flat[0].device)
    for _ in range(num_iters):
        residual = _norm([zi - eig * vi for zi, vi in zip(z, v)])
        if bool((residual / eig).abs() < tol):
            break
        v = _normalize(z)
        z = product(v)
        eig = _vdot(v, z)
    return eig, tree_lib.unflatten(spec, _normalize(z))


def _mat_power(m: torch.Tensor, p: int) -> torch.Tensor:
    """``m^p`` by repeated squaring (for p = 2, 4, 8 the products of optax's unrolled
    ``mat_power``)."""
    result = None
    while p:
        if p & 1:
            result = m if result is None else result @ m
        p >>= 1
        if p:
            m = m @ m
    return result


def matrix_inverse_pth_root(
    matrix: torch.Tensor,
    p: int,
    num_iters: int = 100,
    ridge_epsilon: float = 1e-6,
    error_tolerance: float = 1e-6,
    precision: Any = "highest",
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(A + ε I)^(-1/p)`` of a symmetric PSD matrix ``A`` by the coupled Newton
    iteration (Higham, *Functions of Matrices*, eq. 7.18), as optax's
    ``matrix_inverse_pth_root`` (Shampoo's). Returns ``(root, error)``.

    ``ε = ridge_epsilon · max(λ_max, 1e-16)`` with ``λ_max`` from :func:`power_iteration`
    (100 iterations, tolerance 1e-6, seed 0). With ``α = −1/p``, ``z = (1 + p) / (2‖A +
    εI‖_F)``, ``M₀ = z (A + εI)``, ``H₀ = z^(1/p) I``, each iteration sets
    ``Mᵢ = (1 − α) I + α M``, ``M ← Mᵢ^p M``, ``H ← H Mᵢ``, while fewer than ``num_iters``
    ran, ``max|M − I| > error_tolerance`` and the last step did not raise that error by
    more than 1.2×; after such a rise the previous ``H`` is returned. ``error`` is
    ``max|M − I|`` of the final ``M`` (a 0-d tensor; 0 for a 1×1 matrix, whose root is
    ``(A + ε)^α`` directly).

    The iteration runs in float32, or in the matrix's dtype where that is float64 (as
    optax under x64); the root is returned in the matrix's dtype.

    Args:
        matrix: the symmetric PSD matrix, ``(n, n)``.
        p: the root, a positive int.
        num_iters: the most iterations (an int >= 0).
        ridge_epsilon: the relative ridge (>= 0).
        error_tolerance: the ``max|M − I|`` at which to stop (>= 0).
        precision: optax's matmul precision; checked, not applied (module docstring).

    Deviation: optax computes ``Mᵢ^p`` with a switch over ``p ∈ {1, 2, 4, 8}`` indexed
    by ``round(log2 p)`` and clamped, so for any other ``p`` it iterates with another power
    and returns something that is not the inverse ``p``-th root. Here ``Mᵢ^p`` is the
    ``p``-th power for every ``p`` (the same products for 1, 2, 4 and 8), and ``α`` is
    taken in the iteration's dtype (optax rounds it to float32, exact for 1, 2, 4 and 8,
    not for other ``p``, where in float64 the iteration would stall near ``1e-7``).
    """
    name = "matrix_inverse_pth_root"
    matrix = _square_matrix(name, matrix)
    if matrix.is_complex():
        raise ValueError(f"{name}: matrix must be real, got {matrix.dtype}")
    p = check_int(name, "p", p, 1, integral_floats=True)
    num_iters = check_int(name, "num_iters", num_iters, 0, integral_floats=True)
    ridge_epsilon = check_finite(name, "ridge_epsilon", ridge_epsilon, NONNEG)
    tol = check_finite(name, "error_tolerance", error_tolerance, NONNEG)
    _check_precision(name, precision)
    n, device = matrix.shape[0], matrix.device
    dtype = torch.promote_types(matrix.dtype, torch.float32)
    alpha = -1.0 / p
    identity = torch.eye(n, dtype=dtype, device=device)
    max_ev, _ = power_iteration(matrix, num_iters=100, error_tolerance=1e-6)
    ridge = ridge_epsilon * torch.maximum(max_ev, max_ev.new_tensor(1e-16))
    if n == 1:
        root = (matrix + ridge) ** alpha
        return root.to(matrix.dtype), torch.zeros((), dtype=dtype, device=device)
    damped = matrix + ridge * identity
    z = (1 + p) / (2 * torch.linalg.matrix_norm(damped))
    mat_m = damped * z
    error = (mat_m - identity).abs().max()
    mat_h = identity * z ** (1.0 / p)
    old_mat_h, run_step, i = mat_h, True, 0
    while i < num_iters and run_step and bool(error > tol):
        mat_m_i = (1 - alpha) * identity + alpha * mat_m
        new_mat_m = _mat_power(mat_m_i, p) @ mat_m
        new_error = (new_mat_m - identity).abs().max()
        # the error may rise for a step before it falls; 1.2 bounds the rise allowed
        run_step = bool(new_error < error * 1.2)
        i, mat_m, old_mat_h, mat_h, error = i + 1, new_mat_m, mat_h, mat_h @ mat_m_i, new_error
    error = (mat_m - identity).abs().max()
    converged = float(run_step)  # optax blends arithmetically: NaNs in either H propagate
    root = converged * mat_h + (1 - converged) * old_mat_h
    return root.to(matrix.dtype), error


def get_spectral_radius_upper_bound(matrix: torch.Tensor) -> torch.Tensor:
    """``min(‖A‖_F, ‖A‖_1)`` (the 1-norm: the largest column sum of ``|A|``; 0 for an
    empty matrix), a bound on the spectral radius (as optax's
    ``get_spectral_radius_upper_bound``)."""
    fro = torch.linalg.matrix_norm(matrix)
    if matrix.numel() == 0:
        return torch.minimum(fro, torch.zeros_like(fro))
    return torch.minimum(fro, torch.linalg.matrix_norm(matrix, ord=1))


def nnls(
    A: torch.Tensor,  # noqa: N803 (optax's argument names)
    b: torch.Tensor,
    iters: int,
    unroll: int | bool = 1,
    L: float | torch.Tensor | None = None,  # noqa: N803
) -> torch.Tensor:
    r"""Non-negative least squares, ``argmin_{x ≥ 0} ‖A x − b‖₂``, by ``iters`` steps of
    Polyak's (2015) fast projected gradient, as optax's ``nnls``.

    With ``Q = Aᵀ A``, ``q = Aᵀ b``, ``L`` (default: ``min(‖Q‖_F, ‖Q‖_1)``, a bound on
    ``Q``'s spectral radius; 0 counts as 1) and ``x = p = 0``, ``c = 0``, each step sets
    ``c' = (1 + √(1 + 4c²))/2``, ``s = (c − 1)/c'``, ``x' = max(p − (Q p − q)/L, 0)``,
    ``p ← x' + s (x' − x)``, ``x ← x'``, ``c ← c'``. A 2-D ``b`` ``(M, K)`` solves the
    ``K`` problems at once.

    Args:
        A: ``(M, N)``.
        b: ``(M,)`` or ``(M, K)``.
        iters: the number of steps (an int >= 0).
        unroll: ``lax.scan``'s unroll in optax, a compilation hint; checked, no effect.
        L: an upper bound on the spectral radius of ``Aᵀ A`` (a number >= 0 or a 0-d
            tensor), or ``None``.

    Returns:
        ``x``, ``(N,)`` or ``(N, K)``, in the common dtype of ``A`` and ``b``.

    Example (optax's)::

        x = ftopt.nnls(torch.tensor([[1., 2.], [3., 4.]]), torch.tensor([5., 6.]), 1000)
        # x ≈ [0.00, 1.70]
    """
    name = "nnls"
    for argument, t, dims in (("A", A, (2,)), ("b", b, (1, 2))):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {argument} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name}: {argument} must be a real floating tensor, got "
                             f"{t.dtype}")
        if t.ndim not in dims:
            raise ValueError(f"{name}: {argument} must have {' or '.join(map(str, dims))} "
                             f"dimensions, got shape {tuple(t.shape)}")
    if b.shape[0] != A.shape[0]:
        raise ValueError(f"{name}: b must have A's number of rows {A.shape[0]}, got shape "
                         f"{tuple(b.shape)}")
    if A.device != b.device:
        raise ValueError(f"{name}: A is on {A.device} but b on {b.device}")
    iters = check_int(name, "iters", iters, 0)
    if not isinstance(unroll, bool):
        check_int(name, "unroll", unroll, 1)
    dtype = torch.promote_types(A.dtype, b.dtype)
    A, b = A.to(dtype), b.to(dtype)  # noqa: N806
    Q = A.mT @ A  # noqa: N806
    q = A.mT @ b
    if L is None:
        L = get_spectral_radius_upper_bound(Q)  # noqa: N806
    elif isinstance(L, torch.Tensor):
        if L.ndim != 0 or L.is_complex() or L.dtype == torch.bool:
            raise ValueError(f"{name}: L must be a number or a 0-d real tensor, got shape "
                             f"{tuple(L.shape)} and dtype {L.dtype}")
        L = L.to(device=A.device, dtype=dtype)  # noqa: N806
    elif isinstance(L, numbers.Real) and not isinstance(L, bool):
        L = torch.tensor(check_finite(name, "L", L, NONNEG), dtype=dtype, device=A.device)  # noqa: N806
    else:
        raise TypeError(f"{name}: L must be a number, a 0-d tensor or None, got "
                        f"{type(L).__name__}")
    L = torch.where(L == 0, torch.ones_like(L), L)  # noqa: N806 (no division by zero)
    x = torch.zeros(A.shape[-1:] + b.shape[1:], dtype=dtype, device=A.device)
    p, c = x, 0.0
    for _ in range(iters):
        cn = (1 + math.sqrt(1 + 4 * c * c)) / 2
        s = (c - 1) / cn
        xn = (p - (Q @ p - q) / L).clamp(min=0)
        x, p, c = xn, xn + s * (xn - x), cn
    return x
