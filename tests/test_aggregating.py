"""``ftopt.experimental.aggregating`` (optax's ``optax.experimental.aggregating``): the
aggregators against float64 formulas (batch mean, running mean, two-pass variance, EMA
with bias correction), ``process`` against the same steps done by hand with
``ftopt.adam``/``ftopt.sgd``, accumulation against the whole batch, optax's examples in
structure, the states' fixed structure and checkpoint round trip, and the refusals."""

from __future__ import annotations

import io

import pytest
import torch
from step_checks import cloned, fresh_generator, same_bits

import ftopt
from ftopt.experimental import aggregating as agg

F64 = torch.float64


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=F64)


def _params(gen, d=4, k=2):
    return {"w": _randn(gen, d, k), "b": _randn(gen, k)}


def _loss(params, x, y):
    return ((x @ params["w"] + params["b"] - y) ** 2).sum()


PER_EXAMPLE = torch.func.vmap(torch.func.grad(_loss), in_dims=(None, 0, 0))


def _data(gen, n, d=4, k=2):
    return _randn(gen, n, d), _randn(gen, n, k)


def _close(a, b, **kw):
    la, lb = ftopt.tree.leaves(a), ftopt.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.shape == y.shape and torch.allclose(x, y, **kw), (x, y)


def _layout(tree):
    return ftopt.tree.structure(tree), [(t.shape, t.dtype) for t in ftopt.tree.leaves(tree)]


def test_average_per_element_updates_is_the_batch_mean():
    """One batch axis, a non-leading one and two of them: ``(1/B) Σ_b u_b`` per leaf."""
    gen = fresh_generator()
    tree = {"w": _randn(gen, 6, 3, 2), "b": _randn(gen, 6, 2)}
    out, state = agg.average_per_element_updates().update(tree, ftopt.EmptyState())
    for k in tree:
        want = sum(tree[k][i] for i in range(6)) / 6
        assert torch.allclose(out[k], want, rtol=1e-12, atol=1e-12)
    assert state == ftopt.EmptyState()
    two = {"w": _randn(gen, 2, 3, 5)}
    out, _ = agg.average_per_element_updates((0, -1)).update(two, ())
    assert torch.allclose(out["w"], two["w"].permute(1, 0, 2).reshape(3, 10).mean(1))
    out, _ = agg.average_per_element_updates(1).update(two, ())
    assert torch.allclose(out["w"], two["w"].mean(1))
    assert agg.get_batch_size_from_per_elt_updates(two, [0, 2]) == 10
    assert agg.get_batch_size_from_per_elt_updates(tree, 0) == 6


def test_accumulate_avg_updates_gives_the_average_every_k_calls():
    """Zeros and ``ready`` off for k-1 calls, then the average of the k updates (two-pass,
    float64) with the state reset; twice over. ``k = 1`` is the identity."""
    gen = fresh_generator()
    params = _params(gen)
    tx = agg.accumulate_avg_updates(3)
    state = tx.init(params)
    layout = _layout(state)
    for _cycle in range(2):
        seen = []
        for i in range(3):
            g = ftopt.tree.map(lambda p: _randn(gen, *p.shape), params)
            seen.append(g)
            before = cloned(state)
            out, new = tx.update(g, state, params)
            assert same_bits(state, before)  # the caller's state is untouched
            state = new
            assert _layout(state) == layout
            if i < 2:
                assert all(torch.equal(u, torch.zeros_like(u)) for u in ftopt.tree.leaves(out))
                assert not bool(state.ready) and int(state.micro_step) == i + 1
            else:
                for k in params:
                    want = torch.stack([s[k] for s in seen]).mean(0)
                    assert torch.allclose(out[k], want, rtol=1e-12, atol=1e-12)
                assert bool(state.ready) and int(state.micro_step) == 0
                assert all(not t.any() for t in ftopt.tree.leaves(state.avg_grad))
    g = ftopt.tree.map(lambda p: _randn(gen, *p.shape), params)
    one = agg.accumulate_avg_updates(1)
    assert same_bits(one.update(g, one.init(params))[0], g)


def test_incremental_average_of_per_example_grads_is_the_whole_batch_gradient():
    """``average_incrementally_updates(0, k)`` over k microbatches of per-example gradients
    gives the gradient of the mean loss over their concatenation."""
    gen = fresh_generator()
    params = _params(gen)
    x, y = _data(gen, 12)
    aggregator = agg.average_incrementally_updates(per_elt_axis=0, accumulation_steps=3)
    assert isinstance(aggregator, agg.Aggregator)
    assert not isinstance(agg.average_incrementally_updates(None, 3), agg.Aggregator)
    state = aggregator.init(params)
    for i in range(3):
        out, state = aggregator.update(PER_EXAMPLE(params, x[4 * i:4 * i + 4],
                                                   y[4 * i:4 * i + 4]), state, params)
    whole = torch.func.grad(lambda p: _loss(p, x, y) / 12)(params)
    _close(out, whole, rtol=1e-10, atol=1e-12)


