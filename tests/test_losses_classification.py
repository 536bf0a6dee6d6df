"""The classification losses and label smoothing (ftopt.losses), against float64 references
written from the formulas (plain Python loops over rows, or explicit exp/log/sum), against
torch.nn.functional where the two agree, and against the values optax's own tests compute
by hand. Fresh random data every run (step_checks.fresh_generator)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from step_checks import fresh_generator

from ftopt.losses._classification import (
    convex_kl_divergence,
    generalized_kl_divergence,
    hinge_loss,
    kl_divergence,
    kl_divergence_with_log_targets,
    multiclass_hinge_loss,
    multiclass_perceptron_loss,
    perceptron_loss,
    poly_loss_cross_entropy,
    safe_softmax_cross_entropy,
    sigmoid_binary_cross_entropy,
    sigmoid_focal_loss,
    softmax_cross_entropy,
    softmax_cross_entropy_with_integer_labels,
)
from ftopt.losses._smoothing import smooth_labels

D = torch.float64
# detect_anomaly (used to show no NaN forms in a masked backward pass) warns that it is slow
_ANOMALY = pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
# float32 inputs against float64 references: the inputs are O(1) to O(10) and the sums
# run over <= 60 terms, so float32 rounding (eps 6e-8) adds errors of a few 1e-7. Measured
# over 300 seeds on every float32 check here, the worst error used 4% of this budget
# (|err| <= 1e-5 + 1e-5 |want|): a 25x margin.
F32 = dict(rtol=1e-5, atol=1e-5)
F64 = dict(rtol=1e-10, atol=1e-10)


def _simplex(gen, *shape):
    """Random distributions over the last dimension (Dirichlet(1): normalised exponentials),
    float64."""
    e = -torch.log(torch.rand(*shape, generator=gen, dtype=D))
    return e / e.sum(-1, keepdim=True)


def _rows(x):
    return [[float(v) for v in row] for row in x.reshape(-1, x.shape[-1])]


def _ce_row(xs, ys, ps=None):
    """Python float64 cross entropy of one row (optionally also 1 - p_t)."""
    m = max(xs)
    lse = m + math.log(sum(math.exp(x - m) for x in xs))
    ce = -sum(y * (x - lse) for x, y in zip(xs, ys))
    if ps is None:
        return ce
    return ce + ps * sum(y * (1.0 - math.exp(x - lse)) for x, y in zip(xs, ys))


def _ref_ce(logits, labels, axis=-1, where=None, eps=None):
    """The reference over ``axis`` (an int or tuple): those dimensions moved last and
    flattened into rows; ``where`` (full shape) selects each row's classes."""
    axes = (axis,) if isinstance(axis, int) else axis
    axes = tuple(a % logits.ndim for a in axes)
    dest = tuple(range(logits.ndim - len(axes), logits.ndim))
    moved = [t.movedim(axes, dest) for t in (logits, labels)]
    batch = moved[0].shape[:logits.ndim - len(axes)]
    x, y = (m.reshape(*batch, -1) for m in moved)
    mask = (torch.ones_like(x, dtype=torch.bool) if where is None
            else where.expand(logits.shape).movedim(axes, dest).reshape(*batch, -1))
    out = []
    for xr, yr, mr in zip(_rows(x), _rows(y), _rows(mask)):
        kept = [(a, b) for a, b, k in zip(xr, yr, mr) if k]
        out.append(_ce_row([a for a, _ in kept], [b for _, b in kept], eps) if kept else 0.0)
    return torch.tensor(out, dtype=D).reshape(batch)


# --- softmax cross entropy -------------------------------------------------------------

