"""The regression, segmentation and self-supervised losses of :mod:`ftopt.losses`.

References are float64 formulas written out here (explicit loops over rows, classes and
pairs), and torch's own losses where the semantics coincide: ``F.mse_loss`` and
``F.huber_loss`` exactly; ``F.cosine_similarity`` with ``eps = sqrt(epsilon)`` (it clips
the norms, ftopt the squared norms); ``F.triplet_margin_loss`` at ``eps=0`` (it adds
``eps`` to the differences, ftopt to the sum of powers) and ``swap=False``. Hand-computed
values from optax's tests and docstrings are reproduced as expectations.
"""

from __future__ import annotations

import decimal
import math

import pytest
import torch
import torch.nn.functional as F
from step_checks import fresh_generator

from ftopt.losses._regression import (
    cosine_distance,
    cosine_similarity,
    huber_loss,
    l2_loss,
    log_cosh,
    squared_error,
)
from ftopt.losses._segmentation import (
    binary_dice_loss,
    dice_loss,
    multiclass_generalized_dice_loss,
)
from ftopt.losses._self_supervised import ntxent, triplet_margin_loss

F64 = torch.float64


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)


def close(actual, expected, rtol, atol=0.0):
    torch.testing.assert_close(actual.to(F64), expected.to(F64), rtol=rtol, atol=atol)


def func_grad_matches_autograd(fn, x):
    """torch.func.grad of sum(fn) equals autograd's gradient."""
    functional = torch.func.grad(lambda y: fn(y).sum())(x)
    leaf = x.detach().clone().requires_grad_(True)
    (eager,) = torch.autograd.grad(fn(leaf).sum(), leaf)
    torch.testing.assert_close(functional, eager)


# --- element-wise regression losses ------------------------------------------------------

def test_squared_error_and_l2_loss_match_the_formula_and_mse_loss():
    gen = fresh_generator()
    p, t = randn(gen, 3, 5), randn(gen, 3, 5)
    ref = torch.tensor([[(float(a) - float(b)) ** 2 for a, b in zip(ra, rb)]
                        for ra, rb in zip(p.tolist(), t.tolist())], dtype=F64)
    out = squared_error(p, t)
    assert out.dtype == torch.float32 and out.shape == (3, 5)
    close(out, ref, rtol=1e-6)
    torch.testing.assert_close(out, F.mse_loss(p, t, reduction="none"))
    close(l2_loss(p, t), 0.5 * ref, rtol=1e-6)
    close(squared_error(p), p.to(F64) ** 2, rtol=1e-6)
    close(l2_loss(p[0, 0]), 0.5 * p[0, 0].to(F64) ** 2, rtol=1e-6)
    func_grad_matches_autograd(lambda x: l2_loss(x, t), p)
    torch.testing.assert_close(torch.func.grad(lambda x: l2_loss(x, t).sum())(p), p - t)


def test_squared_error_errors():
    p = torch.ones(4)
    with pytest.raises(ValueError, match=r"squared_error: targets must have predictions' "
                                         r"shape \(4,\), got \(4, 1\)"):
        squared_error(p, torch.ones(4, 1))
    with pytest.raises(ValueError, match="l2_loss: targets must have predictions' shape"):
        l2_loss(p, torch.ones(1))  # broadcastable, but optax asks for equal shapes
    with pytest.raises(TypeError, match="squared_error: predictions must be a real "
                                        "floating-point tensor, got torch.int64"):
        squared_error(torch.ones(4, dtype=torch.int64))
    with pytest.raises(TypeError, match="l2_loss: targets must be a torch.Tensor, got list"):
        l2_loss(p, [1.0] * 4)


def huber_reference(e: float, delta: float) -> float:
    return 0.5 * e * e if abs(e) <= delta else delta * (abs(e) - 0.5 * delta)


@pytest.mark.parametrize("delta", [0.3, 1.0, 2.5])
def test_huber_loss_matches_the_formula_and_torch(delta):
    gen = fresh_generator()
    p, t = 3 * randn(gen, 4, 6), randn(gen, 6)  # targets broadcast; both branches hit
    out = huber_loss(p, t, delta=delta)
    ref = torch.tensor([[huber_reference(a - b, delta) for a, b in zip(row, t.tolist())]
                        for row in p.tolist()], dtype=F64)
    close(out, ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out, F.huber_loss(p, t.expand_as(p), reduction="none",
                                                 delta=delta))
    # The gradient is the error clipped to [-delta, delta].
    grad = torch.func.grad(lambda x: huber_loss(x, t, delta=delta).sum())(p)
    torch.testing.assert_close(grad, (p - t).clamp(-delta, delta))
    func_grad_matches_autograd(lambda x: huber_loss(x, t, delta=delta), p)
    close(huber_loss(p, delta=delta), torch.tensor(
        [[huber_reference(a, delta) for a in row] for row in p.tolist()], dtype=F64),
        rtol=1e-6, atol=1e-7)