def _clip(tree, radius):
    norm = torch.sqrt(sum((v * v).sum() for v in tree.values()))
    return {k: v * min(1.0, radius / float(norm)) for k, v in tree.items()}


def test_process_clip_average_adam_matches_the_steps_by_hand():
    """optax's ``process`` example (per-example l2 clipping, the mean, adam) against
    clipping each example in a loop, averaging and ``ftopt.adam`` by hand."""
    gen = fresh_generator()
    params = _params(gen)
    clip_per_sample = torch.func.vmap(
        lambda g: ftopt.projections.projection_l2_ball(g, 0.5))
    opt = agg.process(ftopt.stateless(lambda gs, _: clip_per_sample(gs)),
                      agg.average_per_element_updates(), ftopt.adam(1e-1))
    assert isinstance(opt, agg.Aggregator)
    adam = ftopt.adam(1e-1)
    state, ref_state, ref = opt.init(params), adam.init(params), cloned(params)
    for _ in range(3):
        x, y = _data(gen, 8)
        updates, state = opt.update(PER_EXAMPLE(params, x, y), state, params)
        params = ftopt.apply_updates(params, updates)
        clipped = [_clip(torch.func.grad(_loss)(ref, x[i], y[i]), 0.5) for i in range(8)]
        mean = {k: sum(c[k] for c in clipped) / 8 for k in ref}
        ref_updates, ref_state = adam.update(mean, ref_state, ref)
        ref = ftopt.apply_updates(ref, ref_updates)
        _close(params, ref, rtol=1e-10, atol=1e-12)
    assert isinstance(state, tuple) and len(state) == 3


def test_process_with_accumulation_steps_the_optimizer_once_per_k_calls():
    """optax's test: ``process(identity, average_incrementally_updates(axis, 2), adam)``
    over microbatches of 2 is adam on batches of 4; the optimizer's state stays as it was
    and the updates are zeros on the calls in between."""
    gen = fresh_generator()
    start = _params(gen)
    x, y = _data(gen, 16)
    adam = ftopt.adam(5e-2)
    ref, ref_state = cloned(start), adam.init(start)
    for i in range(4):
        xb, yb = x[4 * i:4 * i + 4], y[4 * i:4 * i + 4]
        g = torch.func.grad(lambda p, xb=xb, yb=yb: _loss(p, xb, yb) / 4)
        u, ref_state = adam.update(g(ref), ref_state, ref)
        ref = ftopt.apply_updates(ref, u)
    for axis in (0, None):
        opt = agg.process(ftopt.identity(), agg.average_incrementally_updates(axis, 2),
                          ftopt.adam(5e-2))
        params, state = cloned(start), opt.init(start)
        for i in range(8):
            xb, yb = x[2 * i:2 * i + 2], y[2 * i:2 * i + 2]
            grads = PER_EXAMPLE(params, xb, yb) if axis == 0 else \
                torch.func.grad(lambda p, xb=xb, yb=yb: _loss(p, xb, yb) / 2)(params)
            before = state[2]
            updates, state = opt.update(grads, state)
            if i % 2 == 0:
                assert state[2] is before
                assert all(not t.any() for t in ftopt.tree.leaves(updates))
            params = ftopt.apply_updates(params, updates)
        _close(params, ref, rtol=1e-9, atol=1e-12)


def test_optax_accumulation_example_holds_the_params_between_steps():
    """optax's ``accumulate_avg_updates`` example: 3 microbatches, k = 2: the full loss
    is unchanged after the first call and changes after the second."""
    gen = fresh_generator()
    xs, ys = _randn(gen, 3, 4, 6), _randn(gen, 3, 4, 2)
    params = _randn(gen, 6, 2)
    fun = lambda w, x, y: ((x @ w - y) ** 2).sum(-1).mean()  # noqa: E731
    opt = agg.process(ftopt.identity(), agg.average_incrementally_updates(None, 2),
                      ftopt.adam(0.01))
    state, full = opt.init(params), []
    for x, y in zip(xs, ys):
        full.append(float(fun(params, xs, ys)))
        updates, state = opt.update(torch.func.grad(fun)(params, x, y), state)
        params = ftopt.apply_updates(params, updates)
    assert full[0] == full[1] and full[2] != full[1]


