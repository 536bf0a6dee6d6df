"""optax's ``multi_normal`` (``MultiNormalDiagFromLogScale``): optax's tests, float64
log-densities against ``torch.distributions.Normal``, seeded sampling."""

from __future__ import annotations

import math

import pytest
import torch

import ftopt
from ftopt.sampling import MultiNormalDiagFromLogScale

F64 = torch.float64


def _shape(shape) -> tuple:
    return shape if isinstance(shape, tuple) else (shape,)


def _loc_scale(loc_shape, scale_shape):
    return 1.5 * torch.ones(_shape(loc_shape)), 0.5 * torch.ones(_shape(scale_shape))


@pytest.mark.parametrize("loc_shape,scale_shape,broadcast", [
    (1, 1, 1), (5, 5, 5), ((2, 3), (2, 3), (2, 3)), ((1, 4), (3, 4), (3, 4)),
    ((1, 2, 1, 3), (2, 1, 4, 3), (2, 2, 4, 3)),
])
def test_init_successful_broadcast(loc_shape, scale_shape, broadcast):
    loc, scale = _loc_scale(loc_shape, scale_shape)
    dist = ftopt.multi_normal(loc, scale)
    assert isinstance(dist, MultiNormalDiagFromLogScale)
    mean, log_scale = dist.params
    assert tuple(mean.shape) == _shape(loc_shape)
    assert tuple(log_scale.shape) == _shape(scale_shape)
    assert dist._param_shape == _shape(broadcast)
    assert mean is loc and log_scale is scale and dist.log_scale is scale


@pytest.mark.parametrize("loc_shape,scale_shape", [
    (2, 3), ((2, 3), (3, 2)), ((2, 4), (3, 4)), ((1, 2, 1, 3), (2, 1, 4, 4)),
])
def test_init_unsuccessful_broadcast(loc_shape, scale_shape):
    loc, scale = _loc_scale(loc_shape, scale_shape)
    with pytest.raises(ValueError, match="Incompatible shapes for broadcasting"):
        ftopt.multi_normal(loc, scale)


@pytest.mark.parametrize("sample_type", [list, tuple, torch.Size])
def test_sample_input_sequence_types(sample_type):
    loc, scale = _loc_scale((2, 3), (2, 3))
    samples = ftopt.multi_normal(loc, scale).sample(sample_type((4, 5)), 239)
    assert samples.shape == (4, 5, 2, 3) and samples.dtype == torch.float32


@pytest.mark.parametrize("shape", [1, (2, 3), (1, 2, 3, 4)])
def test_log_prob_shape(shape):
    loc, scale = _loc_scale(shape, shape)
    probs = ftopt.multi_normal(loc, scale).log_prob(torch.ones(_shape(shape)))
    assert probs.shape == ()


@pytest.mark.parametrize("loc_shape,scale_shape,batch", [
    ((3,), (3,), ()), ((2, 3), (3,), (4,)), ((1, 4), (3, 1), (2, 5)), ((), (), (6,)),
])
def test_log_prob_matches_torch_normal(loc_shape, scale_shape, batch):
    gen = torch.Generator().manual_seed(7)
    loc = torch.randn(loc_shape, dtype=F64, generator=gen)
    log_scale = 0.5 * torch.randn(scale_shape, dtype=F64, generator=gen)
    dist = ftopt.multi_normal(loc, log_scale)
    param_shape = torch.broadcast_shapes(loc_shape, scale_shape)
    x = torch.randn(batch + param_shape, dtype=F64, generator=gen)
    got = dist.log_prob(x)
    terms = torch.distributions.Normal(loc, log_scale.exp()).log_prob(x)
    ref = terms.sum(dim=tuple(range(-len(param_shape), 0))) if param_shape else terms
    assert got.dtype == F64 and got.shape == batch
    assert torch.allclose(got, ref, rtol=1e-13, atol=1e-13)
    # the formula, by hand, at one point
    flat_x = x.reshape(-1)[0]
    if not param_shape:
        by_hand = -0.5 * math.log(2 * math.pi) - float(log_scale) \
            - 0.5 * ((float(flat_x) - float(loc)) / math.exp(float(log_scale))) ** 2
        assert float(got.reshape(-1)[0]) == pytest.approx(by_hand, rel=1e-13)


def test_log_prob_of_ints_and_numbers():
    dist = ftopt.multi_normal(0.0, 0.0)
    assert float(dist.log_prob(0)) == pytest.approx(-0.5 * math.log(2 * math.pi), rel=1e-6)
    dist = ftopt.multi_normal(torch.zeros(2, dtype=F64), torch.zeros(2, dtype=F64))
    out = dist.log_prob(torch.tensor([1, 2]))
    assert out.dtype == F64
    assert float(out) == pytest.approx(-math.log(2 * math.pi) - 2.5, rel=1e-14)


