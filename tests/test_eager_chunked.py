"""The chunked CPU backend (``ftopt.chunked``: programs traced from rule bodies, run over
chunks of all leaves, and the one-pass eager ``step``) gives the same bits as the
whole-leaf foreach path.

The chunk size is made small so that the test leaves are split into several chunks (solo
waves, written in place) and small leaves are packed together (gathered and scattered). The
reference disables both (``update`` then evaluates bodies on ``eager.Vec`` values over whole
leaves, and ``step`` runs ``update`` + ``apply_updates``).
"""

from __future__ import annotations

import pytest
import torch

import ftopt
from ftopt.chunked import entry as chunked_entry
from ftopt.chunked import program, run
from ftopt.chunked import step as eager_step

SEED = 9090
CHUNK = 256


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in (torch.float32, torch.int32):
        return t.view(torch.int32)
    if t.dtype in (torch.float64, torch.int64):
        return t.view(torch.int64)
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    return t


def _assert_same(a, b):
    la, lb = ftopt.tree.leaves(a), ftopt.tree.leaves(b)
    assert ftopt.tree.structure(a) == ftopt.tree.structure(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(_bits(x), _bits(y))


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(SEED)

    def r(*shape, dt=dtype):
        return torch.randn(shape, generator=g).to(dt)

    return {
        "big": r(37, 41),  # 1517 elements: 6 solo chunks of <= 256
        "mid": r(200),  # >= CHUNK/2: one solo chunk
        "b1": r(7), "b2": r(3, 5), "s": r(), "e": r(0, 4),  # packed together
        "w": r(20, 30),  # 600: 3 solo chunks
        "h": r(50, dt=torch.bfloat16),  # another dtype: its own program
        "d": r(300, dt=torch.float64),
    }


def _grads(params, step, zeros=True, none=()):
    g = torch.Generator().manual_seed(SEED + 100 + step)
    out = {}
    for k, v in params.items():
        if k in none:
            out[k] = None
            continue
        x = torch.randn(v.shape, generator=g).to(v.dtype)
        if zeros and x.numel():
            flat = x.view(-1)
            flat[::5] = 0.0
            flat[1::7] = -0.0
        out[k] = x
    return out


TXS = {
    "sgd": lambda: ftopt.sgd(0.1),
    "sgd_nesterov": lambda: ftopt.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: ftopt.adam(1e-2),
    "adam_tensor_hp": lambda: ftopt.adam(torch.tensor(1e-2), b1=torch.tensor(0.8)),
    "adam_nesterov_skip": lambda: ftopt.adam(1e-2, nesterov=True, skip_zeros=True),
    "adamw_masked": lambda: ftopt.adamw(1e-2, weight_decay=0.1,
                                        mask=lambda p: {k: v.ndim > 1 for k, v in p.items()}),
    "adamw_skip": lambda: ftopt.adamw(1e-2, weight_decay=0.1, skip_zeros=True),
    "lion": lambda: ftopt.lion(1e-3, skip_zeros=True),
    "rmsprop": lambda: ftopt.rmsprop(1e-2, momentum=0.9),
    "rmsprop_eps_out": lambda: ftopt.rmsprop(1e-2, eps_in_sqrt=False, initial_scale=0.1),
    "adagrad_skip": lambda: ftopt.adagrad(1e-2, skip_zeros=True),
    "ademamix_sched": lambda: ftopt.ademamix(
        ftopt.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 20),
        b3=ftopt.ademamix_b3_warmup(0.9, 0.999, 10), alpha=ftopt.ademamix_alpha_warmup(5.0, 10),
        weight_decay=0.01),
    "named_chain": lambda: ftopt.named_chain(("adam", ftopt.scale_by_adam()),
                                             ("lr", ftopt.scale_by_learning_rate(1e-2))),
    "nested_skip": lambda: ftopt.chain(ftopt.skip_zeros(ftopt.scale_by_rms()),
                                       ftopt.trace(0.9), ftopt.scale(-0.1)),
    "lamb": lambda: ftopt.lamb(1e-2, weight_decay=0.01),  # norms: the whole-leaf path
    "clip_adam": lambda: ftopt.chain(ftopt.clip_by_global_norm(1.0), ftopt.adam(1e-2)),
}


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(run, "CHUNK", CHUNK)