def test_huber_loss_optax_values_and_tensor_delta():
    ys = torch.tensor([-2.0, 0.5, 0.0, 0.5, 2.0, 4.0, 132.0])
    ts = torch.tensor([0.0, -0.5, 0.0, 1.0, 1.0, 2.0, 0.3])
    expected = torch.tensor([1.5, 0.5, 0.0, 0.125, 0.5, 1.5, 131.2])
    torch.testing.assert_close(huber_loss(ys, ts, delta=1.0), expected)
    gen = fresh_generator()
    p, delta = 2 * randn(gen, 5, 7), torch.rand(7, generator=gen) + 0.2
    ref = torch.tensor([[huber_reference(a, d) for a, d in zip(row, delta.tolist())]
                        for row in p.tolist()], dtype=F64)
    close(huber_loss(p, delta=delta), ref, rtol=1e-6, atol=1e-7)
    # A number delta takes torch's kernel, a tensor one (or mixed dtypes) the formula:
    # the same values and gradients either way.
    t = randn(gen, 7)
    for targets in (t, t.double()):
        by_number = torch.func.grad(
            lambda x, y=targets: huber_loss(x, y, delta=0.7).sum())(p)
        by_tensor = torch.func.grad(
            lambda x, y=targets: huber_loss(x, y, delta=torch.tensor(0.7)).sum())(p)
        torch.testing.assert_close(by_number, by_tensor)
        torch.testing.assert_close(huber_loss(p, targets, delta=0.7),
                                   huber_loss(p, targets, delta=torch.tensor(0.7)))


def test_huber_loss_errors():
    with pytest.raises(ValueError, match="huber_loss: delta must be > 0, got 0"):
        huber_loss(torch.ones(3), delta=0)
    with pytest.raises(TypeError, match="huber_loss: delta must be a real number or a tensor"):
        huber_loss(torch.ones(3), delta="1")
    with pytest.raises(ValueError, match=r"huber_loss: predictions and targets must have "
                                         r"shapes that broadcast together, got \(3,\) and "
                                         r"\(4,\)"):
        huber_loss(torch.ones(3), torch.ones(4))


def log_cosh_reference(x: float) -> float:
    """log(cosh(x)) straight from the definition, in 50-digit decimal arithmetic."""
    with decimal.localcontext() as ctx:
        ctx.prec = 50
        d = decimal.Decimal(x)
        return float(((d.exp() + (-d).exp()) / 2).ln())


def test_log_cosh_is_accurate_from_tiny_to_huge_errors():
    gen = fresh_generator()
    magnitude = 10 ** (torch.rand(400, generator=gen, dtype=F64) * 10 - 6)  # 1e-6..1e4
    sign = torch.randint(0, 2, (400,), generator=gen) * 2 - 1
    x64 = torch.cat([magnitude * sign, torch.tensor([1e4, -1e4, 1.0, -1.0, 0.0], dtype=F64)])
    x = x64.float()
    ref = torch.tensor([log_cosh_reference(v) for v in x.to(F64).tolist()], dtype=F64)
    out = log_cosh(x)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    close(out, ref, rtol=5e-7, atol=1e-45)  # relative accuracy even for 1e-6 errors
    close(log_cosh(x64), torch.tensor([log_cosh_reference(v) for v in x64.tolist()],
                                      dtype=F64), rtol=1e-13, atol=1e-300)
    assert out[-5].item() == pytest.approx(1e4 - math.log(2.0), rel=1e-7)
    # Differences of predictions and targets (Keras' values, as in optax's tests).
    ys = torch.tensor([500, -2.0, -1.0, 0.5, 1.0])
    ts = torch.tensor([-200, -1.5, 0.0, -1, 1.0])
    close(log_cosh(ys, ts), torch.tensor([699.3068, 0.12011445, 0.4337809, 0.85544014,
                                          0.0]), rtol=1e-6, atol=1e-7)
    close(log_cosh(ys), torch.tensor([499.30685, 1.3250027, 0.4337809, 0.12011451,
                                      0.43378082]), rtol=1e-6, atol=1e-7)


