"""``ftopt.microbatching`` (optax's ``optax.microbatching``): optax's own examples,
gradients a microbatch at a time against the whole batch's in float64, the column-major
split, each accumulator, per-example gradients against a loop over the examples, and the
refusals."""

from __future__ import annotations

import pytest
import torch
from step_checks import fresh_generator

import ftopt
from ftopt import microbatching as mb

A = mb.AccumulationType


def test_optax_s_examples():
    """The three examples of optax's docstrings, value for value."""
    fun = lambda x: (x + 1, (3 * x).sum())  # noqa: E731
    data = torch.tensor([1, 2, 3, 4])
    out = mb.microbatch(fun, argnums=0, microbatch_size=2, accumulator=(A.CONCAT, A.SUM))(data)
    assert torch.equal(out[0], torch.tensor([2, 3, 4, 5])) and int(out[1]) == 30
    assert torch.equal(mb.micro_vmap(lambda x: x**2)(torch.arange(8)),
                       torch.arange(8) ** 2)

    def mean_squared_loss(params, features, targets):
        return 0.5 * ((features @ params - targets) ** 2).mean()

    for size in (None, 2):
        (grads, squared), aux = mb.micro_grad(
            mean_squared_loss, argnums=0, batch_argnums=(1, 2), accumulator=A.MEAN,
            microbatch_size=size, transform_fn=lambda x: (x, x**2),
            metrics_fn=torch.linalg.norm)(torch.zeros(1), torch.ones(4, 1),
                                          torch.tensor([0.0, 2.0, 4.0, 6.0]))
        assert torch.equal(grads, torch.tensor([-3.0])) and torch.equal(squared,
                                                                       torch.tensor([14.0]))
        assert torch.equal(aux.values, torch.tensor([0.0, 2.0, 8.0, 18.0]))
        assert torch.equal(aux.metrics, torch.tensor([0.0, 2.0, 4.0, 6.0]))
        assert aux.aux is None


def _model(gen):
    return {"w": torch.randn(5, 3, generator=gen, dtype=torch.float64),
            "b": torch.randn(3, generator=gen, dtype=torch.float64)}


def _loss(params, x, y):
    return ((torch.tanh(x @ params["w"] + params["b"]) - y) ** 2).sum()


@pytest.mark.parametrize("size", [1, 3, 4, 12])
def test_a_gradient_a_microbatch_at_a_time_is_the_batch_s(size):
    """``microbatch(torch.func.grad(loss))`` with SUM: the whole batch's gradient (float64,
    within the rounding of another order of addition); MEAN of per-microbatch means is
    the batch mean."""
    gen = fresh_generator()
    params = _model(gen)
    x = torch.randn(12, 5, generator=gen, dtype=torch.float64)
    y = torch.randn(12, 3, generator=gen, dtype=torch.float64)
    whole = torch.func.grad(_loss)(params, x, y)
    parts = mb.microbatch(torch.func.grad(_loss), argnums=(1, 2), microbatch_size=size)(
        params, x, y)
    for k in params:
        assert torch.allclose(parts[k], whole[k], rtol=1e-12, atol=1e-12), k
    mean = mb.microbatch(lambda x: x.mean(0), argnums=0, microbatch_size=size,
                         accumulator=A.MEAN)(x)
    assert torch.allclose(mean, x.mean(0), rtol=1e-12, atol=1e-14)


def test_the_split_is_column_major_and_concat_restores_the_order():
    """Microbatch i of n holds rows i, i + n, ... (optax's column-major reshape); CONCAT
    puts every row back where it was; a batch axis other than 0 and a keyword argument
    split alike."""
    seen = []

    def record(x, *, z):
        seen.append(x[:, 0].tolist())
        return x + z.T

    x = torch.arange(12.0).reshape(2, 6).T.contiguous()  # rows 0..5, second column +6
    z = torch.arange(12.0).reshape(2, 6)  # its batch axis is 1
    out = mb.microbatch(record, argnums=0, argnames="z", in_axes=(0, 1), microbatch_size=2,
                        accumulator=A.CONCAT)(x, z=z)
    assert seen == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
    assert torch.equal(out, x + z.T)
    assert torch.equal(mb.reshape_batch_axis(torch.arange(6), 2)[1], torch.tensor([1, 4]))


