"""Stochastic rounding of bf16 states (``state_rounding="stochastic"``).

* fused == eager, bit for bit, over several steps (with and without skip_zeros);
* unbiased: the mean of many stochastically rounded copies of a value is the value
  (within a tight bound), where rounding to nearest is off by 0.3 ulp; the dither changes
  from one step to the next;
* exact bf16 values, NaN, +-inf, +-0.0 and the largest finite values on both backends;
* skip_zeros keeps the stored bits where the gradient is zero (the control: without it
  they change);
* a checkpoint round trip continues bit-identically;
* bad option values are refused with a message naming the option.
"""

from __future__ import annotations

import io
from typing import Any, NamedTuple

import pytest
import torch
from step_checks import with_zero_rows_and_columns

import ftopt
from ftopt.base import register_state
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule, Slot

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16_MAX = 3.3895313892515355e38

pytestmark = pytest.mark.usefixtures("one_thread")


@register_state
class _StoreState(NamedTuple):
    count: Any
    m: Any


def _store_g() -> ftopt.GradientTransformation:
    """A counted rule whose one state is the gradient itself, stored stochastically."""
    rule = Rule("store_g", lambda o, x: (x.u, {"m": x.u}), state_class=_StoreState,
                slots=(Slot("m"),), counted=True)
    return ftopt.quantize_states(rule_transform(rule), bits=32, state_dtype=torch.bfloat16,
                                 state_rounding="stochastic")


def _stored(tx, g: torch.Tensor, backend: str, steps: int = 1) -> torch.Tensor:
    params = {"w": torch.zeros_like(g)}
    state = tx.init(params)
    for _ in range(steps):
        _, state = tx.update({"w": g}, state, params, backend=backend)
    return state.m["w"]


def _tree(gen: torch.Generator) -> dict:
    shapes = {"w": (9, 70), "b": (70,), "s": (3,)}
    return {k: torch.randn(s, generator=gen).to(DEVICE) for k, s in shapes.items()}


def _bits(tree) -> list[torch.Tensor]:
    out = []
    for x in ftopt.tree.leaves(tree):
        if isinstance(x, torch.Tensor):
            out.append(x.view(torch.int16) if x.dtype == torch.bfloat16 else x.clone())
    return out


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_bits(a), _bits(b), strict=True))


def _states_agree(a, b, step: int) -> None:
    """The same bits (both backends run the same fp32 math and draw the same dither). On
    a GPU, where the fp32 math may contract to FMAs differently, a few elements may be one
    bf16 ulp apart."""
    for x, y in zip(_bits(a), _bits(b), strict=True):
        if DEVICE == "cpu" or x.dtype != torch.int16:
            assert torch.equal(x, y), step
        else:
            apart = (x.int() - y.int()).abs()
            assert apart.max() <= 1 and apart.float().mean() <= 0.01, step


def _adamw(skip: bool = False) -> ftopt.GradientTransformation:
    return ftopt.adamw(1e-2, weight_decay=0.1, state_dtype=torch.bfloat16,
                       state_rounding="stochastic", skip_zeros=skip)


@pytest.mark.parametrize("skip", [False, True])
def test_fused_matches_eager_bit_for_bit(skip):
    tx = _adamw(skip)
    gen = torch.Generator().manual_seed(11 + skip)
    params = _tree(gen)
    state = tx.init(params)
    for step in range(3):
        grads = _tree(gen)
        grads["w"][:2] = 0.0
        pe, se = ftopt.step(tx, params, grads, state, backend="eager")
        pf, sf = ftopt.step(tx, params, grads, state, backend="fused")
        _states_agree(se, sf, step)
        for k in pe:  # (fp32 math may differ in the last bit: torch.lerp on the CPU)
            err = ((pf[k] - pe[k]).abs().max() / pe[k].abs().max()).item()
            assert err <= 1e-6, (step, k)
        params, state = pe, se
    assert state[0].nu["w"].dtype == torch.bfloat16
    # The states are not those of rounding to nearest (the option does something).
    near = ftopt.adamw(1e-2, weight_decay=0.1, state_dtype=torch.bfloat16, skip_zeros=skip)
    _, sn = ftopt.step(near, params, grads, state, backend="eager")
    _, ss = ftopt.step(tx, params, grads, state, backend="eager")
    assert not torch.equal(sn[0].nu["w"], ss[0].nu["w"])


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_unbiased_where_nearest_is_not(backend):
    ulp = 2.0 ** -7  # of bf16 in [1, 2)
    value = 1.0 + 77 * 2.0 ** -15  # 0.30 ulp above 1.0 (exact in fp32)
    n = 4096
    g = torch.full((n,), value, device=DEVICE)
    got = _stored(_store_g(), g, backend).double()
    assert set(got.unique().tolist()) == {1.0, 1.0 + ulp}  # the two neighbours only
    # Each copy rounds up with probability 0.30: the mean's sd is ulp * 0.46 / 64.
    assert abs(got.mean().item() - value) < 4 * ulp * 0.46 / n ** 0.5
    assert abs(got.mean().item() - value) < 0.03 * ulp
    nearest = g.to(torch.bfloat16).double()
    assert abs(nearest.mean().item() - value) > 0.29 * ulp
    # The dither of a step differs from the next one's (the same value, other draws).
    again = _stored(_store_g(), g, backend, steps=2)
    assert not torch.equal(again.double(), got)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # (the interpreter)