def test_softmax_cross_entropy_matches_the_formula_and_torch():
    gen = fresh_generator()
    x = 3 * torch.randn(6, 7, generator=gen)
    y = _simplex(gen, 6, 7)
    got = softmax_cross_entropy(x, y.float())
    assert got.dtype == torch.float32 and got.shape == (6,)
    torch.testing.assert_close(got.double(), _ref_ce(x.double(), y), **F32)
    torch.testing.assert_close(softmax_cross_entropy(x.double(), y),
                               F.cross_entropy(x.double(), y, reduction="none"), **F64)
    # optax's docstring example
    xs = torch.tensor([[1.2, -0.8, -0.5], [0.9, -1.2, 1.1]])
    ys = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    torch.testing.assert_close(softmax_cross_entropy(xs, ys), torch.tensor([0.2761, 2.9518]),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("axis", [0, 1, 2, -2, (0, 2), (2, 0), None])
def test_softmax_cross_entropy_and_poly_loss_axis(axis):
    gen = fresh_generator()
    x = 2 * torch.randn(3, 4, 5, generator=gen, dtype=D)
    y = torch.rand(3, 4, 5, generator=gen, dtype=D)
    full = tuple(range(3)) if axis is None else axis
    torch.testing.assert_close(softmax_cross_entropy(x, y, axis=axis), _ref_ce(x, y, full),
                               **F64)
    torch.testing.assert_close(poly_loss_cross_entropy(x, y, epsilon=1.5, axis=axis),
                               _ref_ce(x, y, full, eps=1.5), **F64)


@_ANOMALY
def test_softmax_cross_entropy_and_poly_loss_where():
    gen = fresh_generator()
    x = 2 * torch.randn(5, 6, generator=gen, dtype=D)
    y = _simplex(gen, 5, 6)
    where = torch.rand(5, 6, generator=gen) < 0.6
    where[0] = False  # an example with no class included gives 0
    where[1] = True
    for f, eps in ((softmax_cross_entropy, None), (poly_loss_cross_entropy, -0.7)):
        kw = {} if eps is None else {"epsilon": eps}
        got = f(x, y, where=where, **kw)
        torch.testing.assert_close(got, _ref_ce(x, y, -1, where, eps), **F64)
        assert got[0] == 0
        # batch-shaped where: whole examples masked
        rows = torch.tensor([True, False, True, True, False])
        torch.testing.assert_close(f(x, y, where=rows, **kw),
                                   torch.where(rows, f(x, y, **kw), 0.0), **F64)
        # gradients are finite and zero on every masked-out logit, and no NaN is formed on
        # the way (anomaly mode raises on a backward step that outputs one)
        g = torch.func.grad(lambda z, f=f, kw=kw: f(z, y, where=where, **kw).sum())(x)
        assert torch.isfinite(g).all() and (g[~where] == 0).all()
        z = x.clone().requires_grad_()
        with torch.autograd.detect_anomaly(check_nan=True):
            f(z, y, where=where, **kw).sum().backward()


def test_softmax_cross_entropy_gradient_is_softmax_minus_labels():
    gen = fresh_generator()
    x = torch.randn(4, 5, generator=gen, dtype=D)
    y = _simplex(gen, 4, 5)
    g = torch.func.grad(lambda z: softmax_cross_entropy(z, y).sum())(x)
    p = torch.exp(x) / torch.exp(x).sum(-1, keepdim=True)
    torch.testing.assert_close(g, p * y.sum(-1, keepdim=True) - y, **F64)


def test_softmax_cross_entropy_broadcasts_labels():
    gen = fresh_generator()
    x = torch.randn(5, generator=gen, dtype=D)
    y = _simplex(gen, 3, 5)
    torch.testing.assert_close(softmax_cross_entropy(x, y), _ref_ce(x.expand(3, 5), y), **F64)


def test_cross_entropies_with_extreme_logits():
    x = torch.tensor([[1e4, -1e4, 0.0], [-1e4, 1e4, 5.0]])
    y = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.0, 0.8]])
    # want: [2e4, 0.2 * 2e4 + 0.8 * (1e4 - 5)], plus epsilon * 1 for the poly loss
    for f, eps in ((softmax_cross_entropy, None), (safe_softmax_cross_entropy, None),
                   (poly_loss_cross_entropy, 2.0)):
        got = f(x, y)
        assert torch.isfinite(got).all()
        want = _ref_ce(x.double(), y.double(), eps=eps)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    labels = torch.tensor([1, 2])
    got = softmax_cross_entropy_with_integer_labels(x, labels)
    torch.testing.assert_close(got.double(), torch.tensor([2e4, 1e4 - 5.0], dtype=D),
                               rtol=1e-6, atol=0)


# --- safe softmax cross entropy --------------------------------------------------------

def test_safe_softmax_cross_entropy_hand_values():
    # optax's test values, with -inf logits of zero-label classes
    inf = math.inf
    x = torch.tensor([[10.0, 1.0, -2.0], [1.0, 4.0, 0.2], [-inf, 0.0, 0.0],
                      [-inf, 0.0, 0.0], [-inf, 0.0, -inf]])
    y = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.5, 0.5],
                      [0.4, 0.3, 0.3], [0.0, 1.0, 0.0]])
    want = torch.tensor([9.00013, 3.0696733, 0.693147, inf, 0.0])
    torch.testing.assert_close(safe_softmax_cross_entropy(x, y), want, atol=1e-4, rtol=0)
    assert softmax_cross_entropy(x, y)[2].isnan()  # the unsafe one does not


def test_safe_softmax_cross_entropy_drops_impossible_classes():
    gen = fresh_generator()
    x = 2 * torch.randn(6, 7, generator=gen, dtype=D)
    y = _simplex(gen, 6, 7)
    impossible = torch.rand(6, 7, generator=gen) < 0.4
    impossible[:, 0] = False
    y = torch.where(impossible, 0.0, y)
    x = torch.where(impossible, -math.inf, x)
    want = _ref_ce(x, y, where=~impossible)  # the same loss over the possible classes
    torch.testing.assert_close(safe_softmax_cross_entropy(x, y), want, **F64)
    # the gradient is finite, zero on the impossible logits, and equals the plain loss's
    # on rows with none
    g = torch.func.grad(lambda z: safe_softmax_cross_entropy(z, y).sum())(x)
    assert torch.isfinite(g).all() and (g[impossible] == 0).all()
    xf = x.clone()
    xf[impossible] = 0.0
    yf = _simplex(gen, 6, 7)
    torch.testing.assert_close(
        torch.func.grad(lambda z: safe_softmax_cross_entropy(z, yf).sum())(xf),
        torch.func.grad(lambda z: softmax_cross_entropy(z, yf).sum())(xf), **F64)