def test_log_cosh_derivatives_are_tanh_and_its_derivative():
    gen = fresh_generator()
    x = torch.cat([3 * randn(gen, 50), torch.tensor([0.0, 1.0, -1.0, 80.0, -1e4, 1e4])])
    grad = torch.func.grad(lambda v: log_cosh(v).sum())(x)
    close(grad, torch.tanh(x.to(F64)), rtol=2e-6, atol=1e-7)
    func_grad_matches_autograd(log_cosh, x)
    second = torch.func.vmap(torch.func.grad(torch.func.grad(log_cosh)))(x.to(F64))
    close(second, 1 - torch.tanh(x.to(F64)) ** 2, rtol=1e-10, atol=1e-12)
    # Straddling the switch between the two exact forms.
    x64 = torch.cat([randn(gen, 8, dtype=F64), torch.tensor([0.999, 1.001, -1.0])])
    t64 = 0.1 * randn(gen, 11, dtype=F64)
    assert torch.autograd.gradcheck(log_cosh, (x64.requires_grad_(), t64))
    assert torch.autograd.gradgradcheck(log_cosh, (x64, t64))


# --- cosine similarity and distance --------------------------------------------------------

def cosine_reference(p, t, axis=-1, where=None, epsilon=0.0):
    """Loop over the slices along ``axis`` of the broadcast inputs, in float64."""
    shape = torch.broadcast_shapes(p.shape, t.shape,
                                   *(() if where is None else (where.shape,)))
    dims = tuple(range(len(shape))) if axis is None else (
        (axis,) if isinstance(axis, int) else tuple(axis))
    dims = sorted(d % len(shape) for d in dims)
    keep = [d for d in range(len(shape)) if d not in dims]
    mask = torch.ones(shape, dtype=torch.bool) if where is None else where.expand(shape)

    def rows(x):
        x = x.expand(shape).permute(*keep, *dims)
        return x.reshape(math.prod(shape[d] for d in keep), -1).tolist()

    out = []
    for a, b, m in zip(rows(p.to(F64)), rows(t.to(F64)), rows(mask)):
        sel = [i for i, on in enumerate(m) if on]
        dot = sum(a[i] * b[i] for i in sel)
        na = max(sum(a[i] ** 2 for i in sel), epsilon)
        nb = max(sum(b[i] ** 2 for i in sel), epsilon)
        out.append(dot / math.sqrt(na * nb))
    return torch.tensor(out, dtype=F64).reshape([shape[d] for d in keep])


@pytest.mark.parametrize("axis", [0, 1, 2, -1, (0, 2), None])
def test_cosine_similarity_and_distance_along_axes(axis):
    gen = fresh_generator()
    p, t = randn(gen, 4, 5, 6), randn(gen, 4, 5, 6)
    ref = cosine_reference(p, t, axis)
    close(cosine_similarity(p, t, axis=axis), ref, rtol=2e-6, atol=4e-7)
    close(cosine_distance(p, t, axis=axis), 1 - ref, rtol=2e-6, atol=4e-7)
    if isinstance(axis, int):  # the same as the default axis on moved data
        torch.testing.assert_close(
            cosine_similarity(p, t, axis=axis),
            cosine_similarity(p.movedim(axis, -1), t.movedim(axis, -1)))


