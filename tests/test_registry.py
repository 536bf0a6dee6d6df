"""The test registry (``tests/registry.py``) covers every export of ``ftopt``.

A new export must land either in the registry (it builds a ``GradientTransformation``) or
in ``registry.NOT_TRANSFORMS`` (or, where the suites cannot drive it: params that are
not the gradients' tree, an update that needs more than the gradients, in
``registry.PARAMS_WRAPPERS`` with its own test file); an export annotated to return a
``GradientTransformation`` cannot hide in the second list. Every entry builds from its own
hyperparameter draws, and its traits match what the built transform does.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import random
import sys
import typing
from dataclasses import replace

import pytest
import registry
import torch
from fuzz_cases import RandomSource
from registry import BY_NAME, NOT_TRANSFORMS, PARAMS_WRAPPERS, TRANSFORMS, by_trait

import ftopt
from ftopt.base import GradientTransformation
from ftopt.stages import chain_stages

REGISTERED = {e.exported for e in TRANSFORMS}


def test_every_export_is_classified():
    exported = set(ftopt.__all__)
    wrappers = set(PARAMS_WRAPPERS)
    missing = exported - REGISTERED - NOT_TRANSFORMS - wrappers
    assert not missing, f"exports in neither the registry nor NOT_TRANSFORMS: {missing}"
    assert not REGISTERED & NOT_TRANSFORMS, REGISTERED & NOT_TRANSFORMS
    assert not wrappers & (REGISTERED | NOT_TRANSFORMS), wrappers & (REGISTERED | NOT_TRANSFORMS)
    assert not (REGISTERED | NOT_TRANSFORMS | wrappers) - exported, \
        "stale names in tests/registry.py"
    root = pathlib.Path(__file__).resolve().parent.parent
    for name, path in PARAMS_WRAPPERS.items():
        assert (root / path).is_file(), f"{name}: its test file {path} does not exist"


@pytest.mark.parametrize("name", sorted(NOT_TRANSFORMS))
def test_non_transforms_build_no_transform(name):
    obj = getattr(ftopt, name)
    if callable(obj) and not isinstance(obj, type):
        hints = typing.get_type_hints(obj) if hasattr(obj, "__annotations__") else {}
        assert hints.get("return") is not GradientTransformation, \
            f"ftopt.{name} returns a GradientTransformation: add it to tests/registry.py"


def _inner_for(e) -> dict:
    if e.kind != "combinator":
        return {}
    n = len(e.inner) or 1  # (partition and multi_transform take two)
    return {"inner": [ftopt.scale_by_adam() if i == 0 else ftopt.trace(0.5) for i in range(n)]}


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_entries_build_and_traits_hold(name):
    e = BY_NAME[name]
    src = RandomSource(random.Random(name))
    params = {"w": torch.randn(4, 3), "b": torch.randn(5)}
    grads = ftopt.tree.map(torch.randn_like, params)
    for tensors in (False, True):
        tx = e.make(**e.sample(src, tensors=tensors), **_inner_for(e))
        assert isinstance(tx, GradientTransformation)
        state = tx.init(params)
        new_p, new_state = ftopt.step(tx, params, grads, state, backend="eager")
        assert all(torch.isfinite(t).all() for t in ftopt.tree.leaves(new_p))
        if e.kind == "combinator":
            continue
        fields = {f for st in _states(state) for f in type(st)._fields}
        assert set(e.states) <= fields, (e.states, fields)
        has_count = any("count" in type(st)._fields for st in _states(state))
        assert has_count == e.counted, name
        found = chain_stages(tx, branches=True)  # (the fused planner's view)
        assert (found.reason is None or found.segmented) == e.fusible, found.reason
        q = ftopt.quantize_states(tx, bits=8, min_size=0)
        slots = _slot_layouts(q.init(params))
        eight = {n for n, layout in slots.items() if layout == {"8-bit"}}
        wide = {n for n, layout in slots.items() if layout == {torch.float32}}
        assert bool(eight) == e.eight_bit, f"{name}: 8-bit states {sorted(eight)}"
        assert eight <= set(e.states) and not eight & set(e.wide_states), (name, eight)
        assert set(e.wide_states) <= wide, f"{name}: {slots} (wide: {e.wide_states})"
        if e.eight_bit:
            assert set(e.states) - eight == set(e.wide_states), (name, slots)
            unmapped = eight - registry.SIGNED_STATES - registry.UNSIGNED_STATES
            assert not unmapped, (f"{name}: add {sorted(unmapped)} to SIGNED_STATES or "
                                  "UNSIGNED_STATES in tests/registry.py")


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_standalone_builds_from_the_defaults(name):
    """``standalone(entry)`` (its ``defaults()``, 0-d tensors where allowed) takes two
    steps, and the traits the suites rely on hold: ``moves``, ``stateful``,
    ``quantizable``."""
    e = BY_NAME[name]
    params = {"w": torch.randn(64, 80), "b": torch.randn(5)}
    grads = ftopt.tree.map(torch.randn_like, params)
    for bits in (32, 8):
        tx = registry.standalone(e, state_bits=bits, **{
            k: v for k, v in e.defaults(tensors=True).items() if isinstance(v, torch.Tensor)})
        state = tx.init(params)
        # two steps: ADOPT's first step only measures the second moment
        new_p, new_state = ftopt.step(tx, params, grads, state, backend="eager")
        new_p, _ = ftopt.step(tx, new_p, grads, new_state, backend="eager")
        assert all(torch.isfinite(t).all() for t in ftopt.tree.leaves(new_p))
        assert (not torch.equal(new_p["b"], params["b"])) == e.moves, name
        per_element = [t for t in ftopt.tree.leaves(state) if t.ndim]
        assert bool(per_element) == e.stateful, name
        codes = [t for t in ftopt.tree.leaves(state) if t.dtype == torch.uint8]
        eight = bits == 8 or e.defaults().get("bits") == 8  # quantize_states' own bits
        assert bool(codes) == (eight and e.quantizable), name


def _slot_layouts(state) -> dict[str, set]:
    """Each per-element state slot's name -> how its leaves are stored ("8-bit" or a dtype)."""
    out: dict[str, set] = {}
    for st in _states(state):
        for f in st._fields:
            v = getattr(st, f)
            if registry.leaf_state(st, f):
                continue
            leaves = [x for x in v.values() if x is not None] if isinstance(v, dict) else []
            if leaves and all(type(x).__name__ == "QuantizedSlot"
                              or (isinstance(x, torch.Tensor) and x.ndim > 0) for x in leaves):
                out.setdefault(f, set()).update(
                    "8-bit" if type(x).__name__ == "QuantizedSlot" else x.dtype for x in leaves)
    return out


