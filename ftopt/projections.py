r"""Euclidean projections onto convex sets (optax's ``optax.projections``), over pytrees.

Each ``projection_*`` returns :math:`\operatorname{argmin}_{p \in C} \|x - p\|_2^2` for
its set :math:`C`, where :math:`x` is every element of the input tree. The box-like sets
(non-negative orthant, box, hypercube, :math:`\ell_\infty` ball) act element by element;
the others (simplex, :math:`\ell_1` and :math:`\ell_2` balls and spheres, vector,
hyperplane, halfspace) treat the whole tree as one vector, as optax does. A use is
projected gradient descent: ``params = projection_simplex(apply_updates(params, u))``.

Conventions shared by every function:

* Pure: a new tree of the input's structure (``tree`` or ``x``) out, the inputs
  untouched; ``None`` subtrees stay ``None``.
* Leaves are dense real floating-point tensors (the whole-tree sets: on one device); a bad
  leaf or argument raises an error naming the function, the argument and the pytree path.
* Whole-tree sums, norms and the simplex's sort run in the widest leaf dtype, at least
  fp32; each output leaf has its input leaf's dtype (optax ravels to the common dtype and
  casts back too, but sums 16-bit trees in 16 bits).
* Differentiable with ``torch.autograd`` and ``torch.func`` (``grad``, ``jvp``, ``jacrev``,
  ``jacfwd``, ``vmap``): no host reads, no branch on a tensor's value. ``scale``, ``b``
  and box bounds may be tensors (differentiated and vmapped too); a Python number is
  checked here (finite; a radius > 0), a tensor's value is not read.

Differences from optax, where JAX and torch differ:

* Leaves must be tensors (optax also takes Python floats as leaves).
* A number or tensor bound of ``projection_box``/``projection_hypercube`` applies to
  every leaf (broadcast to its shape); optax needs a tree of bounds for a tree of several
  leaves.
* ``projection_l1_ball`` uses ``torch.where`` for ``jax.lax.cond``: both branches are
  computed, the gradient is the chosen one's (the identity inside the ball).
* :math:`|x|` has derivative 1 at 0 (JAX's convention; ``torch.abs``'s is 0), so the
  :math:`\ell_1` projections differentiate as optax's do.
* optax's custom JVP of the simplex projection is not needed: autograd through the
  closed form gives its Jacobian, :math:`\operatorname{diag}(s) - s s^\top/|s|` with
  :math:`s` the support of the projection.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from ftopt import tree as tree_lib

__all__ = [
    "projection_box", "projection_halfspace", "projection_hypercube",
    "projection_hyperplane", "projection_l1_ball", "projection_l1_sphere",
    "projection_l2_ball", "projection_l2_sphere", "projection_linf_ball",
    "projection_non_negative", "projection_simplex", "projection_vector",
]

Scalar = float | torch.Tensor


# --- argument checks -------------------------------------------------------------------

def _check_leaf(fn: str, arg: str, path: str, x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: {arg} at {path}: expected a tensor, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise TypeError(f"{fn}: {arg} at {path}: expected a dense tensor, got {x.layout}")
    if not x.is_floating_point():
        raise TypeError(f"{fn}: {arg} at {path}: expected a real floating-point tensor, "
                        f"got {x.dtype}")
    return x


def _leaves(fn: str, tree: Any, arg: str = "tree") -> tuple[list[str], list, Any]:
    """Paths, checked leaves and structure of ``tree``."""
    paths, flat, spec = tree_lib.flatten_with_paths(tree)
    return paths, [_check_leaf(fn, arg, p, x) for p, x in zip(paths, flat)], spec


def _one_device(fn: str, arg: str, paths: list[str], leaves: list,
                device: torch.device | None = None) -> torch.device | None:
    for path, x in zip(paths, leaves):
        device = x.device if device is None else device
        if x.device != device:
            raise ValueError(f"{fn}: {arg} at {path} is on {x.device}, expected {device} "
                             "(the projection treats the whole tree as one vector)")
    return device


def _scalar(fn: str, arg: str, value: Any, *, low: float | None = None,
            strict: bool = True) -> Scalar:
    """A number (checked: finite, ``> low`` or ``>= low``) or a 0-d real tensor."""
    if isinstance(value, torch.Tensor):
        if value.ndim != 0 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{fn}: {arg} must be a number or a 0-d real tensor, got a "
                             f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}")
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{fn}: {arg} must be a number or a 0-d real tensor, got "
                        f"{type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{fn}: {arg} must be finite, got {value}")
    if low is not None and (value <= low if strict else value < low):
        raise ValueError(f"{fn}: {arg} must be {'>' if strict else '>='} {low:g}, got {value}")
    return value


def _as(value: Scalar, like: torch.Tensor) -> torch.Tensor:
    """``value`` as a tensor of ``like``'s dtype and device (kept in the autograd graph)."""
    if isinstance(value, torch.Tensor):
        return value.to(like.device, like.dtype)
    return torch.scalar_tensor(value, dtype=like.dtype, device=like.device)