def test_cosine_distance_scipy_values():
    ys = torch.tensor([[10.0, 1.0, -2.0], [1.0, 4.0, 0.2]])
    ts = torch.tensor([[0.0, 1.2, 0.2], [1.0, -0.3, 0.0]])
    expected = torch.tensor([0.9358251989, 1.0464068465])
    torch.testing.assert_close(cosine_distance(ys, ts), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(cosine_similarity(ys[0], ts[0]), 1 - expected[0],
                               rtol=0, atol=1e-6)


def test_cosine_where_selects_elements():
    gen = fresh_generator()
    p, t = randn(gen, 10), randn(gen, 10)
    mask = torch.rand(10, generator=gen) < 0.5
    mask[torch.randint(0, 10, (1,), generator=gen)] = True
    torch.testing.assert_close(cosine_similarity(p, t, where=mask),
                               cosine_similarity(p[mask], t[mask]))
    # Batched, with a mask that broadcasts; masked-out non-finite values stay out.
    p, t = randn(gen, 3, 4, 6), randn(gen, 4, 6)
    mask = torch.rand(4, 6, generator=gen) < 0.5
    mask[torch.arange(4), torch.randint(0, 6, (4,), generator=gen)] = True  # each row
    mask[torch.randint(0, 4, (6,), generator=gen), torch.arange(6)] = True  # each column
    p_bad = p.masked_fill(~mask, float("inf"))
    out = cosine_distance(p_bad, t, where=mask, epsilon=1e-12)
    close(out, 1 - cosine_reference(p, t, -1, mask), rtol=2e-6, atol=4e-7)
    ref01 = cosine_reference(p, t, (0, 1), mask)
    close(cosine_similarity(p, t, axis=(0, 1), where=mask), ref01, rtol=2e-6, atol=4e-7)


def test_cosine_epsilon_clips_the_squared_norms_as_torch_clips_the_norms():
    gen = fresh_generator()
    p, t = randn(gen, 6, 5, dtype=F64), randn(gen, 1, 5, dtype=F64)
    p[:3] *= 1e-3  # norms below sqrt(epsilon) = 1e-2: the clip is active
    epsilon = 1e-4
    out = cosine_similarity(p, t, epsilon=epsilon)
    torch.testing.assert_close(out, F.cosine_similarity(p, t, dim=-1, eps=1e-2))
    torch.testing.assert_close(out, cosine_reference(p, t, epsilon=epsilon))
    shrink = p[:3].norm(dim=-1) / 1e-2  # the clipped rows: the norm replaced by 1e-2
    torch.testing.assert_close(out[:3], cosine_similarity(p[:3], t) * shrink)
    assert torch.isnan(cosine_similarity(torch.zeros(3), torch.ones(3))).item()


def test_cosine_gradients_and_vmap():
    gen = fresh_generator()
    p, t = randn(gen, 3, 5, dtype=F64), randn(gen, 3, 5, dtype=F64)
    mask = torch.rand(3, 5, generator=gen) < 0.7
    mask[:, 0] = True
    fn = lambda a, b: cosine_distance(a, b, where=mask, epsilon=1e-3)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (p.requires_grad_(), t.requires_grad_()))
    func_grad_matches_autograd(lambda a: fn(a, t.detach()), p.detach())
    batched = torch.func.vmap(lambda a, b: cosine_similarity(a, b, axis=0))(p, t)
    torch.testing.assert_close(
        batched, torch.stack([cosine_similarity(a, b, axis=0) for a, b in zip(p, t)]))