def test_sample_is_reparameterised_and_seeded():
    loc = torch.tensor([1.0, -2.0, 0.5], dtype=F64, requires_grad=True)
    log_scale = torch.tensor([0.0, -1.0, 0.7], dtype=F64, requires_grad=True)
    dist = ftopt.multi_normal(loc, log_scale)
    x = dist.sample((3,), key=123)
    eps = torch.randn((3, 3), generator=torch.Generator().manual_seed(123), dtype=F64)
    assert torch.allclose(x, eps * log_scale.exp() + loc, rtol=1e-15)
    assert torch.equal(x, dist.sample([3], key=123))  # same seed, same draw
    assert not torch.equal(x, dist.sample([3], key=124))
    assert torch.equal(x, dist.sample((3,), key=torch.tensor(123)))
    x.sum().backward()  # gradients reach loc and log_scale
    assert torch.allclose(loc.grad, torch.full((3,), 3.0, dtype=F64))
    assert torch.allclose(log_scale.grad, (eps * log_scale.exp()).sum(0).detach())


def test_sample_with_a_generator_advances_it():
    dist = ftopt.multi_normal(torch.zeros(4), torch.zeros(4))
    gen = torch.Generator().manual_seed(5)
    first, second = dist.sample((2,), gen), dist.sample((2,), gen)
    assert not torch.equal(first, second)
    assert torch.equal(first, dist.sample((2,), 5))


def test_sample_statistics():
    loc = torch.tensor([1.0, -3.0], dtype=F64)
    log_scale = torch.tensor([math.log(0.5), math.log(2.0)], dtype=F64)
    x = ftopt.multi_normal(loc, log_scale).sample((200_000,), key=0)
    assert x.shape == (200_000, 2) and x.dtype == F64
    assert torch.allclose(x.mean(0), loc, atol=0.02)
    assert torch.allclose(x.std(0), torch.tensor([0.5, 2.0], dtype=F64), rtol=0.01)


def test_sample_dtypes():
    half = ftopt.multi_normal(torch.zeros(3, dtype=torch.bfloat16),
                              torch.zeros(3, dtype=torch.bfloat16))
    assert half.sample((2,), 0).dtype == torch.float32  # ε is float32, as JAX's normal
    assert half.log_prob(torch.zeros(3, dtype=torch.bfloat16)).dtype == torch.bfloat16
    ints = ftopt.multi_normal(torch.zeros(3, dtype=torch.int64), 0)
    assert ints.params[0].dtype == torch.float32 and ints.sample((), 0).shape == (3,)


def test_inputs_are_not_mutated():
    loc, log_scale = torch.randn(3), torch.randn(3)
    l0, s0 = loc.clone(), log_scale.clone()
    dist = ftopt.multi_normal(loc, log_scale)
    dist.log_prob(dist.sample((2,), 0))
    assert torch.equal(loc, l0) and torch.equal(log_scale, s0)


@pytest.mark.parametrize("call,err,match", [
    (lambda: ftopt.multi_normal(torch.zeros(2, dtype=torch.complex64), 0.0), ValueError,
     "multi_normal: loc must be real"),
    (lambda: ftopt.multi_normal(0.0, "x"), TypeError, "multi_normal: log_scale must be"),
    (lambda: ftopt.multi_normal(0.0, True), TypeError, "multi_normal: log_scale must be"),
    (lambda: ftopt.multi_normal(0.0, 0.0).sample((2,), None), TypeError,
     "sample: key must be an int seed"),
    (lambda: ftopt.multi_normal(0.0, 0.0).sample((2,), 1.5), TypeError, "key"),
    (lambda: ftopt.multi_normal(0.0, 0.0).sample((2,), -3), ValueError, "key"),
    (lambda: ftopt.multi_normal(0.0, 0.0).sample((2,), 2**64), ValueError, "key"),
    (lambda: ftopt.multi_normal(0.0, 0.0).sample((-1,), 0), ValueError, "shape"),
    (lambda: ftopt.multi_normal(0.0, 0.0).sample(3, 0), TypeError, "shape"),
    (lambda: ftopt.multi_normal(0.0, 0.0).log_prob(torch.ones(2, dtype=torch.complex64)),
     ValueError, "log_prob: x must be real"),
])
def test_bad_inputs(call, err, match):
    with pytest.raises(err, match=match):
        call()