# --- integer labels --------------------------------------------------------------------

@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_integer_labels_match_torch_cross_entropy(axis):
    gen = fresh_generator()
    x = 3 * torch.randn(3, 4, 5, generator=gen)
    shape = [s for d, s in enumerate(x.shape) if d != axis % 3]
    labels = torch.randint(x.shape[axis], shape, generator=gen)
    got = softmax_cross_entropy_with_integer_labels(x, labels, axis=axis)
    want = F.cross_entropy(x.double().movedim(axis, 1), labels, reduction="none")
    torch.testing.assert_close(got.double(), want, **F32)
    one_hot = F.one_hot(labels, x.shape[axis]).double().movedim(-1, axis)
    torch.testing.assert_close(got.double(), _ref_ce(x.double(), one_hot, axis), **F32)


@pytest.mark.parametrize("axis", [(1, 3), (3, 2), (2, 3), (-3, -1), (-1, -2), (0, 1, 3)])
def test_integer_labels_tuple_axis_index_the_slice_row_major(axis):
    gen = fresh_generator()
    shape = (2, 3, 4, 5)
    x = torch.randn(shape, generator=gen, dtype=D)
    axes = tuple(a % 4 for a in axis)
    batch = [d for d in range(4) if d not in axes]
    sizes = [shape[a] for a in axes]
    labels = torch.randint(math.prod(sizes), [shape[d] for d in batch], generator=gen)
    got = softmax_cross_entropy_with_integer_labels(x, labels, axis)
    for b in itertools.product(*(range(shape[d]) for d in batch)):
        values = []  # the slice's elements in row-major order over `axis` as given
        for c in itertools.product(*(range(s) for s in sizes)):
            index = [0] * 4
            for d, i in zip(batch, b):
                index[d] = i
            for d, i in zip(axes, c):
                index[d] = i
            values.append(float(x[tuple(index)]))
        y = [0.0] * len(values)
        y[int(labels[b])] = 1.0
        assert abs(float(got[b]) - _ce_row(values, y)) < 1e-10


def test_integer_labels_hand_values_and_label_range():
    # optax's docstring examples
    x = torch.tensor([[1.2, -0.8, -0.5], [0.9, -1.2, 1.1]])
    got = softmax_cross_entropy_with_integer_labels(x, torch.tensor([0, 1]))
    torch.testing.assert_close(got, torch.tensor([0.2761, 2.9518]), atol=1e-4, rtol=0)
    x4 = torch.arange(24.0).reshape(1, 2, 3, 4)
    labels = torch.tensor([[1 * 4 + 1, 2 * 4 + 3]])
    got = softmax_cross_entropy_with_integer_labels(x4, labels, axis=(2, 3))
    torch.testing.assert_close(got, torch.tensor([[6.4587, 0.4587]]), atol=1e-4, rtol=0)
    # labels in [-C, 0) count from the end; outside [-C, C) give NaN (a gather's fill)
    gen = fresh_generator()
    x = torch.randn(4, 3, generator=gen, dtype=D)
    got = softmax_cross_entropy_with_integer_labels(x, torch.tensor([-1, -3, 3, -4]))
    want = softmax_cross_entropy_with_integer_labels(x[:2], torch.tensor([2, 0]))
    torch.testing.assert_close(got[:2], want, **F64)
    assert got[2:].isnan().all()
    # int32 labels too
    torch.testing.assert_close(
        softmax_cross_entropy_with_integer_labels(x, torch.tensor([0, 1, 2, 1], dtype=torch.int32)),
        softmax_cross_entropy_with_integer_labels(x, torch.tensor([0, 1, 2, 1])), **F64)


@_ANOMALY
def test_integer_labels_where():
    gen = fresh_generator()
    x = 2 * torch.randn(5, 6, generator=gen, dtype=D)
    labels = torch.randint(6, (5,), generator=gen)
    where = torch.rand(5, 6, generator=gen) < 0.6
    where[torch.arange(5), labels] = True
    where[0] = False
    got = softmax_cross_entropy_with_integer_labels(x, labels, where=where)
    torch.testing.assert_close(got, _ref_ce(x, F.one_hot(labels, 6).double(), -1, where), **F64)
    assert got[0] == 0
    rows = torch.tensor([False, True, True, False, True])
    full = softmax_cross_entropy_with_integer_labels(x, labels)
    torch.testing.assert_close(softmax_cross_entropy_with_integer_labels(x, labels, where=rows),
                               torch.where(rows, full, 0.0), **F64)
    # gradient: softmax over the included classes minus the one-hot label, 0 elsewhere
    g = torch.func.grad(
        lambda z: softmax_cross_entropy_with_integer_labels(z, labels, where=where).sum())(x)
    z = x.clone().requires_grad_()
    with torch.autograd.detect_anomaly(check_nan=True):
        softmax_cross_entropy_with_integer_labels(z, labels, where=where).sum().backward()
    e = torch.where(where, torch.exp(x), 0.0)
    p = e / e.sum(-1, keepdim=True).clamp_min(1e-300)
    want = torch.where(where.any(-1, keepdim=True), p - F.one_hot(labels, 6).double(), 0.0)
    torch.testing.assert_close(g, want, **F64)
    # a tuple axis with a mask of the logits' shape
    x3 = torch.randn(2, 3, 4, generator=gen, dtype=D)
    lab3 = torch.randint(12, (2,), generator=gen)
    w3 = torch.rand(2, 3, 4, generator=gen) < 0.7
    w3.view(2, 12)[torch.arange(2), lab3] = True
    got = softmax_cross_entropy_with_integer_labels(x3, lab3, axis=(1, 2), where=w3)
    want = _ref_ce(x3.reshape(2, 12), F.one_hot(lab3, 12).double(), -1, w3.reshape(2, 12))
    torch.testing.assert_close(got, want, **F64)


