"""NovoGrad's per-leaf state (ftopt/transforms/novograd.py) and Fromage, beyond the
registry suites: the layout of ``nu`` under 8-bit and 16-bit state storage, its
``skip_zeros`` semantics (an all-zero leaf keeps it; a partly zero leaf advances it from
the whole leaf's norm) on both backends, the device-count path, bad per-leaf states, the
fused NovoGrad and Fromage steps against the eager ones, and what a fused NovoGrad step
launches."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ftopt


class Ops(TorchDispatchMode):
    """Counts the ATen ops dispatched (by name), host queries aside."""

    def __init__(self):
        super().__init__()
        self.seen: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "promote_types" not in str(func):  # (a host query, not a kernel)
            self.seen[str(func)] = self.seen.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = {"w": (64, 80), "b": (33,), "z": (5, 7)}


def _tree(gen, scale=1.0):
    return {k: (scale * torch.randn(s, generator=gen)).to(DEVICE) for k, s in SHAPES.items()}


def _nu(state):
    """NovoGrad's per-leaf nu in an alias' state (its chain's first part)."""
    return state[0][0].nu


def test_nu_is_one_fp32_value_per_leaf_whatever_the_storage():
    gen = torch.Generator().manual_seed(1)
    params = _tree(gen)
    for kw in ({}, {"state_bits": 8}, {"state_dtype": torch.bfloat16}):
        tx = ftopt.novograd(1e-2, **kw)
        state = tx.init(params)
        for _ in range(2):
            state = ftopt.step(tx, params, _tree(gen, 0.1), state)[1]
        for k, nu in _nu(state).items():
            assert nu.shape == () and nu.dtype == torch.float32, (kw, k)
            assert float(nu) > 0, (kw, k)
        mu = state[0][1].mu["w"]
        if kw.get("state_bits") == 8:
            assert isinstance(mu, ftopt.rules.QuantizedSlot)
        else:
            assert mu.dtype == kw.get("state_dtype", torch.float32)
    params64 = {k: v.double() for k, v in params.items()}
    assert all(v.dtype == torch.float64 for v in _nu(ftopt.novograd(1e-2).init(params64))
               .values())


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_skip_zeros_on_the_per_leaf_state(backend):
    """An all-zero leaf keeps nu, mu and params bit for bit (the control, without
    skip_zeros, decays nu by b2); a partly zero leaf's nu is b2·nu + (1−b2)·‖g‖², the
    norm of the whole leaf, while its zero-grad elements keep mu and params."""
    gen = torch.Generator().manual_seed(2)
    params = _tree(gen)
    skip, plain = (ftopt.novograd(1e-2, b2=0.5, weight_decay=0.1, skip_zeros=s)
                   for s in (True, False))
    state_s, state_p = skip.init(params), plain.init(params)
    for _ in range(2):
        g = _tree(gen, 0.1)
        params_s, state_s = ftopt.step(skip, params, g, state_s, backend=backend)
        params_p, state_p = ftopt.step(plain, params, g, state_p, backend=backend)
        assert all(torch.equal(params_s[k], params_p[k]) for k in SHAPES)
        params = params_s
    g = _tree(gen, 0.1)
    g["b"] = torch.zeros_like(g["b"])
    g["w"][:10] = 0.0
    old_nu = {k: v.clone() for k, v in _nu(state_s).items()}
    old_mu = {k: v.clone() for k, v in state_s[0][1].mu.items()}
    new_p, new_s = ftopt.step(skip, params, g, state_s, backend=backend)
    ctl_p, ctl_s = ftopt.step(plain, params, g, state_p, backend=backend)
    assert torch.equal(_nu(new_s)["b"], old_nu["b"])
    assert torch.equal(new_s[0][1].mu["b"], old_mu["b"])
    assert torch.equal(new_p["b"], params["b"])
    assert torch.equal(_nu(ctl_s)["b"], 0.5 * old_nu["b"])  # the control decays it
    assert not torch.equal(ctl_p["b"], params["b"])  # (and the decay moves the params)
    square = float((g["w"].double() ** 2).sum())
    want = 0.5 * float(old_nu["w"]) + 0.5 * square
    assert abs(float(_nu(new_s)["w"]) - want) <= 1e-6 * want
    assert torch.equal(_nu(new_s)["w"], _nu(ctl_s)["w"])
    assert torch.equal(new_s[0][1].mu["w"][:10], old_mu["w"][:10])
    assert torch.equal(new_p["w"][:10], params["w"][:10])
    assert torch.equal(new_p["w"][10:], ctl_p["w"][10:])


def test_first_step_from_a_device_count():
    """Under torch.func a count without a host mirror is not read: the first step is a
    ``where`` on the device count, with the same result as the host path (a wrong branch
    on either step would differ: nu = ‖g‖² against b2·nu + (1−b2)·‖g‖²)."""
    gen = torch.Generator().manual_seed(3)
    params, grads = _tree(gen), _tree(gen, 0.1)
    tx = ftopt.scale_by_novograd(b2=0.5, weight_decay=0.1)
    for steps in (1, 2):
        state = tx.init(params)
        for _ in range(steps - 1):
            state = tx.update(grads, state, params)[1]
        # A copy's count has no host mirror: under torch.func it is read on the device only.
        state = ftopt.tree.map(torch.clone, state)
        want, _ = tx.update(grads, state, params)

        def loss(g, st=state):
            u, _ = tx.update(g, st, params)
            return sum(x.sum() for x in u.values()), u

        _, got = torch.func.grad(loss, has_aux=True)(grads)
        # Within fp32 rounding (a CPU with other vector units sums the norm in another
        # order under torch.func: 4e-6 measured); a wrong branch is off by far more.
        for k in SHAPES:
            torch.testing.assert_close(got[k], want[k], rtol=2e-5, atol=0)


def test_bad_per_leaf_state_names_the_leaf_and_writes_nothing():
    gen = torch.Generator().manual_seed(4)
    params, grads = _tree(gen), _tree(gen, 0.1)
    tx = ftopt.novograd(1e-2)
    state = tx.init(params)
    bad = (((state[0][0]._replace(nu={**state[0][0].nu, "b": torch.zeros(3, device=DEVICE)})),
            state[0][1]), state[1])
    before = {k: v.clone() for k, v in params.items()}
    for call in (lambda: tx.update(grads, bad, params),
                 lambda: ftopt.step(tx, params, grads, bad, donate=True)):
        with pytest.raises(ValueError, match=r"state nu at \['b'\].*0-d"):
            call()
        assert all(torch.equal(params[k], before[k]) for k in SHAPES)


@pytest.mark.parametrize("schedule", [False, True])
def test_fromage_fused_equals_eager_donated(schedule):
    gen = torch.Generator().manual_seed(5)
    lr = ftopt.linear_schedule(0.1, 0.02, 3) if schedule else 0.05
    tx = ftopt.fromage(lr, skip_zeros=True)
    p_e = _tree(gen)
    p_f = {k: v.clone() for k, v in p_e.items()}
    s_e, s_f = tx.init(p_e), tx.init(p_f)
    for _ in range(4):
        g = _tree(gen, 0.1)
        g["w"][:5] = 0.0
        p_e, s_e = ftopt.step(tx, p_e, g, s_e, backend="eager")
        p_f, s_f = ftopt.step(tx, p_f, g, s_f, backend="fused", donate=True)
        for k in SHAPES:
            torch.testing.assert_close(p_f[k], p_e[k], rtol=1e-6, atol=1e-7)
    text = str(ftopt.explain(tx, p_e))  # one fused program: no stage runs in torch
    assert "scale_by_trust_ratio, fromage_step" in text and "matrix stage" not in text


def test_fused_novograd_launches_do_not_grow_with_leaves(kernel_launches):
    """A fused NovoGrad step is one reduction pass (its kernel and the per-leaf sums) and
    one main kernel for any number of leaves of one dtype: the norms, nu and the division
    run in the kernels, no stage in torch."""
    gen = torch.Generator().manual_seed(8)
    counts = []
    for n in (3, 12):
        params = {f"l{i}": torch.randn(4, 3 + i % 3, generator=gen).to(DEVICE)
                  for i in range(n)}
        tx = ftopt.novograd(1e-2, weight_decay=0.01)
        state = tx.init(params)
        grads = {k: torch.randn(v.shape, generator=gen).to(DEVICE) for k, v in params.items()}
        before = len(kernel_launches)
        ftopt.step(tx, params, grads, state, backend="fused")
        counts.append(len(kernel_launches) - before)
    assert counts[0] == counts[1] == 3, counts


def _fused_against_eager(tx, params, steps, zero_rows=5):
    """``tx`` stepped fused (donated) and eager from ``params`` on the same fresh
    gradients (``w``'s first rows zero; at step 2 the whole of ``b``): both results."""
    gen = torch.Generator().manual_seed(9)
    p_e = {k: v.clone() for k, v in params.items()}
    p_f = {k: v.clone() for k, v in params.items()}
    s_e, s_f = tx.init(p_e), tx.init(p_f)
    for t in range(steps):
        g = _tree(gen, 0.1)
        g["w"][:zero_rows] = 0.0
        if t == 2:
            g["b"] = torch.zeros_like(g["b"])
        p_e, s_e = ftopt.step(tx, p_e, g, s_e, backend="eager")
        p_f, s_f = ftopt.step(tx, p_f, g, s_f, backend="fused", donate=True)
    return (p_e, s_e), (p_f, s_f)


def test_fused_novograd_takes_one_minus_b2_in_float64():
    """nu ← (1 − b2)·‖u‖² + b2·nu with b2 = 0.999 after a step of tiny gradients (nu then
    mostly the first term): 1 − b2 is taken in float64, as the eager step takes it (in
    a kernel from an fp32 b2, 1 − 0.999 is 4.7e-5 off, and so was nu)."""
    params = _tree(torch.Generator().manual_seed(11))
    tx = ftopt.novograd(1e-2, b2=0.999)
    states = {}
    for backend in ("eager", "fused"):
        p, s = {k: v.clone() for k, v in params.items()}, tx.init(params)
        for scale in (1e-4, 1.0):
            g = _tree(torch.Generator().manual_seed(12), scale)
            p, s = ftopt.step(tx, p, g, s, backend=backend)
        states[backend] = _nu(s)
    for k in SHAPES:
        torch.testing.assert_close(states["fused"][k], states["eager"][k], rtol=1e-6, atol=0)


@pytest.mark.parametrize("b2", [0.5, 0.999])
@pytest.mark.parametrize("skip_zeros", [False, True])
def test_fused_novograd_equals_eager(skip_zeros, b2):
    """The fused step (norms in the reduction pass, nu and the division in the kernel)
    against the eager one (torch's norms): params, mu and nu within fp32 rounding over 4
    steps, a partly zero and an all-zero leaf included; one fused program, no stage in
    torch. (b2 = 0.999: 1 − b2 from an fp32 b2 in the kernel was 1.3e-5 off.)"""
    params = _tree(torch.Generator().manual_seed(10))
    tx = ftopt.novograd(1e-2, b1=0.8, b2=b2, eps=1e-6, weight_decay=0.1,
                        skip_zeros=skip_zeros)
    (p_e, s_e), (p_f, s_f) = _fused_against_eager(tx, params, 4)
    for k in SHAPES:
        torch.testing.assert_close(p_f[k], p_e[k], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(s_f[0][1].mu[k], s_e[0][1].mu[k], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(_nu(s_f)[k], _nu(s_e)[k], rtol=1e-6, atol=0)
        assert not torch.equal(p_f[k], params[k])
    from ftopt.lowering.plan import plan_chain

    plan = plan_chain(tx)
    assert plan.reason is None and plan.segments is None, plan.reason
    assert plan.traced().levels == 1  # one reduction pass


def test_fused_novograd_in_masked_and_after_a_norm():
    """Inside ``masked`` NovoGrad runs on some leaves (the others: the plain gradient
    times the learning rate, and their nu untouched), fused as eager; after global-norm
    clipping its norm is that of the clipped update (a second reduction level)."""
    params = _tree(torch.Generator().manual_seed(11))
    mask = {"w": True, "b": False, "z": True}
    for tx in (ftopt.chain(ftopt.masked(ftopt.scale_by_novograd(0.8, 0.5, weight_decay=0.1),
                                        mask), ftopt.scale_by_learning_rate(1e-2),
                           ftopt.skip_zeros()),
               ftopt.chain(ftopt.clip_by_global_norm(0.5), ftopt.scale_by_novograd(0.8, 0.5),
                           ftopt.scale_by_learning_rate(1e-2))):
        (p_e, _), (p_f, _) = _fused_against_eager(tx, params, 3)
        for k in SHAPES:
            torch.testing.assert_close(p_f[k], p_e[k], rtol=1e-6, atol=1e-7)


def _step_ops(n_leaves: int, skip_zeros: bool, tx=None) -> dict:
    """The ATen ops (by name) of a donated fused step (its second; NovoGrad's unless
    ``tx``) over ``n_leaves``: tables, reduction pass and kernel launch together."""

    gen = torch.Generator().manual_seed(12)
    params = {f"l{i}": torch.randn(3 + i % 4, 5, generator=gen).to(DEVICE)
              for i in range(n_leaves)}
    tx = tx or ftopt.novograd(1e-2, weight_decay=0.01, skip_zeros=skip_zeros)
    state = tx.init(params)
    for _ in range(2):
        grads = {k: torch.randn(v.shape, generator=gen).to(DEVICE) for k, v in params.items()}
        grads["l0"][0] = 0.0
        with Ops() as ops:
            params, state = ftopt.step(tx, params, grads, state, backend="fused", donate=True)
    return ops.seen


@pytest.mark.parametrize("skip_zeros", [False, True])
def test_fused_novograd_step_ops_do_not_grow_with_leaves(skip_zeros):
    """A whole donated fused step dispatches the same ops for 4 leaves as for 24: no
    torch norm, division or ``where`` (the kernels compute nu and divide), one
    multi-tensor copy of the new nu values into the donated 0-d leaves."""
    few, many = _step_ops(4, skip_zeros), _step_ops(24, skip_zeros)
    assert few == many, {k: (few.get(k), many.get(k)) for k in set(few) | set(many)
                         if few.get(k) != many.get(k)}
    assert not [k for k in many if any(w in k for w in ("norm", "div", "where", "stack",
                                                         ".all."))], many
    assert many["aten._foreach_copy_.default"] == 1, many


def test_global_norms_take_no_torch_ops():
    """Global norms at two levels (a global clip, then LAMB's trust ratio of the clipped
    update): the kernels write each leaf's sums into its column and sum the columns over
    the leaves; the host dispatches no sum, stack, select or copy of its own for them, and
    the same ops for 4 leaves as for 24."""
    def tx():
        return ftopt.chain(ftopt.clip_by_global_norm(0.5), ftopt.lamb(1e-2))

    few, many = _step_ops(4, False, tx()), _step_ops(24, False, tx())
    assert few == many, {k: (few.get(k), many.get(k)) for k in set(few) | set(many)
                         if few.get(k) != many.get(k)}
    assert not [k for k in many if any(w in k for w in ("sum", "stack", "select", "norm"))]
    assert many.get("aten.zeros.default") == 1, many  # (one zeroed buffer for every sum)


@pytest.mark.parametrize("r_block", [4, 4096])
def test_leaf_sums_loop_over_many_partials(r_block, monkeypatch):
    """The reduction pass's per-leaf sums (a loop over each leaf's partials, R_BLOCK a
    load): with 4 a load, leaves of 10 and 3 partials take several iterations and a masked
    tail; the norms, hence fused Fromage and LAMB, still equal eager's."""
    from ftopt.lowering import reductions, tiles

    monkeypatch.setattr(reductions, "_LEAF_SUMS", (("R_BLOCK", r_block), ("num_warps", 1)))
    gen = torch.Generator().manual_seed(9)
    shapes = {"a": (10 * tiles.BLOCK - 7,), "b": (3, tiles.BLOCK - 5), "c": (17,)}
    params = {k: torch.randn(s, generator=gen).to(DEVICE) for k, s in shapes.items()}
    grads = {k: torch.randn(s, generator=gen).to(DEVICE) for k, s in shapes.items()}
    for tx in (ftopt.fromage(0.05), ftopt.lamb(1e-2)):
        state = tx.init(params)
        p_e, _ = ftopt.step(tx, params, grads, state, backend="eager")
        p_f, _ = ftopt.step(tx, params, grads, state, backend="fused")
        for k in shapes:
            torch.testing.assert_close(p_f[k], p_e[k], rtol=1e-6, atol=1e-7)