def test_cosine_errors():
    p = torch.ones(3, 4)
    with pytest.raises(ValueError, match=r"cosine_similarity: predictions and targets must "
                                         r"have shapes that broadcast together, got "
                                         r"\(3, 4\) and \(3, 5\)"):
        cosine_similarity(p, torch.ones(3, 5))
    with pytest.raises(ValueError, match=r"cosine_similarity: predictions, targets and where "
                                         r"must have shapes that broadcast together, got "
                                         r"\(3, 4\), \(3, 4\) and \(2, 4\)"):
        cosine_similarity(p, p, where=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="cosine_distance: where must be a bool tensor, got "
                                        "torch.int64"):
        cosine_distance(p, p, where=torch.ones(3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"cosine_similarity: axis must be in \[-2, 2\) for a "
                                         r"tensor of 2 dimension\(s\), got 2"):
        cosine_similarity(p, p, axis=2)
    with pytest.raises(ValueError, match=r"cosine_similarity: axis must not repeat a "
                                         r"dimension, got \(1, -1\)"):
        cosine_similarity(p, p, axis=(1, -1))
    with pytest.raises(TypeError, match="cosine_similarity: axis must be an int, a sequence "
                                        "of ints or None, got 1.0"):
        cosine_similarity(p, p, axis=1.0)
    with pytest.raises(TypeError, match="cosine_distance: targets must be a real "
                                        "floating-point tensor, got torch.int32"):
        cosine_distance(p, torch.ones(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="cosine_similarity: epsilon must be >= 0, got -0.001"):
        cosine_similarity(p, p, epsilon=-1e-3)


# --- Dice losses -----------------------------------------------------------------------------

def softmax_reference(x):
    e = torch.exp(x.to(F64) - x.to(F64).amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def dice_reference(probs, targets, dims, alpha=0.5, beta=0.5, smooth=1.0, weights=None,
                   ignore_background=False, reduction="mean"):
    """Per (kept index, class) in float64, the classes being the last axis."""
    probs, targets = probs.to(F64), targets.to(F64)
    keep = [d for d in range(probs.ndim - 1) if d not in dims]
    order = (*keep, *dims, probs.ndim - 1)
    n_keep = math.prod(probs.shape[d] for d in keep)
    p = probs.permute(order).reshape(n_keep, -1, probs.shape[-1])
    t = targets.permute(order).reshape(n_keep, -1, probs.shape[-1])
    out = torch.empty(n_keep, probs.shape[-1], dtype=F64)
    for k in range(n_keep):
        for c in range(probs.shape[-1]):
            inter = float((p[k, :, c] * t[k, :, c]).sum())
            fp, fn = float(p[k, :, c].sum()) - inter, float(t[k, :, c].sum()) - inter
            loss = 1 - (inter + smooth) / (inter + alpha * fp + beta * fn + smooth)
            out[k, c] = loss * (1.0 if weights is None else float(weights[c]))
    out = out.reshape(*(probs.shape[d] for d in keep), probs.shape[-1])
    if ignore_background and probs.shape[-1] > 1:
        out = out[..., 1:]
    return {"mean": out.mean(-1), "sum": out.sum(-1), "none": out}[reduction]


def one_hot(gen, *shape, classes):
    return F.one_hot(torch.randint(0, classes, shape, generator=gen), classes).float()


def test_dice_loss_matches_the_formula_for_every_option():
    gen = fresh_generator()
    logits, targets = randn(gen, 2, 4, 5, 3), one_hot(gen, 2, 4, 5, classes=3)
    probs = softmax_reference(logits)
    for alpha, beta, smooth in [(0.5, 0.5, 1.0), (0.3, 0.7, 0.0), (0.9, 0.2, 2.5)]:
        for weights in [None, torch.rand(3, generator=gen) + 0.5]:
            for reduction in ["mean", "sum", "none"]:
                for ignore in [False, True]:
                    kw = dict(alpha=alpha, beta=beta, smooth=smooth, reduction=reduction)
                    out = dice_loss(logits, targets, class_weights=weights,
                                    ignore_background=ignore, **kw)
                    ref = dice_reference(probs, targets, (1, 2), weights=weights,
                                         ignore_background=ignore, **kw)
                    assert out.shape == ref.shape
                    close(out, ref, rtol=2e-6, atol=2e-7)
    # Probabilities given directly, and a user axis.
    close(dice_loss(probs.float(), targets, apply_softmax=False, reduction="none"),
          dice_reference(probs, targets, (1, 2), reduction="none"), rtol=2e-6, atol=2e-7)
    close(dice_loss(logits, targets, axis=(0, 2)),
          dice_reference(probs, targets, (0, 2)), rtol=2e-6, atol=2e-7)
    close(dice_loss(logits, targets, axis=-2, class_weights=[1.0, 2.0, 0.5]),
          dice_reference(probs, targets, (2,), weights=[1.0, 2.0, 0.5]), rtol=2e-6,
          atol=2e-7)
    # [batch, classes]: the default axis is empty, nothing is summed.
    close(dice_loss(logits[:, 0, 0], targets[:, 0, 0]),
          dice_reference(probs[:, 0, 0], targets[:, 0, 0], ()), rtol=2e-6, atol=2e-7)


def test_binary_dice_losses_and_channel_axes():
    gen = fresh_generator()
    logits = randn(gen, 2, 4, 5)
    targets = torch.rand(2, 4, 5, generator=gen) < 0.4
    ref = dice_reference(torch.sigmoid(logits.to(F64))[..., None], targets[..., None], (1, 2))
    close(binary_dice_loss(logits, targets), ref, rtol=2e-6, atol=2e-7)
    for p, t in [(logits[..., None], targets[..., None]), (logits, targets[..., None]),
                 (logits[..., None], targets)]:
        close(dice_loss(p, t), ref, rtol=2e-6, atol=2e-7)
        close(binary_dice_loss(p, t), ref, rtol=2e-6, atol=2e-7)
    probs = torch.sigmoid(logits)
    close(binary_dice_loss(probs, targets, apply_sigmoid=False),
          dice_reference(probs[..., None], targets[..., None], (1, 2)), rtol=2e-6, atol=2e-7)
    # One channel is no background to drop.
    torch.testing.assert_close(dice_loss(logits, targets[..., None], ignore_background=True),
                               dice_loss(logits, targets[..., None]))
    # optax's docstring example: logits [2, 2, 1] give one loss per sample.
    x = torch.tensor([[1.0, -1.0], [0.5, 0.5]])[..., None]
    assert dice_loss(x, torch.tensor([[1.0, 0.0], [1.0, 0.0]])[..., None]).shape == (2,)
    # Perfect and opposite predictions.
    hard = (torch.rand(1, 6, 6, 1, generator=gen) < 0.5).float()
    assert dice_loss(torch.where(hard > 0, 10.0, -10.0), hard).item() < 0.01
    assert dice_loss(torch.where(hard > 0, -10.0, 10.0), hard, smooth=1.0).item() > 0.7


def test_multiclass_generalized_dice_loss_weights_by_inverse_squared_counts():
    gen = fresh_generator()
    logits = randn(gen, 3, 4, 4, 4)
    labels = torch.multinomial(torch.tensor([0.7, 0.2, 0.08, 0.02]), 48, True,
                               generator=gen).reshape(3, 4, 4)
    targets = F.one_hot(labels, 4).float()
    counts = [float((labels == c).sum()) for c in range(4)]
    raw = [1 / (n * n + 1e-7) for n in counts]
    weights = [4 * w / sum(raw) for w in raw]
    probs = softmax_reference(logits)
    for ignore in [False, True]:
        ref = dice_reference(probs, targets, (1, 2), weights=weights,
                             ignore_background=ignore, reduction="none").mean()
        out = multiclass_generalized_dice_loss(logits, targets, ignore_background=ignore)
        assert out.shape == ()
        close(out, ref, rtol=2e-6, atol=2e-7)


def test_dice_apply_softmax_false_checks_probabilities_eagerly():
    gen = fresh_generator()
    probs = torch.softmax(randn(gen, 2, 4, 3), -1)
    targets = one_hot(gen, 2, 4, classes=3)
    with pytest.raises(ValueError, match="dice_loss: predictions must be valid probability "
                                         "distributions that sum to 1 along the class axis "
                                         r"\(the last\) when apply_softmax=False, got sums"):
        dice_loss(torch.rand(2, 4, 3, generator=gen) + 0.1, targets, apply_softmax=False)
    with pytest.raises(ValueError, match=r"binary_dice_loss: predictions must be valid "
                                         r"probabilities in \[0, 1\] when apply_sigmoid=False "
                                         r"\(a single channel\), got values in"):
        binary_dice_loss(randn(gen, 2, 4) + 3.0, targets[..., 0], apply_sigmoid=False)
    # Under vmap the values are not read: the loss is computed as given.
    batched = torch.func.vmap(lambda p, t: dice_loss(p[None], t[None],
                                                     apply_softmax=False))(probs, targets)
    torch.testing.assert_close(batched[:, 0], dice_loss(probs, targets, apply_softmax=False))


def test_dice_gradients_and_vmap():
    gen = fresh_generator()
    logits = randn(gen, 2, 3, 4, 3, dtype=F64)
    targets = one_hot(gen, 2, 3, 4, classes=3).to(F64)
    fn = lambda x: dice_loss(x, targets, alpha=0.3, beta=0.7)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (logits.requires_grad_(),))
    assert torch.autograd.gradcheck(
        lambda x: multiclass_generalized_dice_loss(x, targets), (logits,))
    func_grad_matches_autograd(fn, logits.detach())
    # optax's vmap pattern: one sample at a time with a batch axis of one.
    batched = torch.func.vmap(lambda p, t: dice_loss(p[None], t[None]))(logits, targets)
    assert batched.shape == (2, 1)
    torch.testing.assert_close(batched[:, 0], dice_loss(logits.detach(), targets))


def test_dice_errors():
    p, t = torch.zeros(2, 4, 4, 3), torch.zeros(2, 4, 4, 2)
    with pytest.raises(ValueError, match=r"dice_loss: targets must have the shape of "
                                         r"predictions \(2, 4, 4, 3\) .*, got \(2, 4, 4, 2\)"):
        dice_loss(p, t)
    with pytest.raises(ValueError, match=r"multiclass_generalized_dice_loss: targets must "
                                         r"have the shape of predictions \(2, 4, 4, 3\)"):
        multiclass_generalized_dice_loss(p, t)
    t = torch.zeros(2, 4, 4, 3)
    with pytest.raises(ValueError, match="dice_loss: reduction must be one of .* got 'max'"):
        dice_loss(p, t, reduction="max")
    with pytest.raises(ValueError, match=r"dice_loss: class_weights must be 1-D .* shape "
                                         r"\(1, 3\)"):
        dice_loss(p, t, class_weights=torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"dice_loss: class_weights must have one weight per "
                                         r"class of the per-class losses of shape \(2, 3\), "
                                         r"got shape \(2,\)"):
        dice_loss(p, t, class_weights=torch.ones(2))
    with pytest.raises(TypeError, match="binary_dice_loss: predictions must be a real "
                                        "floating-point tensor, got torch.int64"):
        binary_dice_loss(torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="dice_loss: predictions and targets must have a "
                                         "class axis"):
        dice_loss(torch.tensor(0.5), torch.tensor(1.0))
    with pytest.raises(ValueError, match="dice_loss: smooth must be >= 0, got -1"):
        dice_loss(p, t, smooth=-1.0)
    with pytest.raises(ValueError, match=r"dice_loss: axis must be in \[-4, 4\) for a tensor "
                                         r"of 4 dimension\(s\), got 4"):
        dice_loss(p, t, axis=4)


# --- self-supervised losses ----------------------------------------------------------------

def ntxent_reference(z, labels, temperature):
    """The squared norms clipped at z's machine epsilon, as ntxent documents."""
    eps = torch.finfo(z.dtype).eps
    z = z.to(F64).tolist()
    unit = [[v / math.sqrt(max(sum(w * w for w in row), eps)) for v in row] for row in z]
    s = [[sum(a * b for a, b in zip(u, v)) / temperature for v in unit] for u in unit]
    total, count = 0.0, 0
    for i in range(len(z)):
        negatives = sum(math.exp(s[i][k]) for k in range(len(z)) if labels[k] != labels[i])
        for j in range(len(z)):
            if j != i and labels[j] == labels[i]:
                total -= math.log(math.exp(s[i][j]) / (math.exp(s[i][j]) + negatives))
                count += 1
    return torch.tensor(total / count, dtype=F64)


def test_ntxent_optax_values():
    ys = torch.tensor([[-1.9540, 1.0780], [0.2380, -0.5703], [1.8745, -0.0195],
                       [-0.6719, -1.9210]])
    ys_2 = ys.clone()
    ys_2[0] = 0.0  # a zero embedding: its norm is clipped at the machine epsilon
    t1, t2 = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 0, 0, 1])
    torch.testing.assert_close(ntxent(ys, t1), torch.tensor(14.01032), rtol=0, atol=1e-4)
    torch.testing.assert_close(ntxent(ys, t2), torch.tensor(8.968544), rtol=0, atol=1e-4)
    torch.testing.assert_close(ntxent(ys_2, t1), torch.tensor(9.2889), rtol=0, atol=1e-4)