# --- poly loss -------------------------------------------------------------------------

@pytest.mark.parametrize("eps,want", [(2, 4.5317), (-1, 2.0827), (0, 2.8990), (5.45, 7.3480)])
def test_poly_loss_hand_values(eps, want):
    # optax's test values (computed with the paper's TensorFlow poly1_cross_entropy)
    x = torch.tensor([0.14, 1.456, 2.356, -0.124, -2.47])
    y = torch.tensor([0.1, 0.15, 0.2, 0.25, 0.3])
    got = poly_loss_cross_entropy(x, y, epsilon=eps)
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-4, rtol=0)


def test_poly_loss_matches_the_formula():
    gen = fresh_generator()
    x = 3 * torch.randn(6, 7, generator=gen)
    y = _simplex(gen, 6, 7)
    got = poly_loss_cross_entropy(x, y.float(), epsilon=1.214)
    torch.testing.assert_close(got.double(), _ref_ce(x.double(), y, eps=1.214), **F32)
    torch.testing.assert_close(poly_loss_cross_entropy(x, y.float(), epsilon=0.0),
                               softmax_cross_entropy(x, y.float()), **F32)


# --- sigmoid losses --------------------------------------------------------------------

def _sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v))


def test_sigmoid_binary_cross_entropy():
    gen = fresh_generator()
    x = 4 * torch.randn(5, 6, generator=gen)
    y = torch.rand(5, 6, generator=gen, dtype=D)
    got = sigmoid_binary_cross_entropy(x, y)
    assert got.dtype == torch.float32
    want = torch.tensor([[-b * math.log(_sigmoid(a)) - (1 - b) * math.log(1 - _sigmoid(a))
                          for a, b in zip(r, s)] for r, s in zip(_rows(x), _rows(y))], dtype=D)
    torch.testing.assert_close(got.double(), want, **F32)
    torch.testing.assert_close(
        sigmoid_binary_cross_entropy(x.double(), y),
        F.binary_cross_entropy_with_logits(x.double(), y, reduction="none"), **F64)
    # bool/int labels are cast; labels broadcast
    hard = torch.rand(6, generator=gen) < 0.5
    torch.testing.assert_close(sigmoid_binary_cross_entropy(x, hard),
                               sigmoid_binary_cross_entropy(x, hard.float().expand(5, 6)))
    # extreme logits: exact, finite (optax's table: mean over a pair)
    big = torch.tensor([1e4, -1e4, 1e4, -1e4, 1e-9])
    lab = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    torch.testing.assert_close(sigmoid_binary_cross_entropy(big, lab),
                               torch.tensor([0.0, 0.0, 1e4, 1e4, math.log(2)]))
    pair = sigmoid_binary_cross_entropy(torch.tensor([1e9, -1e-9]), torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(pair.mean(), torch.tensor(5e8))


def _log_sigmoid(v):
    return -math.log1p(math.exp(-v)) if v > 0 else v - math.log1p(math.exp(v))


def _focal_ref(x, y, gamma, alpha=None):
    out = []
    for a, b in zip(x, y):
        one_minus_pt = b * _sigmoid(-a) + (1 - b) * _sigmoid(a)
        ce = -b * _log_sigmoid(a) - (1 - b) * _log_sigmoid(-a)
        w = 1.0 if alpha is None else alpha * b + (1 - alpha) * (1 - b)
        out.append(w * one_minus_pt ** gamma * ce)
    return torch.tensor(out, dtype=D)


@pytest.mark.parametrize("gamma,alpha", [(2.0, None), (0.5, 0.25), (0.0, None), (3.0, 1.0)])
def test_sigmoid_focal_loss_matches_the_formula(gamma, alpha):
    gen = fresh_generator()
    x = 3 * torch.randn(40, generator=gen)
    y = torch.rand(40, generator=gen, dtype=D)
    y[:10] = 1.0
    y[10:20] = 0.0
    got = sigmoid_focal_loss(x, y, alpha=alpha, gamma=gamma)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _focal_ref(x.tolist(), y.tolist(), gamma, alpha),
                               **F32)
    if gamma == 0.0 and alpha is None:
        torch.testing.assert_close(got, sigmoid_binary_cross_entropy(x, y))
    if alpha == 1.0:
        assert (got[10:20] == 0).all()  # negatives ignored