def test_special_values_on_both_backends():
    exact = torch.randn(64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), BF16_MAX,
                            -BF16_MAX, 3.4e38, -3.4e38, torch.finfo(torch.float32).max,
                            -torch.finfo(torch.float32).max, 1e-45, -1e-40])
    g = torch.cat([exact.float(), special]).to(DEVICE)
    for backend in ("eager", "fused"):
        got = _stored(_store_g(), g, backend).cpu()
        assert torch.equal(got[:64].view(torch.int16), exact.view(torch.int16)), backend
        s = got[64:].float()
        assert s[0].item() == 0.0 and not s[0].signbit(), backend
        assert s[1].item() == 0.0 and s[1].signbit(), backend
        assert s[2].item() == float("inf") and s[3].item() == float("-inf"), backend
        assert s[4].isnan(), backend
        # Finite values never round to inf: the largest finite bf16 of their sign.
        assert s[5:11].tolist() == [BF16_MAX, -BF16_MAX] * 3, backend
        assert s[11].item() in (0.0, 9.183549615799121e-41), backend  # (the two neighbours)
        assert s[12].item() <= 0.0 and s[12].signbit(), backend


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_skip_zeros_is_exact(backend):
    gen = torch.Generator().manual_seed(5)
    params0 = _tree(gen)
    grads = [_tree(gen) for _ in range(3)]
    zero = with_zero_rows_and_columns(grads)
    changed = False
    for skip in (True, False):
        tx = _adamw(skip)
        params, state = params0, tx.init(params0)
        params, state = ftopt.step(tx, params, grads[0], state, backend=backend)
        for g in grads[1:]:
            before_p = params["w"].clone()
            before_s = [state[0].mu["w"].clone(), state[0].nu["w"].clone()]
            params, state = ftopt.step(tx, params, g, state, backend=backend)
            now_s = [state[0].mu["w"], state[0].nu["w"]]
            same = (torch.equal(params["w"][zero], before_p[zero])
                    and all(torch.equal(a.view(torch.int16)[zero], b.view(torch.int16)[zero])
                            for a, b in zip(now_s, before_s)))
            if skip:
                assert same
            else:
                changed |= not same
    assert changed


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_checkpoint_round_trip(backend):
    tx = _adamw(True)
    gen = torch.Generator().manual_seed(7)
    params = _tree(gen)
    state = tx.init(params)
    grads = [_tree(gen) for _ in range(4)]
    for g in grads[:2]:
        params, state = ftopt.step(tx, params, g, state, backend=backend)
    buf = io.BytesIO()
    torch.save({"params": params, "state": state}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    p2, s2 = loaded["params"], loaded["state"]
    for g in grads[2:]:
        params, state = ftopt.step(tx, params, g, state, backend=backend)
        p2, s2 = ftopt.step(tx, p2, g, s2, backend=backend)
    assert _same(state, s2) and _same(params, p2)


@pytest.mark.parametrize("name", ["muon", "lion", "prodigy", "adafactor"])
def test_other_aliases_round_stochastically(name):
    """Aliases with other stages (a matrix stage in a partition, running scalars) step
    with stochastic rounding; their bf16 states differ from those rounded to nearest."""
    make = {"muon": lambda **kw: ftopt.muon(1e-2, **kw),
            "lion": lambda **kw: ftopt.lion(1e-3, **kw),
            "prodigy": lambda **kw: ftopt.prodigy(1.0, **kw),
            "adafactor": lambda **kw: ftopt.adafactor(1e-2, momentum=0.9, **kw)}[name]
    states = []
    for rounding in ("nearest", "stochastic"):  # (the same params and gradients)
        gen = torch.Generator().manual_seed(13)
        tx = make(state_dtype=torch.bfloat16, state_rounding=rounding)
        p = _tree(gen)
        state = tx.init(p)
        for _ in range(3):
            p, state = ftopt.step(tx, p, _tree(gen), state)
        states.append([x for x in ftopt.tree.leaves(state) if isinstance(x, torch.Tensor)
                       and x.dtype == torch.bfloat16])
    assert states[0] and len(states[0]) == len(states[1])
    assert not all(torch.equal(a, b) for a, b in zip(*states))


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="state_rounding must be 'nearest' or 'stochastic'"):
        ftopt.adamw(1e-3, state_dtype=torch.bfloat16, state_rounding="up")
    with pytest.raises(ValueError, match="state_rounding must be 'nearest' or 'stochastic'"):
        ftopt.quantize_states(ftopt.adam(1e-3), bits=32, state_dtype=torch.bfloat16,
                              state_rounding=None)
    for dtype in (None, torch.float16, torch.float32):
        with pytest.raises(ValueError, match="needs state_dtype=torch.bfloat16"):
            ftopt.adamw(1e-3, state_dtype=dtype, state_rounding="stochastic")
    with pytest.raises(ValueError, match="needs state_bits=32"):
        ftopt.adamw(1e-3, state_bits=8, state_dtype=torch.bfloat16,
                    state_rounding="stochastic")
    with pytest.raises(ValueError, match="needs a step count"):
        ftopt.sgd(1e-3, momentum=0.9, state_dtype=torch.bfloat16, state_rounding="stochastic")
    with pytest.raises(ValueError, match="state_rounding must be 'nearest'"):
        ftopt.schedule_free_adamw(1e-3, state_dtype=torch.bfloat16,
                                  state_rounding="stochastic")
    # Nearest stays the default, and naming it changes nothing.
    a = ftopt.adamw(1e-3, state_dtype=torch.bfloat16)
    b = ftopt.adamw(1e-3, state_dtype=torch.bfloat16, state_rounding="nearest")
    params = {"w": torch.randn(5, 7)}
    grads = {"w": torch.randn(5, 7)}
    assert _same(ftopt.step(a, params, grads, a.init(params)),
                 ftopt.step(b, params, grads, b.init(params)))