# --- whole-tree vectors ----------------------------------------------------------------

def _dtype(leaves: list) -> torch.dtype:
    dtype = torch.float32
    for x in leaves:
        dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def _ravel(leaves: list, dtype: torch.dtype, device: torch.device | None) -> torch.Tensor:
    if not leaves:
        return torch.zeros(0, dtype=dtype, device=device)
    return torch.cat([x.reshape(-1).to(dtype) for x in leaves])


def _unravel(spec: Any, vector: torch.Tensor, like: list) -> Any:
    parts = torch.split(vector, [x.numel() for x in like]) if like else []
    return tree_lib.unflatten(spec, [p.reshape(x.shape).to(x.dtype)
                                     for p, x in zip(parts, like)])


def _vector_op(fn: str, tree: Any, op: Any, *, nonempty: bool = False) -> Any:
    """``op(vector)`` on the whole tree as one vector, cast back leaf by leaf."""
    paths, leaves, spec = _leaves(fn, tree)
    device = _one_device(fn, "tree", paths, leaves)
    if nonempty and sum(x.numel() for x in leaves) == 0:
        raise ValueError(f"{fn}: tree has no elements (the set is empty in dimension 0)")
    return _unravel(spec, op(_ravel(leaves, _dtype(leaves), device)), leaves)


def _abs(v: torch.Tensor) -> torch.Tensor:
    """|v| with derivative 1 at 0, as JAX's."""
    return torch.where(v >= 0, v, -v)


def _unit_simplex(v: torch.Tensor) -> torch.Tensor:
    """The projection of the vector ``v`` onto {p >= 0, Σp = 1} (sort-based, exact)."""
    u = torch.sort(v, descending=True).values
    cumsum = torch.cumsum(u, 0)
    ind = torch.arange(1, v.shape[0] + 1, dtype=v.dtype, device=v.device)
    count = (1 / ind + (u - cumsum / ind) > 0).sum().clamp_min(1)
    top = cumsum.gather(0, (count - 1).reshape(1)).squeeze(0)
    k = count.to(v.dtype)
    return torch.relu(1 / k + (v - top / k))


def _simplex(v: torch.Tensor, scale: Scalar) -> torch.Tensor:
    scale = _as(scale, v)
    return scale * _unit_simplex(v / scale)


def _l1_sphere(v: torch.Tensor, scale: Scalar) -> torch.Tensor:
    return torch.sign(v) * _simplex(_abs(v), scale)


# --- element-wise sets -----------------------------------------------------------------

def _bound(fn: str, arg: str, bound: Any, spec: Any, paths: list[str]) -> list:
    """One bound per leaf: a number or tensor for every leaf, or a tree like ``tree``."""
    if isinstance(bound, (numbers.Real, torch.Tensor)):
        per_leaf = [bound] * len(paths)
    else:
        per_leaf = tree_lib.flatten_like(spec, bound, f"{fn}: {arg}", paths, "projected")
    for path, b in zip(paths, per_leaf):
        if isinstance(b, torch.Tensor):
            ok = not (b.is_complex() or b.dtype == torch.bool)
        else:
            ok = isinstance(b, numbers.Real) and not isinstance(b, bool)
        if not ok:
            got = b.dtype if isinstance(b, torch.Tensor) else type(b).__name__
            raise TypeError(f"{fn}: {arg} at {path}: expected a real number or tensor, "
                            f"got {got}")
        if not isinstance(b, torch.Tensor) and math.isnan(b):
            raise ValueError(f"{fn}: {arg} at {path} is nan")
    return per_leaf