def test_sigmoid_focal_loss_extreme_logits_stay_finite():
    x = torch.tensor([100.0, -100.0, 75.0, -75.0, 50.0, -50.0, 1e4, -1e4])
    y = torch.tensor([0.9, 0.1, 0.8, 0.2, 1.0, 0.0, 1.0, 1.0])
    for gamma in (0.5, 2.0):
        loss = sigmoid_focal_loss(x, y, gamma=gamma)
        g = torch.func.grad(lambda z, gamma=gamma: sigmoid_focal_loss(z, y, gamma=gamma).sum())(x)
        assert torch.isfinite(loss).all() and torch.isfinite(g).all()
        want = _focal_ref(x[:6].tolist(), y[:6].tolist(), gamma)
        torch.testing.assert_close(loss[:6].double(), want, rtol=1e-5, atol=1e-30)
        # easy positive: zero loss; a confident miss: the full cross entropy, 1e4
        torch.testing.assert_close(loss[6:], torch.tensor([0.0, 1e4]))


# --- margin losses ---------------------------------------------------------------------

def test_hinge_and_perceptron_with_signed_targets():
    gen = fresh_generator()
    s = 3 * torch.randn(20, generator=gen)
    t = torch.where(torch.rand(20, generator=gen) < 0.5, -1.0, 1.0)
    torch.testing.assert_close(hinge_loss(s, t), torch.tensor(
        [max(0.0, 1 - a * b) for a, b in zip(s.tolist(), t.tolist())]))
    torch.testing.assert_close(perceptron_loss(s, t), torch.tensor(
        [max(0.0, -a * b) for a, b in zip(s.tolist(), t.tolist())]))
    # optax's examples: labels {0, 1} mapped to {-1, 1}
    torch.testing.assert_close(hinge_loss(torch.tensor([10.0, 20.0]), torch.tensor([1.0, -1.0])),
                               torch.tensor([0.0, 21.0]))
    torch.testing.assert_close(perceptron_loss(torch.tensor([10.0, 20.0]),
                                               torch.tensor([1.0, -1.0])),
                               torch.tensor([0.0, 20.0]))
    # integer targets promote; at the kink the gradient is split in half, as in JAX
    torch.testing.assert_close(hinge_loss(s, t.long()), hinge_loss(s, t))
    g = torch.func.grad(lambda z: hinge_loss(z, torch.tensor(1.0)))(torch.tensor(1.0))
    assert g == -0.5


def _multiclass_ref(scores, labels, margin):
    out = []
    for row, y in zip(_rows(scores), labels.reshape(-1).tolist()):
        out.append(max(v + (margin if j != y else 0.0) for j, v in enumerate(row)) - row[y])
    return torch.tensor(out, dtype=D).reshape(labels.shape)


def test_multiclass_hinge_and_perceptron():
    gen = fresh_generator()
    s = 2 * torch.randn(3, 4, 5, generator=gen)
    labels = torch.randint(5, (3, 4), generator=gen)
    torch.testing.assert_close(multiclass_hinge_loss(s, labels).double(),
                               _multiclass_ref(s, labels, 1.0), **F32)
    torch.testing.assert_close(multiclass_perceptron_loss(s, labels).double(),
                               _multiclass_ref(s, labels, 0.0), **F32)
    # two classes: Crammer-Singer's hinge is 2x torch's multi_margin_loss (which averages)
    s2 = torch.randn(8, 2, generator=gen, dtype=D)
    l2 = torch.randint(2, (8,), generator=gen)
    torch.testing.assert_close(multiclass_hinge_loss(s2, l2),
                               2 * F.multi_margin_loss(s2, l2, reduction="none"), **F64)
    # optax's examples
    torch.testing.assert_close(
        multiclass_hinge_loss(torch.tensor([[10.0, 3.0], [11.0, -2.0]]), torch.tensor([1, 0])),
        torch.tensor([8.0, 0.0]))
    # a label outside [0, C) selects no class (optax's one_hot row of zeros)
    row = torch.tensor([0.5, 2.0, -1.0])
    assert multiclass_hinge_loss(row, torch.tensor(3)) == 3.0
    assert multiclass_perceptron_loss(row, torch.tensor(-1)) == 2.0
    # tied maxima share the gradient, as in JAX
    g = torch.func.grad(lambda z: multiclass_perceptron_loss(z, torch.tensor(0)))(
        torch.tensor([1.0, 3.0, 3.0]))
    torch.testing.assert_close(g, torch.tensor([-1.0, 0.5, 0.5]))


# --- Kullback-Leibler divergences ------------------------------------------------------

_LOG_PS = [[-2.9957, -3.5066, -3.9120, -1.2040, -0.6931, -2.3026],
           [-1.6094, -1.6094, -1.6094, -2.3026, -1.8971, -1.8971]]
_QS = [[0.2, 0.2, 0.2, 0.1, 0.15, 0.15], [0.05, 0.03, 0.02, 0.3, 0.5, 0.0]]