def test_ntxent_matches_the_formula():
    gen = fresh_generator()
    for _ in range(4):
        z = randn(gen, 8, 5)
        labels = torch.randint(0, 3, (8,), generator=gen)
        labels[1] = labels[0]  # at least one positive pair
        temperature = 0.05 + 0.95 * torch.rand((), generator=gen).item()
        z[2] *= 1e-5  # a norm below sqrt(eps) = 3.5e-4: clipped, its logits shrink
        close(ntxent(z, labels, temperature), ntxent_reference(z, labels.tolist(),
                                                               temperature), rtol=1e-6)
    # One group: no negatives, every pair is already certain; no pair at all: NaN.
    z = randn(gen, 4, 3, dtype=F64).requires_grad_()
    loss = ntxent(z, torch.zeros(4, dtype=torch.int64))
    (grad,) = torch.autograd.grad(loss, z)
    assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))
    assert torch.isnan(ntxent(z, torch.arange(4))).item()


def test_ntxent_gradients_and_vmap():
    gen = fresh_generator()
    z = randn(gen, 6, 4, dtype=F64)
    labels = torch.tensor([0, 0, 1, 1, 2, 0])
    assert torch.autograd.gradcheck(lambda x: ntxent(x, labels, 0.5), (z.requires_grad_(),))
    func_grad_matches_autograd(lambda x: ntxent(x, labels), z.detach())
    zs = randn(gen, 3, 6, 4)
    batched = torch.func.vmap(lambda x: ntxent(x, labels, 0.2))(zs)
    torch.testing.assert_close(batched, torch.stack([ntxent(x, labels, 0.2) for x in zs]))


