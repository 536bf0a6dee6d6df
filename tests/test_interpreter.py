"""Kernels run in Triton's interpreter leave ``triton.language`` as they found it.

Triton's interpreter (3.6 to 3.9) patches ``triton.language.core`` whenever a kernel
calls a ``@triton.jit`` helper (``tl.sum``, ``tl.max``, ``tl.min``) and never restores
it; a real compilation later in the same process (a GPU kernel, or a cross-compile on
the host) then fails with ``'block_argument' object has no attribute
'get_element_ty'``. ftopt restores it after each interpreted launch.
"""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl
import triton.runtime.interpreter as runtime

import ftopt
from ftopt.lowering.interpreter import patches_undone

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the interpreter runs only without a GPU")


def _snapshot():
    from ftopt.lowering.interpreter import patched

    return [dict(vars(obj)) for obj in patched()]


CHAINS = {
    "global norm": lambda: ftopt.chain(ftopt.clip_by_global_norm(1.0), ftopt.adam(1e-3)),
    "trust ratio": lambda: ftopt.lamb(1e-3, weight_decay=0.1),
    "8-bit skip_zeros": lambda: ftopt.adamw(1e-3, state_bits=8, skip_zeros=True),
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_interpreted_steps_leave_triton_language_unpatched(name):
    tx = CHAINS[name]()
    params = {"w": torch.randn(64, 80), "b": torch.randn(80)}
    grads = {"w": torch.randn(64, 80), "b": torch.randn(80)}
    grads["w"][:3] = 0.0
    before = _snapshot()
    state = tx.init(params)
    params, state = ftopt.step(tx, params, grads, state, backend="fused")
    ftopt.step(tx, params, grads, state, backend="fused", donate=True)
    tx.update(grads, state, params, backend="fused")
    after = _snapshot()
    for old, new in zip(before, after):
        changed = sorted(k for k in set(old) | set(new) if old.get(k) is not new.get(k))
        assert not changed, changed[:10]


def test_the_guard_restores_what_a_leaking_launch_changed():
    """The control: the patching the guard undoes does happen without it."""
    import triton.language as tl

    from ftopt.lowering.interpreter import patches_undone

    original = tl.core.add
    with patches_undone():
        tl.core.add = lambda *a, **k: None
        tl.core.ftopt_probe = 1
    assert tl.core.add is original and not hasattr(tl.core, "ftopt_probe")


@triton.jit
def _five_sums(x_ptr, out_ptr, BLOCK: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, BLOCK))
    total = tl.sum(x) + tl.sum(x * 2.0) + tl.max(x) + tl.min(x)
    total += tl.sum(tl.zeros([BLOCK], tl.float32))
    tl.store(out_ptr, total)


@pytest.mark.parametrize("shimmed", [True, False])
def test_a_launch_patches_triton_language_once_a_module(shimmed, monkeypatch):
    """Within ftopt's launches the interpreter patches ``triton.language`` once for the
    kernel and once for the ``@triton.jit`` helpers of ``standard.py`` (``tl.core``),
    not again at each helper call; the result is the same, and ``triton.language`` is
    left as it was. The control (``once=False``): every helper call patches again."""
    calls = []
    real = runtime._patch_lang
    monkeypatch.setattr(runtime, "_patch_lang", lambda fn: calls.append(fn) or real(fn))
    x = torch.randn(64)
    out = torch.zeros(1)
    with patches_undone(once=shimmed):
        _five_sums[(1,)](x, out, BLOCK=64)
    want = 3 * x.sum() + x.max() + x.min()
    assert torch.allclose(out[0], want, rtol=1e-5, atol=1e-5)
    assert len(calls) == (2 if shimmed else 7)
    assert tl.core.is_builtin(tl.maximum) and tl.core.is_builtin(tl.core.maximum)