def test_kl_divergences_hand_values():
    # optax's test values
    lp, q = torch.tensor(_LOG_PS), torch.tensor(_QS)
    close = dict(atol=1e-4, rtol=0)
    torch.testing.assert_close(kl_divergence(lp, q), torch.tensor([0.8875577, 0.7592807]),
                               **close)
    torch.testing.assert_close(generalized_kl_divergence(lp, q),
                               torch.tensor([0.88757247, 0.859308]), **close)
    torch.testing.assert_close(kl_divergence_with_log_targets(lp, lp.flip(0)),
                               torch.tensor([0.8875625, 0.7187435584901326]), **close)
    with pytest.warns(DeprecationWarning, match="use generalized_kl_divergence"):
        old = convex_kl_divergence(lp, q)
    torch.testing.assert_close(old, generalized_kl_divergence(lp, q))


def test_kl_divergences_match_the_formula_and_torch():
    gen = fresh_generator()
    lp = torch.log(_simplex(gen, 5, 6)).float()
    q = _simplex(gen, 5, 6)
    q[:, 0] = 0.0  # zero targets add nothing
    rows = list(zip(_rows(lp), _rows(q)))
    kl = torch.tensor([sum(b * (math.log(b) - a) for a, b in zip(r, s) if b > 0)
                       for r, s in rows], dtype=D)
    gkl = kl + torch.tensor([sum(math.exp(a) - b for a, b in zip(r, s)) for r, s in rows],
                            dtype=D)
    q32 = q.float()
    torch.testing.assert_close(kl_divergence(lp, q32).double(), kl, **F32)
    torch.testing.assert_close(generalized_kl_divergence(lp, q32).double(), gkl, **F32)
    torch.testing.assert_close(kl_divergence(lp.double(), q),
                               F.kl_div(lp.double(), q, reduction="none").sum(-1), **F64)
    lq = torch.log(_simplex(gen, 5, 6))
    torch.testing.assert_close(
        kl_divergence_with_log_targets(lp.double(), lq),
        F.kl_div(lp.double(), lq, reduction="none", log_target=True).sum(-1), **F64)
    torch.testing.assert_close(kl_divergence_with_log_targets(lp.double(), torch.log(q)),
                               kl, **F64)


def test_kl_divergences_zero_probabilities():
    inf = math.inf
    lp = torch.tensor([[-inf, math.log(0.5), math.log(0.5)]], dtype=D)
    q = torch.tensor([[0.0, 0.25, 0.75]], dtype=D)
    want = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    for got in (kl_divergence(lp, q), generalized_kl_divergence(lp, q),
                kl_divergence_with_log_targets(lp, torch.log(q))):
        torch.testing.assert_close(got, torch.tensor([want], dtype=D), **F64)
    g = torch.func.grad(lambda z: kl_divergence(z, q).sum())(lp)
    torch.testing.assert_close(g, -q, **F64)
    g = torch.func.grad(lambda z: kl_divergence_with_log_targets(lp, z).sum())(torch.log(q))
    assert torch.isfinite(g).all() and g[0, 0] == 0
    # a positive target where the prediction is impossible: infinite divergence
    assert kl_divergence(lp, q.flip(-1))[0] == inf


@pytest.mark.parametrize("axis", [0, 1, 2, (0, 2), None])
def test_kl_divergences_axis_and_where(axis):
    gen = fresh_generator()
    lp = torch.randn(3, 4, 5, generator=gen, dtype=D)
    q = torch.rand(3, 4, 5, generator=gen, dtype=D)
    where = torch.rand(3, 4, 5, generator=gen) < 0.6
    terms = {
        kl_divergence: q * (torch.log(q) - lp),
        generalized_kl_divergence: q * (torch.log(q) - lp) - q + torch.exp(lp),
    }
    for f, t in terms.items():
        dims = tuple(range(3)) if axis is None else axis
        torch.testing.assert_close(f(lp, q, axis=axis), t.sum(dims), **F64)
        torch.testing.assert_close(f(lp, q, axis=axis, where=where),
                                   (t * where).sum(dims), **F64)
    torch.testing.assert_close(
        kl_divergence_with_log_targets(lp, torch.log(q), axis=axis, where=where),
        kl_divergence(lp, q, axis=axis, where=where), **F64)


# --- label smoothing -------------------------------------------------------------------

def test_smooth_labels():
    gen = fresh_generator()
    y = F.one_hot(torch.randint(5, (4, 3), generator=gen), 5).float()
    for alpha in (0.0, 0.1, 1.0):
        torch.testing.assert_close(smooth_labels(y, alpha), (1 - alpha) * y + alpha / 5)
    assert smooth_labels(y.double(), 0.3).dtype == D
    torch.testing.assert_close(smooth_labels(y, 0.2, axis=(0, 2)), 0.8 * y + 0.2 / 20)
    torch.testing.assert_close(smooth_labels(y, 0.2, axis=None), 0.8 * y + 0.2 / 60)
    where = torch.rand(4, 3, 5, generator=gen) < 0.7
    where[..., 0] = True
    count = [[sum(map(bool, r)) for r in m] for m in where.tolist()]
    got = smooth_labels(y, 0.3, where=where)
    torch.testing.assert_close(got, 0.7 * y + 0.3 / torch.tensor(count).unsqueeze(-1))
    count = [sum(where[i, j, k].item() for i in range(4) for k in range(5)) for j in range(3)]
    got = smooth_labels(y, 0.3, axis=(0, 2), where=where)
    torch.testing.assert_close(got, 0.7 * y + 0.3 / torch.tensor(count).view(1, 3, 1))
    # a tensor alpha, differentiated
    a = torch.tensor(0.25)
    torch.testing.assert_close(torch.func.grad(lambda t: smooth_labels(y, t).sum())(a),
                               (-y + 1 / 5).sum())