@pytest.mark.parametrize("axis", [0, (0, 1)])
def test_mean_and_sum_sq_diff_against_two_pass(axis):
    """k = 1: the batch mean and Σ(u − m)², ``sample_size`` the batch size; k = 3: the
    Chan merge of three microbatches equals the two-pass values over their union, zeros
    and ``sample_size`` 0 on the calls before."""
    gen = fresh_generator()
    batch = (5,) if axis == 0 else (2, 3)
    n = 5 if axis == 0 else 6
    params = _params(gen)
    draw = lambda: {k: _randn(gen, *batch, *p.shape) for k, p in params.items()}  # noqa: E731
    flat = lambda t: t.reshape(n, *t.shape[len(batch):])  # noqa: E731
    once = agg.get_per_element_mean_and_sum_sq_diff_grads(axis)
    g = draw()
    (mean, aux), _ = once.update(g, once.init(params))
    assert aux["sample_size"] == n
    for k in params:
        assert torch.allclose(mean[k], flat(g[k]).mean(0), rtol=1e-12, atol=1e-12)
        want = ((flat(g[k]) - flat(g[k]).mean(0)) ** 2).sum(0)
        assert torch.allclose(aux["sum_sq_diff_grads"][k], want, rtol=1e-10, atol=1e-12)
    acc = agg.get_per_element_mean_and_sum_sq_diff_grads(axis, accumulation_steps=3)
    state = acc.init(params)
    layout = _layout(state)
    seen = []
    for i in range(3):
        seen.append(draw())
        (mean, aux), state = acc.update(seen[-1], state)
        assert _layout(state) == layout
        if i < 2:
            assert int(aux["sample_size"]) == 0 and not bool(state.ready)
            assert not any(t.any() for t in ftopt.tree.leaves((mean, aux)))
    assert int(aux["sample_size"]) == 3 * n and bool(state.ready)
    for k in params:
        union = torch.cat([flat(s[k]) for s in seen])
        assert torch.allclose(mean[k], union.mean(0), rtol=1e-10, atol=1e-12)
        assert torch.allclose(aux["sum_sq_diff_grads"][k],
                              union.var(0, correction=0) * 3 * n, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("decay", [0.0, 0.9])
@pytest.mark.parametrize("steps", [1, 2])
def test_add_mean_variance_to_opt_tracks_the_bias_corrected_emas(decay, steps):
    """optax's test: sgd through ``add_mean_variance_to_opt`` steps as plain sgd on the
    batch mean; the unbiased EMAs equal EMAs written from the formula of the batch's
    mean and unbiased variance (``torch.var``), divided by 1 − dᵗ; with k = 2 the batch
    is the union of two microbatches."""
    gen = fresh_generator()
    params = _params(gen)
    opt = agg.add_mean_variance_to_opt(ftopt.sgd(0.1), decay, accumulation_steps=steps)
    sgd = ftopt.sgd(0.1)
    state, ref, ref_state = opt.init(params), cloned(params), sgd.init(params)
    m_ema = {k: torch.zeros_like(p) for k, p in params.items()}
    v_ema = {k: torch.zeros_like(p) for k, p in params.items()}
    for t in range(1, 4):
        x, y = _data(gen, 4 * steps)
        per = PER_EXAMPLE(ref, x, y)
        for j in range(steps):
            grads = PER_EXAMPLE(params, x[4 * j:4 * j + 4], y[4 * j:4 * j + 4])
            updates, state = opt.update(grads, state, params)
            params = ftopt.apply_updates(params, updates)
        u, ref_state = sgd.update({k: v.mean(0) for k, v in per.items()}, ref_state, ref)
        ref = ftopt.apply_updates(ref, u)
        _close(params, ref, rtol=1e-10, atol=1e-12)
        for k in per:
            m_ema[k] = (1 - decay) * per[k].mean(0) + decay * m_ema[k]
            v_ema[k] = (1 - decay) * per[k].var(0) + decay * v_ema[k]
        mean, var = agg.get_unbiased_mean_and_variance_ema(state)
        _close(mean, {k: v / (1 - decay ** t) for k, v in m_ema.items()}, rtol=1e-10)
        _close(var, {k: v / (1 - decay ** t) for k, v in v_ema.items()}, rtol=1e-10)
        assert int(ftopt.tree.get(state, "count")) == t


def test_states_keep_their_structure_and_round_trip_through_torch_save():
    """``add_mean_variance_to_opt(adam, k=2)``: one state layout on every call; the state
    saved and loaded with ``weights_only=True`` continues as the original."""
    gen = fresh_generator()
    params = {k: v.float() for k, v in _params(gen).items()}
    opt = agg.add_mean_variance_to_opt(ftopt.adam(1e-2), 0.8, accumulation_steps=2)
    state = opt.init(params)
    layout = _layout(state)
    for i in range(3):
        x, y = (t.float() for t in _data(gen, 3))
        grads = PER_EXAMPLE(params, x, y)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)
        assert same_bits(loaded, state) and _layout(loaded) == layout
        (u1, s1), (u2, s2) = opt.update(grads, state, params), opt.update(grads, loaded, params)
        assert same_bits(u1, u2) and same_bits(s1, s2)
        assert bool(ftopt.tree.get(s1[1], "ready")) == (i % 2 == 1)
        params, state = ftopt.apply_updates(params, u1), s1
        assert _layout(state) == layout