def _reference(monkeypatch):
    """Run ``fn`` with the chunked paths switched off."""

    class Off:
        def __enter__(self):
            monkeypatch.setattr(chunked_entry, "evaluate", lambda *a, **k: None)
            monkeypatch.setattr(chunked_entry, "step", lambda *a, **k: None)

        def __exit__(self, *exc):
            monkeypatch.undo()
            monkeypatch.setattr(run, "CHUNK", CHUNK)

    return Off()


def _none_for(name):
    return ("b2", "w") if name != "lamb" else ()


@pytest.mark.parametrize("name", sorted(TXS))
def test_update_matches_whole_leaf_path(name, small_chunks, monkeypatch):
    tx = TXS[name]()
    params = _params()
    state = tx.init(params)
    ref_state = state
    with torch.no_grad():
        for step in range(3):
            grads = _grads(params, step, none=_none_for(name) if step == 1 else ())
            u, state = tx.update(grads, state, params)
            with _reference(monkeypatch):
                ref_u, ref_state = tx.update(grads, ref_state, params)
            _assert_same(u, ref_u)
            _assert_same(state, ref_state)
            params = ftopt.apply_updates(params, u)


@pytest.mark.parametrize("donate", [False, True], ids=["fresh", "donated"])
@pytest.mark.parametrize("name", sorted(TXS))
def test_step_matches_update_and_apply(name, donate, small_chunks, monkeypatch):
    tx = TXS[name]()
    params = _params()
    ref_params = {k: v.clone() for k, v in params.items()}
    state = tx.init(params)
    ref_state = tx.init(ref_params)
    with torch.no_grad():
        for step in range(3):
            grads = _grads(params, step, none=_none_for(name) if step == 1 else ())
            before = [t.clone() for t in ftopt.tree.leaves((params, state, grads))]
            objects = ftopt.tree.leaves((params, state))
            new_params, new_state = ftopt.step(tx, params, grads, state, donate=donate,
                                               backend="eager")
            with _reference(monkeypatch):
                ref_params, ref_state = ftopt.step(tx, ref_params, grads, ref_state,
                                                   donate=donate, backend="eager")
            _assert_same(new_params, ref_params)
            _assert_same(new_state, ref_state)
            if donate:
                assert new_params is params and new_state is state
                assert all(a is b for a, b in zip(ftopt.tree.leaves((params, state)), objects))
            else:
                for t, b in zip(ftopt.tree.leaves((params, state, grads)), before):
                    assert torch.equal(_bits(t), _bits(b))  # nothing passed in was modified
            params, state = new_params, new_state


def test_step_takes_the_chunked_path(small_chunks, monkeypatch):
    """The fused eager step runs for an Adam chain (and not for a chain with a norm)."""
    calls = []
    real = run.run_program

    def spy(prog, *args, **kwargs):
        calls.append(len(prog.code))
        return real(prog, *args, **kwargs)

    monkeypatch.setattr(run, "run_program", spy)
    params = _params()
    for name, expect in (("adam", True), ("clip_adam", False)):
        calls.clear()
        tx = TXS[name]()
        with torch.no_grad():
            assert (eager_step.eager_step(tx, params, _grads(params, 0), tx.init(params),
                                          False) is not None) == expect


def test_donated_step_with_aliased_grad_falls_back(small_chunks):
    """A grad that is the param's own memory: the chunked in-place writes would be read
    back, so the step takes the generic path (which computes everything first)."""
    p = {"w": torch.randn(1000)}
    tx = ftopt.sgd(0.5, momentum=0.9)
    state = tx.init(p)
    grads = {"w": p["w"]}  # the same tensor
    with torch.no_grad():
        assert eager_step.eager_step(tx, p, grads, state, True) is None
        assert eager_step.eager_step(tx, p, grads, state, False) is not None
    expected = p["w"] - 0.5 * p["w"]
    with torch.no_grad():
        out, _ = ftopt.step(tx, p, grads, state, donate=True, backend="eager")
    assert torch.equal(out["w"], expected)


def test_program_reuses_buffers_and_writes_outputs_directly():
    prog = program.Program()
    u = prog.input("u", torch.float32)
    mu = prog.input("mu", torch.float32)
    new_mu = 0.9 * mu + 0.1 * u
    out = new_mu / (program.TraceOps(prog).sqrt(u * u) + 1e-8)
    prog.output("mu", new_mu)
    prog.output("u", out)
    plan = run._Plan(prog, ["mu", "u"], [torch.float32, torch.float32], (), 64)
    assert sorted(j for _, j in plan.direct_slots) == [0, 1] and not plan.copies
    assert len(plan.bufs) <= 2  # temporaries reuse dead operands' buffers
    x = torch.randn(1000)
    m = torch.randn(1000)
    outs = {"mu": [torch.empty(1000)], "u": [torch.empty(1000)]}
    run.run_program(prog, {"u": [x], "mu": [m]}, outs, chunk=64)
    ref_mu = 0.9 * m + 0.1 * x
    assert torch.equal(outs["mu"][0], ref_mu)
    assert torch.equal(outs["u"][0], ref_mu / ((x * x).sqrt() + 1e-8))