def test_ntxent_errors():
    z = torch.ones(4, 3)
    with pytest.raises(ValueError, match=r"ntxent: labels must be 1-D with one label per "
                                         r"embedding \(4\), got shape \(3,\)"):
        ntxent(z, torch.zeros(3))
    with pytest.raises(ValueError, match=r"ntxent: embeddings must be 2-D \[batch, "
                                         r"features\], got shape \(4,\)"):
        ntxent(torch.ones(4), torch.zeros(4))
    with pytest.raises(TypeError, match="ntxent: embeddings must be a real floating-point "
                                        "tensor, got torch.int64"):
        ntxent(torch.ones(4, 3, dtype=torch.int64), torch.zeros(4))
    with pytest.raises(ValueError, match="ntxent: temperature must be > 0, got 0"):
        ntxent(z, torch.zeros(4), temperature=0.0)


def triplet_reference(a, p, n, degree, margin, eps):
    out = []
    for ra, rp, rn in zip(a.to(F64).tolist(), p.to(F64).tolist(), n.to(F64).tolist()):
        dp = (sum(abs(x - y) ** degree for x, y in zip(ra, rp)) + eps) ** (1 / degree)
        dn = (sum(abs(x - y) ** degree for x, y in zip(ra, rn)) + eps) ** (1 / degree)
        out.append(max(dp - dn + margin, 0.0))
    return torch.tensor(out, dtype=F64)