# --- gradients (float64 finite differences) and vmap -----------------------------------

def _cases(gen):
    """(name, function of tensors, float64 tensors to differentiate)."""
    x = torch.randn(3, 4, generator=gen, dtype=D)
    y = _simplex(gen, 3, 4)
    lab = torch.randint(4, (3,), generator=gen)
    where = torch.rand(3, 4, generator=gen) < 0.6
    where[0] = False
    where[1, lab[1]] = where[2, lab[2]] = True
    b = torch.rand(3, 4, generator=gen, dtype=D) * 0.9 + 0.05
    sign = torch.where(torch.rand(3, 4, generator=gen) < 0.5, -1.0, 1.0).double()
    some = where | ~where.any(-1, keepdim=True)  # every row with a class to count
    alpha = torch.tensor(0.2, dtype=D)
    return [
        ("softmax_cross_entropy", lambda a, c: softmax_cross_entropy(a, c, where=where), (x, y)),
        ("softmax_cross_entropy_axis0", lambda a, c: softmax_cross_entropy(a, c, axis=0),
         (x, y)),
        # zero labels: the derivative in a zero label is still -log softmax
        ("safe_softmax_cross_entropy", safe_softmax_cross_entropy, (x, y * where)),
        ("integer_labels", lambda a: softmax_cross_entropy_with_integer_labels(
            a, lab, where=where), (x,)),
        ("integer_labels_axis0", lambda a: softmax_cross_entropy_with_integer_labels(
            a, lab.remainder(3).repeat(2)[:4], axis=0), (x,)),
        ("poly_loss", lambda a, c: poly_loss_cross_entropy(a, c, epsilon=1.3, where=where),
         (x, y)),
        ("sigmoid_bce", sigmoid_binary_cross_entropy, (x, b)),
        ("focal", lambda a, c: sigmoid_focal_loss(a, c, alpha=0.3, gamma=1.5), (x, b)),
        ("hinge", lambda a: hinge_loss(a * 3, sign), (x,)),
        ("perceptron", lambda a: perceptron_loss(a, sign), (x,)),
        ("multiclass_hinge", lambda a: multiclass_hinge_loss(a, lab), (x,)),
        ("multiclass_perceptron", lambda a: multiclass_perceptron_loss(a, lab), (x,)),
        ("kl", lambda a, c: kl_divergence(a, c, where=where), (x, b)),
        ("kl_log_targets", lambda a, c: kl_divergence_with_log_targets(a, c, axis=0), (x, y)),
        ("generalized_kl", lambda a, c: generalized_kl_divergence(a, c, axis=None), (x, b)),
        ("smooth_labels", lambda c, t: smooth_labels(c, t, where=some), (y, alpha)),
    ]


def test_gradients_match_finite_differences():
    gen = fresh_generator()
    for name, f, args in _cases(gen):
        args = tuple(a.clone().requires_grad_() for a in args)
        assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-6), name


def test_vmap_equals_a_loop():
    gen = fresh_generator()
    batch = 3
    for name, f, args in _cases(gen):
        stacked = tuple(torch.stack([a + 0.01 * k * a.abs() for k in range(batch)])
                        for a in args)
        got = torch.func.vmap(f)(*stacked)
        want = torch.stack([f(*(s[k] for s in stacked)) for k in range(batch)])
        torch.testing.assert_close(got, want, **F64, msg=name)
    # batched integer labels, masks and a tuple axis
    x = torch.randn(batch, 2, 3, 4, generator=gen, dtype=D)
    lab = torch.randint(12, (batch, 2), generator=gen)
    w = torch.rand(batch, 2, 3, 4, generator=gen) < 0.7
    f = lambda a, c, m: softmax_cross_entropy_with_integer_labels(a, c, axis=(1, 2), where=m)
    torch.testing.assert_close(torch.func.vmap(f)(x, lab, w),
                               torch.stack([f(x[k], lab[k], w[k]) for k in range(batch)]))


# --- bad input -------------------------------------------------------------------------

_x = torch.zeros(2, 3)
_p = torch.full((2, 3), 1 / 3)
_lab = torch.tensor([0, 2])