def test_refusals_name_what_is_wrong_and_leave_the_state_untouched():
    gen = fresh_generator()
    params = _params(gen)
    ragged = {"a": _randn(gen, 4, 3), "b": _randn(gen, 5, 3)}
    with pytest.raises(ValueError, match=r"same batch size .*4 at \['a'\] but 5 at \['b'\]"):
        agg.get_batch_size_from_per_elt_updates(ragged, 0)
    for aggregator in (agg.average_per_element_updates(),
                       agg.get_per_element_mean_and_sum_sq_diff_grads()):
        with pytest.raises(ValueError, match=r"5 at \['b'\]"):
            aggregator.update(ragged, aggregator.init(params))
    with pytest.raises(ValueError, match=r"at \['a'\] of shape \(4, 3\) has no axis 2"):
        agg.get_batch_size_from_per_elt_updates(ragged, 2)
    with pytest.raises(ValueError, match="names an axis twice"):
        agg.average_per_element_updates((0, -2)).update(ragged, ())
    with pytest.raises(ValueError, match="batch is empty"):
        agg.average_per_element_updates().update({"a": torch.ones(0, 3)}, ())
    with pytest.raises(TypeError, match=r"at \['a'\]: expected a floating-point"):
        agg.average_per_element_updates().update({"a": torch.ones(4, 3, dtype=int)}, ())
    with pytest.raises(TypeError, match="per_elt_axis must be an int or a sequence"):
        agg.average_per_element_updates("0")
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="accumulation_steps must be an int >= 1"):
            agg.accumulate_avg_updates(bad)
    tx = agg.accumulate_avg_updates(2)
    _, state = tx.update(ftopt.tree.map(torch.ones_like, params), tx.init(params))
    before = cloned(state)
    per_example = {k: _randn(gen, 5, *p.shape) for k, p in params.items()}
    with pytest.raises(ValueError, match=r"update at \['b'\]: shape \(5, 2\) does not match "
                                         r"the params' shape \(2,\)"):
        tx.update(per_example, state)
    with pytest.raises(ValueError, match="does not match the state tree"):
        tx.update({"w": params["w"]}, state)
    assert same_bits(state, before)
    with pytest.raises(TypeError, match="state to be of type AccumulateAvgUpdatesState"):
        tx.update(params, ())
    track = agg.track_per_element_mean_and_variance_with_ema()
    with pytest.raises(TypeError, match="needs the keyword arguments sum_sq_diff_grads"):
        track.update(params, track.init(params))
    single = agg.add_mean_variance_to_opt(ftopt.sgd(0.1))
    with pytest.raises(ValueError, match="sample_size >= 2"):
        single.update({k: _randn(gen, 1, *p.shape) for k, p in params.items()},
                      single.init(params))
    for decay in (1.0, -0.1):
        with pytest.raises(ValueError, match=r"ema_decay must be in \[0, 1\)"):
            agg.track_per_element_mean_and_variance_with_ema(decay)
    with pytest.raises(ValueError, match="holds no PerElementMeanAndVarianceEMAState"):
        agg.get_unbiased_mean_and_variance_ema(ftopt.adam(0.1).init(params))
    with pytest.raises(TypeError, match="process: aggregator: expected a GradientTransf"):
        agg.process(ftopt.identity(), lambda g: g, ftopt.sgd(0.1))
    opt = agg.process(ftopt.identity(), agg.average_per_element_updates(), ftopt.sgd(0.1),
                      aggregator_has_aux=True)
    with pytest.raises(TypeError, match="aggregator_has_aux=True the aggregator must"):
        opt.update(per_example, opt.init(params))
    with pytest.raises(ValueError, match="process: expected the state"):
        opt.update(per_example, ())