@pytest.mark.parametrize("degree", [1, 2, 3, 1.5])
def test_triplet_margin_loss_matches_torch_and_the_formula(degree):
    gen = fresh_generator()
    a, p, n = (randn(gen, 16, 5, dtype=F64) for _ in range(3))
    margin = 0.5 + torch.rand((), generator=gen).item()
    out = triplet_margin_loss(a, p, n, norm_degree=degree, margin=margin, eps=0.0)
    torch.testing.assert_close(out, F.triplet_margin_loss(
        a, p, n, margin=margin, p=degree, eps=0.0, swap=False, reduction="none"))
    af, pf, nf = a.float(), p.float(), n.float()
    ref = triplet_reference(af, pf, nf, degree, margin, 1e-6)
    close(triplet_margin_loss(af, pf, nf, norm_degree=degree, margin=margin), ref,
          rtol=1e-5, atol=2e-6)
    # axis=0 on transposed data, and negatives shared by every anchor (broadcast).
    close(triplet_margin_loss(af.T, pf.T, nf.T, axis=0, norm_degree=degree, margin=margin),
          ref, rtol=1e-5, atol=2e-6)
    close(triplet_margin_loss(af, pf, nf[0], norm_degree=degree, margin=margin),
          triplet_reference(af, pf, nf[:1].expand(16, 5), degree, margin, 1e-6),
          rtol=1e-5, atol=2e-6)


def test_triplet_margin_loss_example_gradients_and_vmap():
    anchors = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    positives = torch.tensor([[0.1, 0.1], [1.1, 1.1]])
    negatives = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    expected = math.sqrt(0.02 + 1e-6) - math.sqrt(1 + 1e-6) + 1.0
    torch.testing.assert_close(triplet_margin_loss(anchors, positives, negatives),
                               torch.full((2,), expected))
    gen = fresh_generator()
    a, p, n = (randn(gen, 4, 3, dtype=F64).requires_grad_() for _ in range(3))
    assert torch.autograd.gradcheck(
        lambda x, y, z: triplet_margin_loss(x, y, z, margin=5.0), (a, p, n))
    func_grad_matches_autograd(lambda x: triplet_margin_loss(x, p.detach(), n.detach(),
                                                             margin=5.0), a.detach())
    batched = torch.func.vmap(triplet_margin_loss)(a, p, n)
    torch.testing.assert_close(batched, triplet_margin_loss(a, p, n))


def test_triplet_margin_loss_errors():
    x = torch.ones(4, 3)
    with pytest.raises(ValueError, match=r"triplet_margin_loss: anchors, positives and "
                                         r"negatives must have shapes that broadcast "
                                         r"together, got \(4, 3\), \(4, 3\) and \(2, 3\)"):
        triplet_margin_loss(x, x, torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"triplet_margin_loss: axis must be in \[-2, 2\) "
                                         r".*, got 2"):
        triplet_margin_loss(x, x, x, axis=2)
    with pytest.raises(TypeError, match=r"triplet_margin_loss: axis must be an int, got "
                                        r"\(0, 1\)"):
        triplet_margin_loss(x, x, x, axis=(0, 1))
    with pytest.raises(ValueError, match="triplet_margin_loss: norm_degree must be > 0, got 0"):
        triplet_margin_loss(x, x, x, norm_degree=0)
    with pytest.raises(ValueError, match="triplet_margin_loss: eps must be >= 0, got -1.0"):
        triplet_margin_loss(x, x, x, eps=-1.0)
    with pytest.raises(TypeError, match="triplet_margin_loss: negatives must be a real "
                                        "floating-point tensor, got torch.int64"):
        triplet_margin_loss(x, x, torch.ones(4, 3, dtype=torch.int64))