BAD = [
    (lambda: softmax_cross_entropy(_lab, _p), TypeError, "logits must be a real floating"),
    (lambda: softmax_cross_entropy(_x, [[1.0, 0, 0]]), TypeError, "labels must be a torch"),
    (lambda: softmax_cross_entropy(_x, torch.ones(2, 4)), ValueError,
     r"softmax_cross_entropy: logits and labels must have shapes that broadcast together, "
     r"got \(2, 3\) and \(2, 4\)"),
    (lambda: softmax_cross_entropy(_x, _p, axis=2), ValueError,
     r"softmax_cross_entropy: axis must be in \[-2, 2\) .*, got 2"),
    (lambda: softmax_cross_entropy(_x, _p, axis=(1, -1)), ValueError,
     r"softmax_cross_entropy: axis must not repeat a dimension, got \(1, -1\)"),
    (lambda: softmax_cross_entropy(_x, _p, axis=1.0), TypeError, "axis must be an int"),
    (lambda: softmax_cross_entropy(_x, _p, axis=()), TypeError, "non-empty tuple"),
    (lambda: softmax_cross_entropy(_x, _p, where=torch.ones(2, 3)), TypeError,
     "where must be a bool tensor"),
    (lambda: softmax_cross_entropy(_x, _p, where=torch.ones(3, dtype=torch.bool, ).view(3, 1)),
     ValueError, r"softmax_cross_entropy: where must have a shape that broadcasts with the "
     r"input's shape \(2, 3\), got \(3, 1\)"),
    (lambda: softmax_cross_entropy(_x, _p, where=torch.ones(2, 3, 1, dtype=torch.bool)),
     ValueError, "or its batch shape"),
    (lambda: safe_softmax_cross_entropy(torch.tensor(1.0), torch.tensor(1.0)), ValueError,
     "class dimension"),
    (lambda: softmax_cross_entropy_with_integer_labels(_x, _lab.float()), TypeError,
     "labels must be a tensor of integer class labels"),
    (lambda: softmax_cross_entropy_with_integer_labels(_x, _lab > 0), TypeError,
     "integer class labels"),
    (lambda: softmax_cross_entropy_with_integer_labels(_x, _lab, axis=None), TypeError,
     "axis must be an int or a tuple"),
    (lambda: softmax_cross_entropy_with_integer_labels(_x, _lab[None]), ValueError,
     "labels must have the logits' shape without axis"),
    (lambda: softmax_cross_entropy_with_integer_labels(_x, torch.tensor([0, 1, 2])),
     ValueError, r"logits \(batch shape\) and labels must have shapes that broadcast "
     r"together, got \(2,\) and \(3,\)"),
    (lambda: poly_loss_cross_entropy(_x, _lab[:, None].expand(2, 3)), TypeError,
     "labels must be a real floating"),
    (lambda: sigmoid_binary_cross_entropy(_x, torch.ones(3, 2)), ValueError,
     "sigmoid_binary_cross_entropy: logits and labels must have shapes that broadcast"),
    (lambda: sigmoid_focal_loss(_x, _p, alpha=1.5), ValueError, r"alpha must be in \[0, 1\]"),
    (lambda: sigmoid_focal_loss(_x, _p, alpha="a"), TypeError,
     "sigmoid_focal_loss: alpha must be a real number or a tensor, got str"),
    (lambda: hinge_loss(_lab, _lab), TypeError, "predictor_outputs must be a real floating"),
    (lambda: hinge_loss(_x, torch.ones(4)), ValueError,
     "hinge_loss: predictor_outputs and targets must have shapes that broadcast"),
    (lambda: perceptron_loss(_x, torch.ones(3)), ValueError, "must have the same shape"),
    (lambda: multiclass_hinge_loss(_x, _lab.float()), TypeError, "integer class labels"),
    (lambda: multiclass_hinge_loss(torch.tensor(1.0), _lab), ValueError, "class dimension"),
    (lambda: multiclass_perceptron_loss(_x, torch.tensor([0, 1, 2])), ValueError,
     r"multiclass_perceptron_loss: scores \(batch shape\) and labels must have shapes that "
     r"broadcast together, got \(2,\) and \(3,\)"),
    (lambda: kl_divergence(_x, _lab), TypeError, "targets must be a real floating"),
    (lambda: kl_divergence_with_log_targets(_x, torch.ones(4)), ValueError,
     "kl_divergence_with_log_targets: log_predictions and log_targets must have shapes "
     "that broadcast"),
    (lambda: generalized_kl_divergence(_x, _p, axis=-3), ValueError,
     r"generalized_kl_divergence: axis must be in \[-2, 2\) .*, got -3"),
    (lambda: kl_divergence(_x, _p, where=torch.ones(4, dtype=torch.bool)), ValueError,
     r"kl_divergence: where must have a shape that broadcasts with the input's shape "
     r"\(2, 3\), got \(4,\)"),
    (lambda: smooth_labels(_lab, 0.1), TypeError, "labels must be a real floating"),
    (lambda: smooth_labels(_p, -0.1), ValueError, r"alpha must be in \[0, 1\]"),
    (lambda: smooth_labels(_p, 0.1, axis=5), ValueError,
     r"smooth_labels: axis must be in \[-2, 2\) .*, got 5"),
    (lambda: smooth_labels(_p, 0.1, where=torch.ones(4, dtype=torch.bool)), ValueError,
     r"smooth_labels: where must have a shape that broadcasts to the labels' shape "
     r"\(2, 3\), got \(4,\)"),
    (lambda: smooth_labels(_p, 0.1, where=torch.ones(3)), TypeError, "where must be a bool"),
]


@pytest.mark.parametrize("call,error,match", BAD, ids=range(len(BAD)))
def test_bad_input_is_refused(call, error, match):
    with pytest.raises(error, match=match):
        call()
