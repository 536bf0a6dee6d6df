"""optax's older ``optax.tree_utils`` namespace: :mod:`ftopt.tree`'s functions under their
``tree_``-prefixed names (``tree_norm``, ``tree_update_moment``, ``tree_get``, ...), for
code written against it. JAX's PRNG-key helpers (``tree_split_key_like``,
``tree_unwrap_random_key_data``) have no torch counterpart and are left out, as in
:mod:`ftopt.tree`."""

from __future__ import annotations

from ftopt import tree as _tree
from ftopt.tree import NamedTupleKey

tree_add = _tree.add
tree_add_scale = _tree.add_scale
tree_allclose = _tree.allclose
tree_batch_shape = _tree.batch_shape
tree_bias_correction = _tree.bias_correction
tree_cast = _tree.cast
tree_cast_like = _tree.cast_like
tree_clip = _tree.clip
tree_conj = _tree.conj
tree_div = _tree.div
tree_dtype = _tree.dtype
tree_full_like = _tree.full_like
tree_get = _tree.get
tree_get_all_with_path = _tree.get_all_with_path
tree_map_params = _tree.map_params
tree_max = _tree.max
tree_min = _tree.min
tree_mul = _tree.mul
tree_norm = _tree.norm
tree_ones_like = _tree.ones_like
tree_random_like = _tree.random_like
tree_real = _tree.real
tree_scale = _tree.scale
tree_set = _tree.set
tree_size = _tree.size
tree_sub = _tree.sub
tree_sum = _tree.sum
tree_update_infinity_moment = _tree.update_infinity_moment
tree_update_moment = _tree.update_moment
tree_update_moment_per_elem_norm = _tree.update_moment_per_elem_norm
tree_vdot = _tree.vdot
tree_where = _tree.where
tree_zeros_like = _tree.zeros_like

__all__ = [
    "NamedTupleKey",
    "tree_add", "tree_add_scale", "tree_allclose", "tree_batch_shape",
    "tree_bias_correction", "tree_cast", "tree_cast_like", "tree_clip", "tree_conj",
    "tree_div", "tree_dtype", "tree_full_like", "tree_get", "tree_get_all_with_path",
    "tree_map_params", "tree_max", "tree_min", "tree_mul", "tree_norm", "tree_ones_like",
    "tree_random_like", "tree_real", "tree_scale", "tree_set", "tree_size", "tree_sub",
    "tree_sum", "tree_update_infinity_moment", "tree_update_moment",
    "tree_update_moment_per_elem_norm", "tree_vdot", "tree_where", "tree_zeros_like",
]