def _states(state) -> list:
    """The NamedTuple states inside a state tree."""
    out = []

    def walk(x):
        if hasattr(x, "_fields"):
            out.append(x)
            for v in x:
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
    walk(state)
    return [s for s in out if type(s).__name__ != "QuantizedSlot"]


def test_by_trait():
    assert {e.name for e in by_trait(kind="alias", norms="leaf")} >= {"lamb", "lars"}
    assert all(e.fusible for e in by_trait(fusible=True))
    assert all(e.states for e in by_trait(states=True))
    assert "scale_by_adam" in {e.name for e in by_trait(eight_bit=True, kind="transform")}


# ------------------------------------------------------------------------------------------
# Coverage: the property suites take their cases from the registry
# ------------------------------------------------------------------------------------------


def _rows(fn, argname: str) -> list[dict]:
    """The parameter sets of ``fn``'s ``parametrize`` mark that names ``argname``, as dicts."""
    rows = []
    for mark in getattr(fn, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        argnames = mark.args[0]
        argnames = [a.strip() for a in (argnames.split(",") if isinstance(argnames, str)
                                        else argnames)]
        if argname not in argnames:
            continue
        for value in mark.args[1]:
            if type(value).__name__ == "ParameterSet":
                value = value.values
            elif len(argnames) == 1:
                value = (value,)
            rows.append(dict(zip(argnames, value)))
    assert rows, f"{fn.__name__} has no parametrize mark for {argname!r}"
    return rows


def _covered(module, test: str, argname: str = "name", **where) -> set[str]:
    """The registry names a suite's test runs with (rows matching ``where`` only)."""
    rows = _rows(getattr(module, test), argname)
    return {r[argname] for r in rows if all(r.get(k) == v for k, v in where.items())}


def _eight_bit_fusible():
    return [e for e in registry.fusible() if e.eight_bit]


def _fusible_without_params():
    return [e for e in registry.fusible() if not e.needs_params]


def _skip_singles():
    return [e for e in registry.TRANSFORMS
            if e.kind in ("transform", "combinator") and not e.mixes]


def _checkpoint_8bit():
    return [e for e in registry.TRANSFORMS if e.kind == "alias" or e.quantizable]


# (suite module, test, argname, row filter, the entries it must run with). Each migrated
# suite, each test that runs over all entries of a kind.
SUITES = [
    ("test_purity", "test_inputs_never_modified", "name", {}, lambda: registry.TRANSFORMS),
    ("test_nonfinite", "test_a_non_finite_gradient_raises_nothing", "name",
     {"backend": "eager"}, lambda: registry.TRANSFORMS),
    ("test_nonfinite", "test_a_non_finite_gradient_raises_nothing", "name",
     {"backend": "fused"}, registry.fusible),
    *[("test_pytrees", t, "name", {}, lambda: registry.TRANSFORMS) for t in (
        "test_tree_kinds_equal_flat_list", "test_none_gradient_leaf", "test_all_none_gradients",
        "test_none_param_leaf",
        "test_empty_tree", "test_zero_dim_and_empty_leaves",
        "test_zero_dim_leaves_with_tensor_hyperparameters")],
    *[("test_errors", t, "name", {}, lambda: registry.TRANSFORMS) for t in (
        "test_grads_missing_key", "test_grads_extra_key", "test_grads_list_length",
        "test_grads_wrong_container", "test_grad_shape_mismatch", "test_bad_grad_dtype",
        "test_bad_param_dtype")],
    *[("test_errors", t, "name", {}, registry.stateful) for t in (
        "test_state_tree_missing_key", "test_state_tree_extra_leaf", "test_state_shape_mismatch",
        "test_integer_state_leaf")],
    ("test_errors", "test_init_rejects_non_float_params", "name", {},
     lambda: [e for e in registry.stateful() if e.name != "masked"]),
    ("test_errors", "test_params_tree_mismatch", "name", {},
     lambda: by_trait(uses_params=True)),
    ("test_checkpoint", "test_roundtrip_continues_bit_identically", "name", {"bits": 32},
     lambda: registry.TRANSFORMS),
    ("test_checkpoint", "test_roundtrip_continues_bit_identically", "name", {"bits": 8},
     _checkpoint_8bit),
    ("test_fused", "test_fused_matches_eager_fp32", "name", {}, registry.fusible),
    ("test_fused_8bit", "test_fused_8bit_matches_eager", "name", {}, _eight_bit_fusible),
    ("test_fused_update", "test_fused_update_matches_eager", "name", {}, registry.fusible),
    ("test_fused_update", "test_fused_update_without_params", "name", {},
     _fusible_without_params),
    ("test_quantized_states", "test_all_zero_blocks_never_nan", "name", {},
     lambda: [e for e in registry.eight_bit() if not e.mixes]),
    *[("test_quantized_states", t, "name", {}, registry.eight_bit) for t in (
        "test_layout", "test_first_step_codes_use_the_right_map",
        "test_quantize_states_32_is_a_no_op",
        "test_save_load_continues_bit_identically")],
    *[("test_state_dtype", t, "name", {}, registry.eight_bit) for t in (
        "test_layout", "test_skip_zeros_is_exact")],
    ("test_state_dtype", "test_fused_matches_eager", "name", {}, _eight_bit_fusible),
    ("test_state_dtype", "test_checkpoint_round_trip", "name", {},
     lambda: [e for e in registry.eight_bit() if e.kind == "alias" and not e.mixes]),
    ("test_state_dtype", "test_tracks_float64_reference_within_rounding", "name", {},
     lambda: [e for e in registry.eight_bit()
              if e.kind == "alias" and not e.mixes and not e.running_scale]),
    ("test_muon_fused", "test_16bit_leaves_passed_through_a_segment_match_eager", "name",
     {}, lambda: [e for e in registry.fusible() if e.mixes]),
    ("test_skip_zeros", "test_skip_zeros", "name", {},
     lambda: by_trait(kind="alias", mixes=False)),
    ("test_aliases_vs_reference", "test_every_registry_alias_has_a_reference", "name", {},
     lambda: by_trait(kind="alias", mixes=False)),
    ("test_skip_zeros", "test_skip_zeros_wraps_a_single_transform", "name", {},
     _skip_singles),
]


@pytest.mark.parametrize("suite,test,argname,where,relevant", SUITES,
                         ids=[f"{s}::{t}-{'-'.join(map(str, w.values()))}".rstrip("-")
                              for s, t, _, w, _ in SUITES])
def test_suites_cover_the_registry(suite, test, argname, where, relevant):
    """Every relevant registry entry is among the suite's parameters (so a new entry is
    covered with no edit to the suite)."""
    module = importlib.import_module(suite)
    names = {e.name for e in relevant()}
    assert names, "no relevant entries: the trait filter is wrong"
    missing = names - _covered(module, test, argname, **where)
    assert not missing, f"{suite}::{test} does not run registry entries {sorted(missing)}"


def test_a_new_entry_reaches_every_suite(monkeypatch):
    """One added ``Entry`` (a copy of an existing transform, of an alias and of an alias
    with a matrix stage under new names) is picked up by every suite on import; the
    skip_zeros and reference suites, which need per-alias data (an oracle Case, a float64
    reference), fail (not skip) for the alias until that data is added."""
    new = [replace(BY_NAME["scale_by_adam"], name="scale_by_adam[new]"),
           replace(BY_NAME["adamw"], name="adamw[new]"),
           replace(BY_NAME["muon"], name="muon[new]")]
    monkeypatch.setattr(registry, "TRANSFORMS", [*TRANSFORMS, *new])
    monkeypatch.setattr(registry, "BY_NAME", {e.name: e for e in registry.TRANSFORMS})
    saved = {k: sys.modules.get(k) for k in ("tests.test_fused",)}
    try:
        sys.modules.pop("tests.test_fused", None)
        for suite, test, argname, where, relevant in SUITES:
            module = _fresh(suite)
            want = {e.name for e in relevant()} & {e.name for e in new}
            assert want, (suite, test)
            missing = want - _covered(module, test, argname, **where)
            assert not missing, f"{suite}::{test} misses the new entries {sorted(missing)}"
        skip = _fresh("test_skip_zeros")
        with pytest.raises(pytest.fail.Exception, match=r"'adamw\[new\]'.*CASES"):
            skip._case("adamw[new]")
        ref = _fresh("test_aliases_vs_reference")
        with pytest.raises(pytest.fail.Exception, match=r"'adamw\[new\]'.*REGISTRY_CASES"):
            ref.test_every_registry_alias_has_a_reference("adamw[new]")
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def _fresh(suite: str):
    """A new module object of ``tests/<suite>.py``, executed against the current registry."""
    path = pathlib.Path(__file__).with_name(f"{suite}.py")
    spec = importlib.util.spec_from_file_location(f"_fresh_{suite}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up while it runs)
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module