def _broadcasts(shape: torch.Size, to: torch.Size) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``to`` (without growing it)."""
    if len(shape) > len(to):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(to)))


def _box(fn: str, tree: Any, lower: Any, upper: Any, names: tuple[str, str]) -> Any:
    paths, leaves, spec = _leaves(fn, tree)
    lows = _bound(fn, names[0], lower, spec, paths)
    highs = _bound(fn, names[1], upper, spec, paths)
    out = []
    for path, x, lo, hi in zip(paths, leaves, lows, highs):
        for arg, b in zip(names, (lo, hi)):
            if isinstance(b, torch.Tensor) and not _broadcasts(b.shape, x.shape):
                raise ValueError(f"{fn}: {arg} at {path} has shape {tuple(b.shape)}, "
                                 f"which does not broadcast to the leaf's {tuple(x.shape)}")
        out.append(torch.minimum(torch.maximum(x, _as(lo, x)), _as(hi, x)))
    return tree_lib.unflatten(spec, out)


def projection_non_negative(tree: Any) -> Any:
    r"""Projection onto the non-negative orthant, element by element.

    .. math:: \operatorname{argmin}_p \|x - p\|_2^2 \quad\text{s.t.}\quad p \ge 0,
       \qquad p = \max(x, 0).

    Args:
        tree: the tree to project.
    """
    paths, leaves, spec = _leaves("projection_non_negative", tree)
    return tree_lib.unflatten(spec, [torch.relu(x) for x in leaves])


def projection_box(tree: Any, lower: Any, upper: Any) -> Any:
    r"""Projection onto box constraints, element by element.

    .. math:: \operatorname{argmin}_p \|x - p\|_2^2 \quad\text{s.t.}\quad
       \text{lower} \le p \le \text{upper}, \qquad p = \min(\max(x, \text{lower}),
       \text{upper}).

    Where ``lower > upper`` the result is ``upper`` (``jnp.clip``'s and
    ``torch.clamp``'s rule). A bound of ``±inf`` leaves that side open.

    Args:
        tree: the tree to project.
        lower: the lower bound: a number or tensor used for every leaf, or a tree of
            ``tree``'s structure whose leaves are numbers or tensors that broadcast to the
            matching leaf.
        upper: the upper bound, the same way.
    """
    return _box("projection_box", tree, lower, upper, ("lower", "upper"))


def projection_hypercube(tree: Any, scale: Any = 1) -> Any:
    r"""Projection onto the hypercube :math:`[0, \text{scale}]` (the unit one by default).

    .. math:: \operatorname{argmin}_p \|x - p\|_2^2 \quad\text{s.t.}\quad
       0 \le p \le \text{scale}.

    A wrapper of :func:`projection_box` with ``lower=0, upper=scale``.

    Args:
        tree: the tree to project.
        scale: the side of the hypercube: a number or tensor, or a tree like ``tree``.
    """
    return _box("projection_hypercube", tree, 0.0, scale, ("lower", "scale"))


def projection_linf_ball(tree: Any, scale: Scalar = 1) -> Any:
    r"""Projection onto the :math:`\ell_\infty` ball of radius ``scale``.

    .. math:: \operatorname{argmin}_y \|x - y\|_2^2 \quad\text{s.t.}\quad
       \|y\|_\infty \le \text{scale}, \qquad y = \operatorname{clip}(x, -\text{scale},
       \text{scale}).

    Args:
        tree: the tree to project.
        scale: the radius, a number >= 0 or a 0-d tensor.
    """
    fn = "projection_linf_ball"
    scale = _scalar(fn, "scale", scale, low=0.0, strict=False)
    return _box(fn, tree, -scale, scale, ("scale", "scale"))


# --- whole-tree sets -------------------------------------------------------------------

def projection_simplex(tree: Any, scale: Scalar = 1) -> Any:
    r"""Projection onto the simplex of sum ``scale`` (the probability simplex by default).

    .. math:: \operatorname{argmin}_p \|x - p\|_2^2 \quad\text{s.t.}\quad p \ge 0,\;
       p^\top 1 = \text{scale}.

    With :math:`u` the elements of :math:`x/\text{scale}` sorted in decreasing order,
    :math:`k` the number of :math:`j` with :math:`1/j + u_j - \frac1j\sum_{i \le j} u_i
    > 0` and :math:`\tau = (\sum_{i \le k} u_i - 1)/k`:
    :math:`p = \text{scale}\cdot\max(x/\text{scale} - \tau, 0)`. The whole tree is one
    vector: the result sums to ``scale`` over all leaves together.

    Args:
        tree: the tree to project (at least one element).
        scale: the sum of the projection, a number > 0 or a 0-d tensor.

    Example (optax's): ``projection_simplex({"w": torch.tensor([2.5, 3.2]), "b":
    torch.tensor(0.5)})`` is ``{"w": [0.15, 0.85], "b": 0.0}``, of sum 1.
    """
    fn = "projection_simplex"
    scale = _scalar(fn, "scale", scale, low=0.0)
    return _vector_op(fn, tree, lambda v: _simplex(v, scale), nonempty=True)


def projection_l1_sphere(tree: Any, scale: Scalar = 1) -> Any:
    r"""Projection onto the :math:`\ell_1` sphere of radius ``scale``.

    .. math:: \operatorname{argmin}_y \|x - y\|_2^2 \quad\text{s.t.}\quad
       \|y\|_1 = \text{scale}, \qquad y = \operatorname{sign}(x) \odot
       P_{\text{simplex}(\text{scale})}(|x|).

    Args:
        tree: the tree to project (at least one element).
        scale: the radius, a number > 0 or a 0-d tensor.
    """
    fn = "projection_l1_sphere"
    scale = _scalar(fn, "scale", scale, low=0.0)
    return _vector_op(fn, tree, lambda v: _l1_sphere(v, scale), nonempty=True)


def projection_l1_ball(tree: Any, scale: Scalar = 1) -> Any:
    r"""Projection onto the :math:`\ell_1` ball of radius ``scale``.

    .. math:: \operatorname{argmin}_y \|x - y\|_2^2 \quad\text{s.t.}\quad
       \|y\|_1 \le \text{scale}:

    :math:`x` itself where :math:`\|x\|_1 \le \text{scale}`, else
    :func:`projection_l1_sphere` of it.

    Args:
        tree: the tree to project.
        scale: the radius, a number > 0 or a 0-d tensor.

    Example (optax's): ``projection_l1_ball({"w": torch.tensor([2.5, 3.2]), "b":
    torch.tensor(0.5)})`` is ``{"w": [0.15, 0.85], "b": 0.0}``, of ℓ1 norm 1.
    """
    fn = "projection_l1_ball"
    scale = _scalar(fn, "scale", scale, low=0.0)

    def op(v):
        return torch.where(_abs(v).sum() <= _as(scale, v), v, _l1_sphere(v, scale))

    return _vector_op(fn, tree, op)


def projection_l2_sphere(tree: Any, scale: Scalar = 1) -> Any:
    r"""Projection onto the :math:`\ell_2` sphere of radius ``scale``.

    .. math:: \operatorname{argmin}_y \|x - y\|_2^2 \quad\text{s.t.}\quad
       \|y\|_2 = \text{scale}, \qquad y = \frac{\text{scale}}{\|x\|_2}\,x.

    As in optax, :math:`x = 0` gives NaN (every point of the sphere is a solution).

    Args:
        tree: the tree to project (at least one element).
        scale: the radius, a number > 0 or a 0-d tensor.
    """
    fn = "projection_l2_sphere"
    scale = _scalar(fn, "scale", scale, low=0.0)
    return _vector_op(fn, tree, lambda v: _as(scale, v) / torch.sqrt((v * v).sum()) * v,
                      nonempty=True)


def projection_l2_ball(tree: Any, scale: Scalar = 1) -> Any:
    r"""Projection onto the :math:`\ell_2` ball of radius ``scale``.

    .. math:: \operatorname{argmin}_y \|x - y\|_2^2 \quad\text{s.t.}\quad
       \|y\|_2 \le \text{scale}, \qquad
       y = \frac{\text{scale}}{\sqrt{\max(\|x\|_2^2, \text{scale}^2)}}\,x

    (finite gradient at :math:`x = 0`, where it is the identity).

    Args:
        tree: the tree to project.
        scale: the radius, a number > 0 or a 0-d tensor.
    """
    fn = "projection_l2_ball"
    scale = _scalar(fn, "scale", scale, low=0.0)

    def op(v):
        s = _as(scale, v)
        squared = (v * v).sum()
        return s / torch.sqrt(torch.maximum(squared, s * s)) * v

    return _vector_op(fn, tree, op)


def _pair(fn: str, x: Any, a: Any) -> tuple[Any, list, torch.Tensor, torch.Tensor]:
    """(structure, x's leaves, x and a as vectors) of two trees of one structure and leaf
    shapes."""
    paths, xs, spec = _leaves(fn, x, "x")
    as_ = tree_lib.flatten_like(spec, a, f"{fn}: a", paths, "x")
    for path, xi, ai in zip(paths, xs, as_):
        if _check_leaf(fn, "a", path, ai).shape != xi.shape:
            raise ValueError(f"{fn}: a at {path} has shape {tuple(ai.shape)}, x has "
                             f"{tuple(xi.shape)}")
    device = _one_device(fn, "a", paths, as_, _one_device(fn, "x", paths, xs))
    dtype = _dtype(xs + as_)
    return spec, xs, _ravel(xs, dtype, device), _ravel(as_, dtype, device)


def _step(fn: str, x: Any, a: Any, b: Any, halfspace: bool) -> Any:
    """x + t·a with t = (b − ⟨x, a⟩)/⟨a, a⟩ (t <= 0 for the halfspace)."""
    b = _scalar(fn, "b", b)
    spec, xs, xv, av = _pair(fn, x, a)
    t = (_as(b, xv) - (xv * av).sum()) / (av * av).sum()
    if halfspace:
        t = torch.minimum(t, _as(0.0, xv))
    return _unravel(spec, xv + t * av, xs)


def projection_vector(x: Any, a: Any) -> Any:
    r"""Projection of ``x`` onto the line spanned by ``a``:

    .. math:: \operatorname{proj}_a x = \frac{\langle x, a\rangle}{\langle a, a\rangle}\,a.

    Args:
        x: the tree to project.
        a: the direction, a tree of ``x``'s structure and leaf shapes.
    """
    spec, xs, xv, av = _pair("projection_vector", x, a)
    return _unravel(spec, (xv * av).sum() / (av * av).sum() * av, xs)


def projection_hyperplane(x: Any, a: Any, b: Scalar) -> Any:
    r"""Projection onto the hyperplane :math:`\{y : \langle a, y\rangle = b\}`:

    .. math:: y = x + \frac{b - \langle x, a\rangle}{\langle a, a\rangle}\,a.

    Args:
        x: the tree to project.
        a: the normal, a tree of ``x``'s structure and leaf shapes.
        b: the offset, a number or a 0-d tensor.
    """
    return _step("projection_hyperplane", x, a, b, halfspace=False)


def projection_halfspace(x: Any, a: Any, b: Scalar) -> Any:
    r"""Projection onto the halfspace :math:`\{y : \langle a, y\rangle \le b\}`:

    .. math:: y = x + \min\Big(\frac{b - \langle x, a\rangle}{\langle a, a\rangle},
       0\Big)\,a.

    Args:
        x: the tree to project.
        a: the normal, a tree of ``x``'s structure and leaf shapes.
        b: the offset, a number or a 0-d tensor.
    """
    return _step("projection_halfspace", x, a, b, halfspace=True)
