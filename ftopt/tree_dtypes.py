"""optax's ``optax.tree`` dtype and random utilities over pytrees of torch tensors
(re-exported by :mod:`ftopt.tree`): ``cast``, ``cast_like``, ``dtype``, ``random_like``.

Dtype promotion is torch's (:func:`torch.promote_types`), which agrees with JAX's on
float and complex dtypes (bfloat16 with float16 gives float32) and on signed integers,
but not everywhere: torch does not promote uint16/32/64 at all (it raises), and it
promotes an integer with a float to the float (JAX without x64 may pick a wider one).
``random_like`` takes a :class:`torch.Generator` or an ``int`` seed where optax takes a
JAX key (see its docstring for how the draws differ).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import optree
import torch

from ftopt.tree_paths import checked_map, path_str

PyTree = Any
Sampler = Callable[[torch.Generator, tuple[int, ...], torch.dtype], torch.Tensor]

__all__ = ["cast", "cast_like", "dtype", "random_like"]


def _tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def cast(tree: PyTree, dtype: torch.dtype | None) -> PyTree:
    """Every leaf converted to ``dtype`` (``Tensor.to``: float to integer truncates
    toward zero); ``dtype=None`` returns ``tree`` itself."""
    if dtype is None:
        return tree
    return checked_map(lambda t: _tensor(t).to(dtype), [("tree", tree)])


def cast_like(tree: PyTree, other_tree: PyTree) -> PyTree:
    """Every leaf of ``tree`` converted to the dtype of the leaf of ``other_tree`` at the
    same path; where ``other_tree``'s leaf has no ``dtype`` (a Python number, a string)
    the leaf is left as it is."""
    return checked_map(
        lambda t, o: _tensor(t).to(o.dtype) if hasattr(o, "dtype") else t,
        [("tree", tree), ("other_tree", other_tree)])


def _lower(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The lower of two dtypes one of which promotes to the other."""
    promoted = torch.promote_types(a, b)
    if promoted == a:
        return b
    if promoted == b:
        return a
    raise ValueError(f"cannot compare dtypes {a} and {b}: neither promotes to the other "
                     f"(they promote to {promoted})")


def _higher(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return b if _lower(a, b) == a else a


def dtype(tree: PyTree, mixed_dtype_handler: str | None = None) -> torch.dtype:
    """The dtype of the tree's leaves.

    ``mixed_dtype_handler=None``: the leaves' common dtype; leaves of another dtype than
    the first leaf's raise ``ValueError`` naming their paths. ``'promote'``: the
    promotion of all the leaves' dtypes (:func:`torch.promote_types`). ``'highest'`` /
    ``'lowest'``: the highest / lowest dtype under the order ``a <= b`` iff ``a``
    promotes to ``b``; a pair of dtypes neither of which promotes to the other (float16
    and bfloat16) raises ``ValueError``. A tree with no leaf gives torch's default float
    dtype (optax: JAX's, float32). Python-number leaves count with the dtype
    :func:`torch.as_tensor` gives them.
    """
    paths, leaves = optree.tree_flatten_with_path(
        tree, none_is_leaf=False, namespace="ftopt")[:2]
    if not leaves:
        return torch.get_default_dtype()
    dtypes = [_tensor(x).dtype for x in leaves]
    if mixed_dtype_handler is None:
        bad = [f"expected dtype {dtypes[0]} at {path_str(p)}, got {d}"
               for p, d in zip(paths, dtypes) if d != dtypes[0]]
        if bad:
            raise ValueError("tree has mixed dtypes (pass mixed_dtype_handler="
                             "'promote', 'highest' or 'lowest'): " + "; ".join(bad))
        return dtypes[0]
    combine = {"promote": torch.promote_types, "highest": _higher,
               "lowest": _lower}.get(mixed_dtype_handler)
    if combine is None:
        raise ValueError(f"invalid mixed_dtype_handler={mixed_dtype_handler!r}; expected "
                         "None, 'promote', 'highest' or 'lowest'")
    return functools.reduce(combine, dtypes)


def _normal(generator: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype
            ) -> torch.Tensor:
    return torch.randn(shape, generator=generator, dtype=dtype, device=generator.device)


def random_like(
    rng: torch.Generator | int,
    target_tree: PyTree,
    sampler: Sampler = _normal,
    dtype: torch.dtype | None = None,
) -> PyTree:
    """A tree shaped like ``target_tree`` whose leaves are drawn by ``sampler``.

    ``sampler(generator, shape, dtype)`` returns a tensor of that shape and dtype on
    ``generator.device`` (default: standard normal, ``torch.randn``; any ``torch``
    sampling function taking ``generator=`` can be wrapped so). ``dtype`` overrides
    the leaves' dtypes. Each draw is moved to its leaf's device.

    ``rng`` is a :class:`torch.Generator`, which advances (draws continue the stream), or
    an ``int`` seed, for which a fresh generator seeded with it is made on each leaf
    device (the same seed gives the same tree; nothing outside is advanced).

    Differs from optax, which takes a JAX key and splits it into one key per leaf: here
    the leaves are drawn one after another from a single stream, in the tree's leaf
    order, so a leaf's values depend on the leaves before it, and no draw equals
    JAX's.
    """
    generators: dict[torch.device, torch.Generator] = {}

    def generator_for(device: torch.device) -> torch.Generator:
        if isinstance(rng, torch.Generator):
            return rng
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(int(rng))
        return generators[device]

    if not isinstance(rng, (torch.Generator, int)) or isinstance(rng, bool):
        raise TypeError(f"random_like: rng must be a torch.Generator or an int seed, got "
                        f"{type(rng).__name__}")

    def draw(leaf: Any) -> torch.Tensor:
        leaf = _tensor(leaf)
        out = sampler(generator_for(leaf.device), tuple(leaf.shape), dtype or leaf.dtype)
        return out.to(leaf.device)

    return checked_map(draw, [("target_tree", target_tree)])
