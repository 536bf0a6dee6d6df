"""bf16/fp16 storage of per-element float states (``state_dtype=``).

Every registry entry with per-element float states (trait ``eight_bit``,
``tests/registry.py``), with ``state_dtype`` bf16 and fp16:

* layout: every float state leaf has the dtype (8-bit states where ``state_bits=8`` makes
  them, the dtype for the leaves below ``min_size``), but an entry's wide states (copies of
  the params, the registry's ``wide_states``), which keep the params' dtype;
* fused == eager: from the same inputs, one step gives bit-identical states and params
  (math in fp32, one rounding to nearest per store on both);
* skip_zeros: params and states bit-identical where the gradient is zero, on both
  backends; the control: without skip_zeros they change;
* ``torch.save`` / ``torch.load(weights_only=True)`` round-trips and continues bit-identically;
* against a float64 reference (``tests/reference.py``) whose state is rounded to the
  storage dtype after every step: within that rounding over 20 steps.
"""

from __future__ import annotations

import functools
import io
import math
import zlib

import pytest
import registry
import torch
from registry import standalone
from step_checks import (
    field_leaves,
    fresh_generator,
    with_zero_rows_and_columns,
    without_fields,
)

import ftopt
from ftopt.lowering import tiles

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
NAMES = registry.names(registry.eight_bit())
FUSIBLE = registry.names(e for e in registry.eight_bit() if e in registry.fusible())
# Matrix-stage aliases (``mixes``): their float64 references are in test_matrix_optimizers.
ALIASES = registry.names(e for e in registry.eight_bit() if e.kind == "alias" and not e.mixes)
# The float64 trajectory leaves out a ``running_scale`` (Prodigy's d: see the registry).
TRACKED = registry.names(e for e in registry.eight_bit()
                         if e.kind == "alias" and not e.mixes and not e.running_scale)


def _backends(names: list[str]) -> list[tuple[str, str]]:
    """(name, backend): eager for every name, fused for the fusible ones."""
    return [(n, "eager") for n in names] + [(n, "fused") for n in names if n in FUSIBLE]
SHAPES = {"w": (9, 70), "b": (70,), "s": (3,)}

pytestmark = pytest.mark.usefixtures("one_thread")


def _seed(*key) -> int:
    """A seed of its own for each test case, the same in every run (``hash`` of a string
    changes from one process to the next)."""
    return zlib.crc32(repr(key).encode())


def _tree(gen: torch.Generator, shapes=SHAPES, dtype=torch.float32) -> dict:
    return {k: torch.randn(s, generator=gen).to(dtype).to(DEVICE) for k, s in shapes.items()}


def _bits(x: torch.Tensor) -> torch.Tensor:
    if x.dtype in (torch.float16, torch.bfloat16):
        return x.view(torch.int16)
    if x.dtype == torch.float32:
        return x.view(torch.int32)
    return x


def _leaves(tree) -> list:
    return [x for x in ftopt.tree.leaves(tree) if isinstance(x, torch.Tensor)]


def _float_states(state, wide: frozenset[str] = frozenset()) -> list[torch.Tensor]:
    """The per-element float state leaves, but those of the slots named in ``wide`` (and
    the states of no element, registry.LEAF_STATES)."""
    kept = {id(x) for x in _leaves(without_fields(state, wide | registry.LEAF_STATES))}
    return [x for x in _leaves(state) if x.is_floating_point() and x.ndim > 0
            and id(x) in kept]


def _slot_dtypes(state, names: frozenset[str]) -> set:
    """The dtypes of the leaves of the slots named in ``names``."""
    if hasattr(state, "_fields"):
        return set().union(*(
            {x.dtype for x in _leaves(getattr(state, f))} if f in names
            else _slot_dtypes(getattr(state, f), names) for f in state._fields))
    if isinstance(state, (tuple, list, dict)):
        values = state.values() if isinstance(state, dict) else state
        return set().union(*(_slot_dtypes(x, names) for x in values))
    return set()


def _same(a, b) -> bool:
    la, lb = _leaves(a), _leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and torch.equal(_bits(x), _bits(y)) for x, y in zip(la, lb))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", NAMES)
def test_layout(name, dtype):
    dt = DTYPES[dtype]
    params = _tree(torch.Generator().manual_seed(0))
    state = standalone(name, state_dtype=dt).init(params)
    wide = registry.entry(name).wide(state_dtype=True)
    floats = _float_states(state, wide)
    assert floats and all(x.dtype == dt for x in floats)
    assert _slot_dtypes(state, wide) == ({torch.float32} if wide else set())
    # With 8-bit states: 8-bit for the big leaf, the dtype for the small ones.
    tx = ftopt.quantize_states(standalone(name), bits=8, min_size=512, state_dtype=dt)
    leaves = _leaves(tx.init(params))
    assert any(x.dtype == torch.uint8 for x in leaves)  # 8-bit codes
    # The rest: fp32 absmax (one per 256-block of the big leaf) and the dtype.
    assert {x.dtype for x in leaves if x.is_floating_point() and x.ndim} == {
        torch.float32, dt}