def test_each_accumulator_and_early_stop():
    x = torch.arange(8.0)
    run = lambda acc, real=None: mb.microbatch(  # noqa: E731
        lambda v: v.sum(), argnums=0, microbatch_size=2, accumulator=acc,
        num_real_microbatches=real)(x)
    # microbatches: rows (0,4), (1,5), (2,6), (3,7): sums 4, 6, 8, 10
    assert float(run(A.SUM)) == 28.0 and float(run(A.MEAN)) == 7.0
    assert float(run(A.RUNNING_MEAN)) == 7.0
    assert float(run(A.SUM, 2)) == 10.0 and float(run(A.MEAN, 2)) == 2.5
    assert float(run(A.RUNNING_MEAN, 2)) == 5.0
    assert torch.equal(run(A.CONCAT, 2), torch.tensor([4.0, 6.0, 0.0, 0.0]))
    custom = mb.Accumulator(init=torch.zeros_like, update=lambda c, v, i: torch.maximum(c, v),
                            finalize=lambda c: c, aggregate=lambda v: v.amax(0))
    assert float(run(custom)) == 10.0
    tree = mb.microbatch(lambda v: {"s": v.sum(), "m": v.max()}, argnums=0,
                         microbatch_size=4, accumulator={"s": A.SUM, "m": custom})(x)
    assert float(tree["s"]) == 28.0 and float(tree["m"]) == 7.0


def test_per_example_gradients_clipped_and_summed():
    """DP-SGD's sum of per-example clipped gradients (``transform_fn``) equals a loop
    over the examples, float64; ``has_aux`` and ``keep_batch_dim=False`` too."""
    gen = fresh_generator()
    params = _model(gen)
    x = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    y = torch.randn(6, 3, generator=gen, dtype=torch.float64)

    def clip(g):
        norm = torch.sqrt(sum((v * v).sum() for v in g.values()))
        return {k: v * torch.clamp(0.5 / norm, max=1.0) for k, v in g.items()}

    def loss_aux(params, x, y):
        loss = _loss(params, x, y)
        return loss, {"twice": 2 * loss}

    got, aux = mb.micro_grad(loss_aux, has_aux=True, batch_argnums=(1, 2),
                             microbatch_size=2, transform_fn=clip,
                             metrics_fn=lambda g: g["b"].abs().sum())(params, x, y)
    want = {k: torch.zeros_like(v) for k, v in params.items()}
    for i in range(6):
        g = clip(torch.func.grad(_loss)(params, x[i:i + 1], y[i:i + 1]))
        want = {k: want[k] + g[k] for k in want}
        assert torch.allclose(aux.values[i], _loss(params, x[i:i + 1], y[i:i + 1]))
        assert torch.allclose(aux.aux["twice"][i], 2 * aux.values[i])
    for k in params:
        assert torch.allclose(got[k], want[k], rtol=1e-12, atol=1e-12), k
    flat, _ = mb.micro_grad(lambda p, xi, yi: _loss(p, xi[None], yi[None]),
                            batch_argnums=(1, 2), keep_batch_dim=False)(params, x, y)
    for k in params:
        assert torch.allclose(flat[k], torch.func.grad(_loss)(params, x, y)[k]), k


def test_micro_grad_feeds_an_optimizer_step():
    """The summed gradient of ``micro_grad`` drives ``ftopt.step`` as any gradient."""
    gen = fresh_generator()
    params = {k: v.float() for k, v in _model(gen).items()}
    x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)
    tx = ftopt.adamw(1e-2, weight_decay=0.1)
    grads, _ = mb.micro_grad(_loss, batch_argnums=(1, 2), microbatch_size=4)(params, x, y)
    whole = torch.func.grad(_loss)(params, x, y)
    new, _ = ftopt.step(tx, params, grads, tx.init(params))
    ref, _ = ftopt.step(tx, params, whole, tx.init(params))
    for k in params:
        assert torch.allclose(new[k], ref[k], atol=1e-6), k
        assert not torch.equal(new[k], params[k])


def test_refusals_name_what_is_wrong():
    x = torch.arange(6.0)
    with pytest.raises(ValueError, match="batch size 6 must be a positive multiple of "
                                         "microbatch_size=4"):
        mb.microbatch(lambda v: v, 0, 4)(x)
    with pytest.raises(ValueError, match=r"one batch size, found \[4, 6\]"):
        mb.microbatch(lambda a, b: a, (0, 1), 2)(x, torch.ones(4))
    with pytest.raises(ValueError, match="require floating-point values"):
        mb.microbatch(lambda v: v.sum(), 0, 2, A.MEAN)(torch.arange(6))
    with pytest.raises(ValueError, match="microbatch_size must be an int >= 1"):
        mb.microbatch(lambda v: v, 0, 0)
    with pytest.raises(ValueError, match=r"num_real_microbatches must be in \[1, 3\]"):
        mb.microbatch(lambda v: v, 0, 2, num_real_microbatches=4)(x)
    with pytest.raises(ValueError, match="does not fit the function's output"):
        mb.microbatch(lambda v: (v, v), 0, 2, accumulator=(A.SUM, A.SUM, A.SUM))(x)
    with pytest.raises(NotImplementedError, match="out_axes"):
        mb.micro_vmap(lambda v: v, out_axes=1)
    assert mb.microbatch(torch.sin, 0, None) is torch.sin