def test_number_divided_by_value_is_reciprocal_times_number():
    """``number / tensor`` in torch is ``tensor.reciprocal() * number`` (not a division):
    the trace reproduces it so the bits match the whole-leaf path."""
    prog = program.Program()
    x = prog.input("x", torch.float32)
    prog.output("y", 0.9 / x)
    t = torch.randn(5000)
    out = {"y": [torch.empty(5000)]}
    run.run_program(prog, {"x": [t]}, out)
    assert torch.equal(out["y"][0], 0.9 / t)


def _run(prog, **inputs):
    out_names = [name for name, _ in prog.outputs]
    n = next(iter(inputs.values())).numel()
    outs = {name: [torch.empty(n, dtype=prog.dtypes[v])] for name, v in prog.outputs}
    run.run_program(prog, {k: [v] for k, v in inputs.items()}, outs, chunk=64)
    return [outs[name][0] for name in out_names]


def test_identities_are_dropped_only_where_no_output_sees_a_difference():
    x = torch.tensor([-0.0, 0.0, 1.5, -2.0, float("nan"), float("inf")] * 50)
    x_abs = x.abs()
    x_abs[::6] = -0.0  # -0.0 reaches the sqrt

    def build(eps_root, eps, expose, scale=1.0):
        prog = program.Program()
        v = prog.input("v", torch.float32)
        o = program.TraceOps(prog)
        inner = (v * 2.0) / scale + eps_root
        prog.output("u", o.sqrt(inner) + eps)
        if expose:
            prog.output("inner", inner)
        return prog

    cases = [  # eps_root, eps, expose the sum, divisor; ops dropped
        (0.0, 1e-8, False, 1.0, 2), (0.0, 0.0, False, 1.0, 1), (-0.0, 0.0, False, 1.0, 2),
        (0.0, 1e-8, True, 1.0, 1), (1e-30, 1e-8, False, 1.0, 1), (0.0, 1e-8, False, 3.0, 1),
    ]
    for eps_root, eps, expose, scale, dropped in cases:
        prog = build(eps_root, eps, expose, scale)
        n_ops = len(prog.code)
        got = _run(prog, v=x_abs)
        assert n_ops - len(prog.code) == dropped, (eps_root, eps, expose, scale)
        inner = (x_abs * 2.0) / scale + eps_root
        want = [torch.sqrt(inner) + eps] + ([inner] if expose else [])
        for a, b in zip(got, want):
            assert torch.equal(_bits(a), _bits(b)), (eps_root, eps, expose, scale)


def test_an_input_is_never_substituted_for_an_identity_op():
    """``x * 1`` of an input keeps the op (a signaling NaN input would come out quiet)."""
    prog = program.Program()
    v = prog.input("v", torch.float32)
    prog.output("u", v * 1.0)
    n_ops = len(prog.code)
    prog.drop_identities()
    assert len(prog.code) == n_ops


def test_bias_corrections_of_one_drop_their_divisions(small_chunks, monkeypatch):
    """Late in training 1 - b**t is exactly 1: the division by it is dropped (same bits)."""
    tx = ftopt.adam(1e-2, b1=0.5, b2=0.5)
    params = _params()
    state = tx.init(params)
    state = (state[0]._replace(count=torch.tensor(200, dtype=torch.int32)), state[1])
    grads = _grads(params, 0)
    with torch.no_grad():
        prep = eager_step._prepare(tx, eager_step._stages(tx), params, grads, state, False)
        for prog, _ in prep.programs:  # only m / (sqrt(v) + eps) is left
            assert sum(fn is torch.div for fn, _, _ in prog.code) == 1
        new_p, new_s = ftopt.step(tx, params, grads, state, backend="eager")
        with _reference(monkeypatch):
            ref_p, ref_s = ftopt.step(tx, params, grads, state, backend="eager")
    _assert_same(new_p, ref_p)
    _assert_same(new_s, ref_s)