def test_default_and_bad_state_dtypes():
    params = {"w": torch.randn(4, 5, dtype=torch.float64)}
    assert _float_states(ftopt.adam(1e-3).init(params))[0].dtype == torch.float64
    state = ftopt.adam(1e-3, state_dtype=torch.float32).init(params)
    assert _float_states(state)[0].dtype == torch.float32
    with pytest.raises(ValueError, match="adamw: state_dtype"):
        ftopt.adamw(1e-3, state_dtype=torch.int8)
    with pytest.raises(TypeError, match="quantize_states: state_dtype"):
        ftopt.quantize_states(ftopt.adam(1e-3), state_dtype="bf16")


def _step(tx, params, grads, state, backend, donate=False):
    if donate:
        params = {k: v.clone() for k, v in params.items()}
        state = ftopt.tree.map(lambda x: x.clone(), state)
    return ftopt.step(tx, params, grads, state, backend=backend, donate=donate)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the largest magnitude (as test_fused.py)."""
    a, b = a.double(), b.double()
    if a.numel() == 0:
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _float64_state(tx, params, grads, state):
    """The same step in float64 on the eager backend (fp32 values widened, 16-bit states
    read as they are)."""
    up = lambda x: x.double() if x.dtype == torch.float32 else x  # noqa: E731
    return ftopt.step(tx, *(ftopt.tree.map(up, t) for t in (params, grads, state)),
                      backend="eager")[1]


def _order_spread(tx, params, grads, state, index: int, want: float, draws: int = 8) -> float:
    """The root mean square distance from ``want`` of leaf ``index`` of the eager fp32
    state (less its row states) after the same step with every leaf's elements permuted
    alike (one permutation per leaf shape, shared by the param, its gradient and its
    states): the elementwise
    math is unchanged, a global sum adds in another order. What either backend's order of
    addition may cost a sum that cancels."""
    shapes = {tuple(x.shape) for x in _leaves(params)}
    total = 0.0
    for k in range(draws):
        gen = torch.Generator().manual_seed(k)
        perm = {s: torch.randperm(math.prod(s), generator=gen) for s in shapes}

        def mix(x, perm=perm):
            p = perm.get(tuple(x.shape)) if x.ndim else None
            return x if p is None else x.flatten()[p.to(x.device)].view(x.shape)
        trees = (ftopt.tree.map(mix, t) for t in (params, grads, state))
        new = without_fields(ftopt.step(tx, *trees, backend="eager")[1], registry.LEAF_STATES)
        got = float(_leaves(new)[index])
        total += (got - want) ** 2
    return math.sqrt(total / draws)


def _check_close(a, b, step, reference=None, old=None, spread_of=None) -> dict:
    """16-bit states: identical but where the fp32 values of the two backends (which may
    differ in their last bit) straddle a rounding boundary of the storage dtype: then one
    ulp apart, for at most 2 + 1 in 200 of the elements. Returns, by leaf shape, where
    they differ. ``reference()``: the float64 state, ``spread_of(i, r)``: the spread of
    leaf ``i`` around ``r`` over orders of addition (see below).

    With ``FTOPT_FAST_MATH`` naming "16-bit states" (approximate square root and division
    on a GPU) fused agrees with eager within float rounding of the inputs: an element
    further apart is one ulp apart where |fused - eager| is within one 16-bit ulp plus 4
    fp32 ulps of its ``old`` state (a step that cancels the old state, as RMSprop's
    momentum trace can: H200, 8 bf16 codes for one fp32 ulp of the operands)."""
    fast = old is not None and "16-bit states" in tiles.FAST_MATH
    lo = _leaves(old) if fast else None
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb)
    apart_at: dict = {}
    total = count = 0
    for i, (x, y) in enumerate(zip(la, lb)):
        assert x.dtype == y.dtype
        if x.dtype not in (torch.float16, torch.bfloat16) and x.ndim == 0 \
                and x.is_floating_point():
            # A per-leaf or running value (NovoGrad's nu, Prodigy's numerator) comes from a
            # sum over elements, which each backend adds in its own order: within fp32
            # rounding, not bit for bit; where the sum cancels (Prodigy's Σ g·(x0 - p)),
            # fused as accurate as eager against float64 (as the fuzz's fused_vs_eager).
            err = abs(float(x) - float(y)) / max(abs(float(y)), 1e-30)
            if err > 1e-6 and reference is not None:
                # Where the sum cancels (D-Adaptation's Σ g·s/(√v + eps): Σ|terms| 140x
                # the sum), which order lands closest is luck: fused as close to float64
                # as eager, or within 4 RMS of the orders a permutation gives.
                r = float(_leaves(reference())[i])
                spread = 0.0 if spread_of is None else spread_of(i, r)
                err = abs(float(x) - r) - max(2 * abs(float(y) - r), 4 * spread) \
                    - 1e-6 * abs(r)
                assert err <= 0, (step, i, float(x), float(y), r, spread)
                continue
            assert err <= 1e-6, (step, i, float(x), float(y))
            continue
        if x.dtype not in (torch.float16, torch.bfloat16):
            assert torch.equal(_bits(x), _bits(y)), step
            continue
        apart = (_bits(x).int() - _bits(y).int()).abs()
        if fast:
            fi, f32 = torch.finfo(x.dtype), torch.finfo(torch.float32)
            within = ((x.float() - y.float()).abs()
                      <= fi.eps * y.float().abs() + 4 * f32.eps * lo[i].float().abs())
            apart = torch.where(within & (apart > 1), torch.ones_like(apart), apart)
        assert apart.max() <= 1, step
        total, count = total + x.numel(), count + int((apart > 0).sum())
        apart_at[x.shape] = apart_at.get(x.shape, False) | (apart > 0)
    assert count <= 2 + total // 200, (step, count, total)
    return apart_at


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", FUSIBLE)
def test_fused_matches_eager(name, dtype, skip):
    """Each step from the same params and 16-bit state: bit-identical on both backends
    (the chain's fp32 math is the same; each state is rounded once, to nearest)."""
    tx = standalone(name, state_dtype=DTYPES[dtype], skip_zeros=skip)
    gen = torch.Generator().manual_seed(_seed(name, dtype, skip))
    params = _tree(gen)
    state = tx.init(params)
    for step in range(3):
        grads = _tree(gen)
        grads["w"][:2] = 0.0
        pe, se = _step(tx, params, grads, state, "eager")
        pf, sf = _step(tx, params, grads, state, "fused", donate=step == 2)
        _check_rows(sf, se)
        rows = registry.LEAF_STATES

        def reference(tx=tx, params=params, grads=grads, state=state, rows=rows):
            return without_fields(_float64_state(tx, params, grads, state), rows)

        apart = _check_close(without_fields(sf, rows), without_fields(se, rows), step, reference,
                             old=without_fields(state, rows),
                             spread_of=functools.partial(_order_spread, tx, params, grads,
                                                         state))
        for k in pe:
            # As fp32 (test_fused.py): the backends may round the fp32 math differently
            # in the last bit (torch.lerp's multiply-add on the CPU); an element whose
            # state is one 16-bit ulp apart moves by up to that ulp of its update.
            same = ~apart.get(pe[k].shape, torch.zeros_like(pe[k], dtype=torch.bool))
            assert _rel_err(pf[k][same], pe[k][same]) <= 1e-6, (step, k)
        params, state = pe, se
    wide = registry.entry(name).wide(state_dtype=True)
    assert all(x.dtype == DTYPES[dtype] for x in _float_states(state, wide))


def _check_rows(a, b) -> None:
    """The states of no element (registry.LEAF_STATES) of two states: fp32, within 1e-5 (they are
    computed from a matrix stage's output, which amplifies last-bit differences)."""
    ra, rb = (field_leaves(s, registry.LEAF_STATES) for s in (a, b))
    assert len(ra) == len(rb)
    for x, y in zip(ra, rb):
        assert x.dtype == y.dtype == torch.float32
        assert _rel_err(x, y) <= 1e-5


def _rounding_cases() -> torch.Tensor:
    """fp32 values whose bf16/fp16 rounding is delicate: exact ties (to an even and to an
    odd neighbour), one fp32 ulp either side of them, overflow, denormals, NaN, Inf."""
    base = torch.randn(2000, dtype=torch.float64).mul(10.0 ** torch.randint(-8, 5, (2000,)))
    out = [base.float()]
    for dt in DTYPES.values():
        lo = base.to(dt)
        hi = torch.nextafter(lo.float(), torch.tensor(float("inf"))).to(dt)
        hi = torch.where(hi == lo, torch.nextafter(lo, torch.tensor(float("inf"), dtype=dt)),
                         hi)
        tie = (lo.double() + hi.double()) / 2  # exact in fp32 for these dtypes
        tie = tie[torch.isfinite(tie)].float()
        out += [tie, torch.nextafter(tie, torch.tensor(1e38)),
                torch.nextafter(tie, torch.tensor(-1e38))]
    fmax = torch.finfo(torch.float32).max
    out.append(torch.tensor([0.0, -0.0, 1e-45, -3e-39, 1e-40, fmax, -fmax, 3.3961e38,
                             65504.0, 65520.0, 65519.0, float("inf"), float("-inf"),
                             float("nan"), 6e-8, 3e-8, 1e-10]))
    return torch.cat(out)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # (the interpreter)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_one_rounding_to_nearest_per_store(dtype):
    """``trace(0)`` stores the gradient itself: the stored 16-bit state is torch's
    round-to-nearest-even of it on both backends (NaN, Inf, overflow and ties included)."""
    dt = DTYPES[dtype]
    g = _rounding_cases()
    tx = ftopt.quantize_states(ftopt.trace(0.0), bits=32, state_dtype=dt)
    params = {"w": torch.zeros_like(g).to(DEVICE)}
    want = (g + 0.0).to(dt)  # (u + 0 * 0: -0.0 becomes +0.0)
    for backend in ("eager", "fused"):
        _, state = ftopt.step(tx, params, {"w": g.to(DEVICE)}, tx.init(params),
                              backend=backend)
        got = state.trace["w"].cpu()
        assert got.dtype == dt
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan), backend
        assert torch.equal(_bits(got[~nan]), _bits(want[~nan])), backend
    # The control: truncating (the interpreter's own fp32 -> bf16 cast) differs on ties.
    trunc = (g.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    assert not torch.equal(_bits(trunc[~g.isnan()]), _bits(g.to(torch.bfloat16)[~g.isnan()]))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_entry_point_agrees(dtype):
    """``tx.update`` (fused: new states written to one buffer per role) and donated steps
    (written in place) store the same 16-bit states as a step on the same backend."""
    tx = ftopt.adamw(1e-2, weight_decay=0.1, state_dtype=DTYPES[dtype], skip_zeros=True)
    gen = fresh_generator()
    params = _tree(gen)
    state = tx.init(params)
    params, state = ftopt.step(tx, params, _tree(gen), state, backend="eager")
    grads = _tree(gen)
    grads["w"][:3] = 0.0
    for backend in ("eager", "fused"):
        _, want = ftopt.step(tx, params, grads, state, backend=backend)
        for _ in range(2):  # the second fused update reuses the first one's tables
            _, got = tx.update(grads, state, params, backend=backend)
            assert _same(got, want), backend
        _, got = _step(tx, params, grads, state, backend, donate=True)
        assert _same(got, want), backend


# -- skip_zeros ------------------------------------------------------------------------

CONTROL = {"adam", "adamw", "lion", "sgd[momentum]", "rmsprop", "ademamix", "scale_by_adam"}


def _at(tree_state, shape, where) -> list[torch.Tensor]:
    """The elements at ``where`` of every float state leaf shaped ``shape`` (16-bit, or a
    wide state in the params' dtype)."""
    return [_bits(x)[where].clone() for x in _leaves(tree_state)
            if x.shape == shape and x.is_floating_point()]


@pytest.mark.parametrize("name,backend", _backends(NAMES))
def test_skip_zeros_is_exact(name, backend):
    """Where the gradient is zero, params and 16-bit states are bit-identical; the
    control: without skip_zeros the same elements change."""
    dt = torch.bfloat16 if backend == "eager" else torch.float16
    gen = torch.Generator().manual_seed(_seed(name, backend))
    params0 = _tree(gen)
    grads = [_tree(gen) for _ in range(3)]
    zero = with_zero_rows_and_columns(grads)
    changed = False
    for skip in (True, False):
        tx = standalone(name, state_dtype=dt, skip_zeros=skip)
        params, state = params0, tx.init(params0)
        params, state = ftopt.step(tx, params, grads[0], state, backend=backend)
        for g in grads[1:]:
            before_p, before_s = params["w"].clone(), _at(state, zero.shape, zero)
            params, state = ftopt.step(tx, params, g, state, backend=backend)
            same_p = torch.equal(_bits(params["w"][zero]), _bits(before_p[zero]))
            now_s = _at(state, zero.shape, zero)
            same_s = all(torch.equal(a, b) for a, b in zip(now_s, before_s))
            if skip:
                assert before_s and same_p and same_s
            else:
                changed |= not (same_p and same_s)
    assert changed or name not in CONTROL


@pytest.mark.parametrize("name", registry.names(registry.by_trait(wide_follow_state_dtype=True)))
def test_bf16_store_keeps_negative_zero(name):
    """A bf16 state that holds -0.0 (a copy of a -0.0 param) keeps its bits where
    skip_zeros skips, on the fused backend as on the eager one (the fused bf16 store once
    broadcast its value by adding +0.0, which made -0.0 +0.0)."""
    tx = standalone(name, state_dtype=torch.bfloat16, skip_zeros=True)
    params = {"w": torch.tensor([-0.0, 1.0, -0.0, 2.0], device=DEVICE)}
    grads = {"w": torch.tensor([0.0, 1.0, 0.0, 1.0], device=DEVICE)}
    state = tx.init(params)
    before = [_bits(x).clone() for x in _leaves(state) if x.dtype == torch.bfloat16]
    assert before and any(bool((b == -32768).any()) for b in before)  # (-0.0's bits)
    for backend in ("eager", "fused"):
        _, new = ftopt.step(tx, params, grads, state, backend=backend)
        after = [_bits(x) for x in _leaves(new) if x.dtype == torch.bfloat16]
        for old, now in zip(before, after):
            assert torch.equal(now[[0, 2]], old[[0, 2]]), backend


# Quiet NaNs, with and without payloads and signs (a signalling NaN, made only by writing
# its bits, may come back quieted).
NAN_BITS = {torch.float16: [0xFE00, 0x7E01, 0x7FFF, 0xFFFF],
            torch.bfloat16: [0xFFC1, 0x7FC0, 0x7FFF, 0xFFFF]}


@pytest.mark.parametrize("skip", [True, False], ids=["skip_zeros", "no_skip"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", NAMES + registry.names(
    registry.by_trait(wide_follow_state_dtype=True)))
def test_a_nan_state_keeps_its_bits(name, dtype, skip):
    """A 16-bit state element that is a NaN keeps its bits where skip_zeros skips (the
    conversions through fp32 and the GPU's arithmetic give other NaNs), and where it
    steps and stays a NaN, with and without skip_zeros (the fused store reads the old
    bits again there); the other zero-gradient elements keep theirs under skip_zeros,
    the others change, on both backends."""
    dt = DTYPES[dtype]
    tx = standalone(name, state_dtype=dt, skip_zeros=skip)
    gen = torch.Generator().manual_seed(zlib.crc32(f"nan {name} {dtype}".encode()))
    params = {"w": torch.randn(300, generator=gen).to(DEVICE)}
    grads = {"w": torch.randn(300, generator=gen).to(DEVICE)}
    params, state = ftopt.step(tx, params, grads, tx.init(params), backend="eager")
    nans = torch.tensor(NAN_BITS[dt], dtype=torch.int32).to(torch.int16).to(DEVICE)
    halves = [x for x in _leaves(state) if x.dtype == dt and x.shape == (300,)]
    assert halves
    for x in halves:
        x.view(torch.int16)[:4] = nans  # (skipped below)
        x.view(torch.int16)[20:24] = nans  # (stepped)
    grads = {"w": torch.randn(300, generator=gen).to(DEVICE)}
    grads["w"][:10] = 0.0
    for backend in ("eager", "fused"):
        _, new = ftopt.step(tx, params, grads, state, backend=backend)
        after = [x for x in _leaves(new) if x.dtype == dt and x.shape == (300,)]
        for old, now in zip(halves, after):
            if skip:
                assert torch.equal(_bits(now)[:10], _bits(old)[:10]), backend
            for at in (slice(0, 4), slice(20, 24)):
                stays = torch.isnan(now[at])
                assert torch.equal(_bits(now)[at][stays], _bits(old)[at][stays]), backend
        assert any(not torch.equal(_bits(n)[30:], _bits(o)[30:])
                   for o, n in zip(halves, after)), backend


# -- checkpoints -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name,backend", _backends(ALIASES))
def test_checkpoint_round_trip(name, dtype, backend):
    dt = DTYPES[dtype]
    tx = standalone(name, state_dtype=dt, skip_zeros=True)
    gen = torch.Generator().manual_seed(_seed(name, dtype, backend))
    params = _tree(gen)
    state = tx.init(params)
    grads = [_tree(gen) for _ in range(5)]
    for g in grads[:2]:
        g["w"][:3] = 0.0
        params, state = ftopt.step(tx, params, g, state, backend=backend)
    buf = io.BytesIO()
    torch.save({"params": params, "state": state}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert type(loaded["state"]) is type(state) and _same(loaded["state"], state)
    wide = registry.entry(name).wide(state_dtype=True)
    assert all(x.dtype == dt for x in _float_states(loaded["state"], wide))
    pa, sa, pb, sb = params, state, loaded["params"], loaded["state"]
    for g in grads[2:]:
        pa, sa = ftopt.step(tx, pa, g, sa, backend=backend)
        pb, sb = ftopt.step(tx, pb, g, sb, backend=backend)
        assert _same(pa, pb) and _same(sa, sb)


# -- against float64 -------------------------------------------------------------------

# reference state -> the ftopt slot it is, where the names differ (the first one the state
# holds; a slot of the reference's own name comes first)
REF_NAMES = {"tr": ("trace",), "s": ("sum_of_squares", "grad_sum"), "m": ("ema", "exp_avg"),
             "prev": ("previous_gradient",), "v": ("exp_avg_sq",), "x0": ("params0",)}


def _slot_name(ref_name: str, slots: dict) -> str:
    return next((n for n in (ref_name, *REF_NAMES.get(ref_name, ())) if n in slots), ref_name)


def _slots(state, out=None) -> dict:
    """ftopt slot name -> {leaf key: tensor}, from every stage state in ``state``."""
    out = {} if out is None else out
    if hasattr(state, "_fields"):
        for field in state._fields:
            value = getattr(state, field)
            if isinstance(value, dict):
                out[field] = value
            elif isinstance(value, tuple):
                _slots(value, out)
    elif isinstance(state, (tuple, list)):
        for x in state:
            _slots(x, out)
    return out


def _tracked() -> list[tuple[str, str, str]]:
    """(name, dtype, backend): eager at both dtypes, fused at bf16. Fused steps equal
    eager's at both dtypes (``test_fused_matches_eager``, 3 steps on from each state), so
    fused at fp16 adds 20 interpreted steps a case (~0.6 s) and nothing the others miss."""
    return [(n, d, b) for n, b in _backends(TRACKED) for d in DTYPES
            if b == "eager" or d == "bf16"]


@pytest.mark.parametrize("name,dtype,backend", _tracked())
def test_tracks_float64_reference_within_rounding(name, dtype, backend):
    """20 steps against the float64 reference (``tests/reference.py``) whose states are
    rounded to the storage dtype after each step (the semantics: exact reads, one rounding
    per store). Both round at the same places, so states agree bit for bit except where the
    fp32 and fp64 values of a step straddle a rounding boundary (then about one ulp at the
    element's peak magnitude, for at most 1% of the elements), and params agree to fp32
    rounding (relative 1e-6 of max(|p|, 1), as the fp32 reference suite) wherever the states
    always agreed. Wide states (copies of the params, fp32) agree as params do."""
    import test_aliases_vs_reference as A

    dt = DTYPES[dtype]
    case = registry.require(A.REGISTRY_CASES, name, "float64 reference case",
                            "tests/test_aliases_vs_reference.py::REGISTRY_CASES")
    make_tx, make_ref = A.CASES[case]
    tx = ftopt.quantize_states(make_tx(), bits=32, state_dtype=dt)
    ref = make_ref()
    gen = torch.Generator().manual_seed(_seed(name, dtype, backend))
    params = {k: v.to(DEVICE) for k, v in A._params(gen, torch.float32).items()}
    state = tx.init(params)
    slots = _slots(state)
    wide = registry.entry(name).wide()  # (quantize_states' state_dtype leaves them fp32)

    def stored(n: str, value):
        """The reference's state as ftopt stores it: rounded to ``dt``, but a number (a
        per-leaf state, NovoGrad's nu: fp32 whatever state_dtype says) or a wide state."""
        if not isinstance(value, torch.Tensor) or _slot_name(n, slots) in wide:
            return value
        return value.to(dt).to(torch.float64)

    ref_params = {k: v.double() for k, v in params.items()}
    for k, p in ref_params.items():  # the initial states are stored (rounded) too
        first = {n: stored(n, v) for n, v in ref.init_leaf(p).items()}
        if first:  # (RefProdigy makes its state at its first step: zeros and a copy)
            ref.state[k] = first
    diverged = {k: torch.zeros(v.shape, dtype=torch.bool, device=DEVICE)
                for k, v in params.items()}

    def fp32_close(ours: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
        return (ours.double() - want).abs() <= 1e-6 * want.abs().clamp_min(1.0)
    apart = total = 0
    peak: dict = {}
    finfo = torch.finfo(dt)
    for step in range(20):
        grads = {k: v.to(DEVICE) for k, v in A._grads(gen, torch.float32).items()}
        params, state = ftopt.step(tx, params, grads, state, backend=backend)
        ref_params = ref.step(ref_params, grads)
        slots = _slots(state)
        for k, st in ref.state.items():
            for n, value in st.items():
                if not isinstance(value, torch.Tensor):
                    continue  # (filled at its first step; or a per-leaf number, see above)
                st[n] = stored(n, value)  # the reference's one rounding
                if n == "tr" and n not in slots and "trace" not in slots:
                    continue  # (RefRMSprop keeps an unused trace without momentum)
                key = _slot_name(n, slots)
                ours = slots[key][k]
                assert ours.dtype == (torch.float32 if key in wide else dt), (key, ours.dtype)
                if key in wide:
                    assert fp32_close(ours.cpu(), st[n].cpu()).all(), (step, k, n)
                    continue
                # One rounding apart at the element's largest magnitude so far (a value
                # that then shrinks keeps that absolute difference, or less).
                peak[k, n] = torch.maximum(peak.get((k, n), st[n].abs()), st[n].abs())
                gap = (ours.double() - st[n]).abs()
                assert (gap <= 2 * finfo.eps * peak[k, n] + 2 * finfo.smallest_normal *
                        finfo.eps).all(), (step, k, n)
                diverged[k] |= gap > 0
                apart, total = apart + int((gap > 0).sum()), total + gap.numel()
        for k, p in params.items():
            ok = ~diverged[k].cpu()
            assert fp32_close(p.cpu(), ref_params[k].cpu())[ok].all(), (step, k)
    assert apart <= 2 + total // 100, (apart, total)


# (the interpreter computes the tail block's lanes past the leaf's end too: 0/0 with
# eps=0, never stored)
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide")
def test_fast_math_square_root_keeps_denormals(monkeypatch):
    """The approximate square root flushes denormal inputs on a GPU; the fast-math
    kernels scale them into the normal range first, so Adam with eps=0 and gradients
    whose squares are denormal (1e-20: 1e-40) steps as eager does, not by an infinite
    update. Under the interpreter the scaled root is exact: the same bits as eager."""
    from ftopt.lowering import codegen
    from ftopt.lowering.plan import plan_chain

    monkeypatch.setattr(tiles, "FAST_MATH", frozenset({"16-bit", "16-bit states"}))
    gen = torch.Generator().manual_seed(6)
    n = 2000
    sign = torch.randint(0, 2, (n,), generator=gen) * 2.0 - 1.0
    g = sign * 10.0 ** (torch.rand(n, generator=gen) * 2.5 - 22.0)  # g**2: 1e-44 - 1e-39
    g[:6] = torch.tensor([1e-20, -1e-20, 3e-22, 1.5e-22, -2e-21, 1e-19])
    p = {"w": torch.randn(n, generator=gen).to(DEVICE, torch.bfloat16)}
    grads = {"w": g.to(DEVICE)}
    assert (g.square() < torch.finfo(torch.float32).tiny).sum() > n // 4
    tx = ftopt.adam(1e-3, b2=0.0, eps=0.0, state_dtype=torch.bfloat16)  # (nu = g**2)
    s = tx.init(p)
    (pf, sf), (pe, se) = (ftopt.step(tx, p, grads, s, backend=b) for b in ("fused", "eager"))
    assert torch.isfinite(pf["w"].float()).all()
    torch.testing.assert_close(pf["w"].float(), pe["w"].float(), rtol=2 ** -7, atol=0)
    traced = plan_chain(tx).traced(False)
    for fast in (False, True):
        variant = codegen.Variant(torch.bfloat16, torch.float32, True, True,
                                  fast_math=fast)
        assert ("ftopt_fast_sqrt(" in codegen.main_source(traced, variant)) == fast


def test_fast_math_check_admits_rounding_of_the_inputs_only(monkeypatch):
    """Under fast math a 16-bit state more than one code from eager's is admitted where
    the step cancelled its old state (the H200's RMSprop element: trace -0.0317, new
    5.2e-8 against 5.4e-8, 8 bf16 codes, within 4 fp32 ulps of 0.0317); without fast math,
    or four times that bound away, it is not."""
    old = {"t": torch.tensor([-0.03173828125], dtype=torch.bfloat16)}
    eager = {"t": torch.tensor([5.4016709327697754e-08], dtype=torch.bfloat16)}
    fused = {"t": torch.tensor([5.21540641784668e-08], dtype=torch.bfloat16)}
    # (the bound: 4 fp32 ulps of 0.0317, 1.5e-8; 6e-8 is four times that)
    far = {"t": torch.tensor([5.4016709327697754e-08 + 6e-8], dtype=torch.bfloat16)}
    assert int((_bits(fused["t"]).int() - _bits(eager["t"]).int()).abs()) == 8
    monkeypatch.setattr(tiles, "FAST_MATH", frozenset())
    with pytest.raises(AssertionError):
        _check_close(fused, eager, 0, old=old)
    monkeypatch.setattr(tiles, "FAST_MATH", frozenset({"16-bit states"}))
    _check_close(fused, eager, 0, old=old)
    with pytest.raises(AssertionError):
        _check_close(far, eager, 0, old=old)


def test_fast_math_keeps_the_8bit_encoder_exact(monkeypatch):
    """With fast math on the 8-bit layout only the update's square root and division are
    approximate: the encoder keeps its correctly rounded division by the block's absmax,
    so Adam's states (computed without either) get eager's codes, and the params stay
    within fp32 rounding of eager's (4 ulps of the largest of the param before the step,
    after it, and the step itself: where a param crosses zero the step is the larger)."""
    from ftopt.lowering import codegen, quantized
    from ftopt.lowering.plan import plan_chain

    monkeypatch.setattr(tiles, "FAST_MATH", frozenset({"8-bit"}))
    tx = ftopt.adam(1e-2, state_bits=8)
    gen = fresh_generator()
    seed = gen.initial_seed()
    p = {"w": torch.randn(3 * 4096 + 300, generator=gen).to(DEVICE)}
    s = tx.init(p)
    for _ in range(3):
        g = {"w": torch.randn(p["w"].shape, generator=gen).to(DEVICE)}
        (pf, sf), (pe, se) = (ftopt.step(tx, p, g, s, backend=b) for b in ("fused", "eager"))
        assert torch.equal(sf[0].mu["w"].codes, se[0].mu["w"].codes)
        assert torch.equal(sf[0].nu["w"].codes, se[0].nu["w"].codes)
        # (relative to the largest of the param before and after the step and the step:
        # seed 33's second step takes -0.00569 to 0.00429, 3 ulps of the step apart)
        largest = torch.stack([p["w"].abs(), pe["w"].abs(), (pe["w"] - p["w"]).abs()])
        bound = 4 * torch.finfo(torch.float32).eps * largest.amax(0)
        assert ((pf["w"] - pe["w"]).abs() <= bound).all(), seed
        p, s = pe, se
    traced = plan_chain(tx).traced(True)
    variant = codegen.Variant(torch.float32, torch.float32, True, True, quant_block=256,
                              fast_math=True, encoder=quantized.ENCODER)
    source = codegen.main_source(traced, variant)
    assert "ftopt_fast_sqrt(" in source and "tl.fdiv(" in source
    assert all("tl.fdiv(" not in line for line in source.splitlines()
               if line.lstrip().startswith("q_"))
    assert "tl.div_rn(1.0, q_st0_mu_ms)" in source


@pytest.mark.parametrize("eight", [True, False], ids=["8-bit", "fp32 states"])
def test_a_norms_reduction_kernel_takes_the_main_kernels_math(eight):
    """A trust ratio's norm is of the u it scales: each square root and division of the
    reduction kernels is the main kernel's line, approximate under fast math and correctly
    rounded without (seed 106 of the GPU fuzz: LAMB's u cancelling 33-fold, rounded
    otherwise in the two kernels, put 2e-6 into the update)."""
    from ftopt.lowering import codegen, quantized
    from ftopt.lowering.plan import plan_chain

    tx = ftopt.lamb(1e-3, state_bits=8 if eight else 32)
    traced = plan_chain(tx).traced(eight)
    assert traced.levels >= 1

    def math(source):
        return {line.strip() for line in source.splitlines()
                if "sqrt" in line or "div" in line} - {"def ftopt_fast_sqrt(x):"}

    for fast in (False, True):
        variant = codegen.Variant(torch.float32, torch.float32, True, True,
                                  quant_block=256 if eight else 0, fast_math=fast,
                                  encoder=quantized.ENCODER if eight else "arithmetic")
        main = math(codegen.main_source(traced, variant))
        reduced = set().union(*(math(codegen.reduction_source(traced, level, variant))
                                for level in range(traced.levels + 1)))
        assert reduced and reduced <= main, reduced - main
        assert any("ftopt_fast_sqrt(" in line for line in reduced) == fast


def test_stochastic_rounding_with_a_frozen_none_param_fused_equals_eager():
    """A param held as ``None`` (frozen) counts as a leaf in the rounding's hash (as in
    add_noise's): fused and eager store the same bits, and the other leaves the bits
    they store with it a tensor."""
    gen = torch.Generator().manual_seed(21)
    params = {"a": torch.randn(5, generator=gen), "b": torch.randn(300, generator=gen),
              "c": torch.randn(7, 5, generator=gen)}
    grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
    params = {k: v.to(DEVICE) for k, v in params.items()}
    grads = {k: v.to(DEVICE) for k, v in grads.items()}
    tx = ftopt.adam(1e-2, state_dtype=torch.bfloat16, state_rounding="stochastic")
    frozen_p, frozen_g = {**params, "a": None}, {**grads, "a": None}
    out = {}
    for backend in ("eager", "fused"):
        _, full = ftopt.step(tx, params, grads, tx.init(params), backend=backend)
        _, out[backend] = ftopt.step(tx, frozen_p, frozen_g, tx.init(frozen_p),
                                     backend=backend)
        for name in ("mu", "nu"):
            for k in "bc":
                assert torch.equal(getattr(out[backend][0], name)[k],
                                   getattr(full[0], name)[k]), (backend, name, k)
    for name in ("mu", "nu"):
        for k in "bc":
            assert torch.equal(getattr(out["fused"][0], name)[k],
                               getattr(out["eager"][0], name)[k]), (name, k)


@pytest.mark.parametrize("rounding,skip,want", [
    ("nearest", False, True), ("nearest", True, True),
    ("stochastic", False, False), ("stochastic", True, True)])
def test_bf16_stores_take_the_conversion_instruction_where_it_is_faster(
        monkeypatch, rounding, skip, want):
    """Compiled for a device (``lanes.BF16_CONVERT``), a bf16 state's store rounds by the
    conversion instruction, except stochastic rounding's kernels without skip_zeros,
    whose values are bf16 values already (their integer lines fold into a shift); under
    the interpreter (its cast truncates) every store takes the integer lines."""
    from ftopt.lowering import codegen, lanes
    from ftopt.lowering.plan import plan_chain

    tx = ftopt.adam(1e-3, state_dtype=torch.bfloat16, state_rounding=rounding,
                    skip_zeros=skip)
    traced = plan_chain(tx).traced(True)
    variant = codegen.Variant(torch.bfloat16, torch.bfloat16, True, True, slot_dtypes=(
        ("st0_mu", torch.bfloat16), ("st0_nu", torch.bfloat16)))
    instruction = ".to(tl.bfloat16).to(tl.uint16, bitcast=True)"
    integer = "+ 32767 + ("
    for convert in (True, False):
        monkeypatch.setattr(lanes, "BF16_CONVERT", convert)
        source = codegen.main_source(traced, variant)
        assert source.count("tl.store(") >= 3
        assert (instruction in source) == (convert and want), (convert, source)
        assert (integer in source) == (not (convert and want)), (convert, source)
