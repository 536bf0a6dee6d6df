"""The structured losses (CTC, sparsemax, Fenchel-Young, ranking softmax) against float64
references written from their definitions: torch's own CTC loss and a sum over all
alignments, a bisection projection onto the simplex, softmax cross entropy, and the
ranking softmax formula list by list."""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch
from step_checks import fresh_generator

from ftopt.losses._ctc import ctc_loss, ctc_loss_with_forward_probs
from ftopt.losses._fenchel_young import make_fenchel_young_loss
from ftopt.losses._ranking import ranking_softmax_loss
from ftopt.losses._sparsemax import multiclass_sparsemax_loss, sparsemax_loss

F64 = torch.float64


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-10, atol: float = 1e-10):
    torch.testing.assert_close(a, b.to(a.dtype), rtol=rtol, atol=atol)


# --- CTC -------------------------------------------------------------------------------

def _paddings(lengths: torch.Tensor, size: int) -> torch.Tensor:
    return (torch.arange(size)[None, :] >= lengths[:, None]).to(torch.float32)


def _collapse(path: tuple[int, ...], blank: int) -> tuple[int, ...]:
    out, prev = [], None
    for c in path:
        if c != prev and c != blank:
            out.append(c)
        prev = c
    return tuple(out)


def _feasible_batch(gen, batch, frames, classes, max_labels, blank):
    """Random CTC inputs whose labels (no blank) fit their frames, repeats included."""
    non_blank = [c for c in range(classes) if c != blank]
    frame_len = torch.randint(1, frames + 1, (batch,), generator=gen)
    frame_len[0] = frames
    labels = torch.randint(0, classes, (batch, max_labels), generator=gen)  # pads: any
    label_len = torch.zeros(batch, dtype=torch.long)
    for b in range(batch):
        length = int(torch.randint(0, max_labels + 1, (), generator=gen))
        while True:
            row = [non_blank[int(i)] for i in
                   torch.randint(0, len(non_blank), (length,), generator=gen)]
            repeats = sum(x == y for x, y in zip(row, row[1:]))
            if length + repeats <= frame_len[b]:
                break
            length -= 1
        labels[b, :length] = torch.tensor(row, dtype=torch.long)
        label_len[b] = length
    return frame_len, labels, label_len


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_ctc_matches_torch_ctc_loss(dtype):
    gen = fresh_generator()
    batch, frames, classes, max_labels = 5, 12, 6, 5
    blank = int(torch.randint(0, classes, (), generator=gen))
    frame_len, labels, label_len = _feasible_batch(gen, batch, frames, classes,
                                                   max_labels, blank)
    logits = (2 * torch.randn(batch, frames, classes, generator=gen)).to(dtype)
    logits.requires_grad_(True)
    loss = ctc_loss(logits, _paddings(frame_len, frames), labels,
                    _paddings(label_len, max_labels), blank_id=blank)
    grad, = torch.autograd.grad(loss.sum(), logits)

    ref_logits = logits.detach().to(F64).requires_grad_(True)
    ref = torch.nn.functional.ctc_loss(
        ref_logits.log_softmax(-1).transpose(0, 1), labels, frame_len, label_len,
        blank=blank, reduction="none")
    ref_grad, = torch.autograd.grad(ref.sum(), ref_logits)
    tol = 1e-10 if dtype == F64 else 2e-5
    assert loss.dtype == dtype and loss.shape == (batch,)
    close(loss, ref, rtol=tol, atol=tol)
    close(grad, ref_grad, rtol=tol, atol=tol)


def test_ctc_sums_over_all_alignments_and_forward_probs():
    """Loss and both forward variables against sums over every alignment prefix."""
    gen = fresh_generator()
    batch, frames, classes, max_labels = 4, 5, 3, 3
    blank = int(torch.randint(0, classes, (), generator=gen))
    non_blank = torch.tensor([c for c in range(classes) if c != blank])
    # Labels from two classes: repeats are common; some pairs cannot be aligned.
    labels = non_blank[torch.randint(0, 2, (batch, max_labels), generator=gen)]
    frame_len = torch.randint(1, frames + 1, (batch,), generator=gen)
    label_len = torch.randint(0, max_labels + 1, (batch,), generator=gen)
    logits = torch.randn(batch, frames, classes, generator=gen, dtype=F64)
    loss, log_blank, log_label = ctc_loss_with_forward_probs(
        logits, _paddings(frame_len, frames), labels, _paddings(label_len, max_labels),
        blank_id=blank)
    assert log_blank.shape == (frames, batch, max_labels + 1)
    assert log_label.shape == (frames, batch, max_labels)

    probs = logits.softmax(-1).tolist()
    for b in range(batch):
        y = tuple(labels[b].tolist())
        n_frames = int(frame_len[b])
        by_length = {}  # prefix length -> list of (probability, collapse, last class)
        for length in range(1, n_frames + 1):
            by_length[length] = [
                (math.prod(probs[b][s][c] for s, c in enumerate(path)),
                 _collapse(path, blank), path[-1])
                for path in itertools.product(range(classes), repeat=length)]
        total = sum(p for p, col, _ in by_length[n_frames] if col == y[:int(label_len[b])])
        if total > 0:
            close(loss[b], torch.tensor(-math.log(total), dtype=F64), rtol=1e-9)
        else:  # infeasible: a loss of the order of -log_epsilon
            assert loss[b] > 1e4
        for t in range(frames):
            paths = by_length[min(t + 1, n_frames)]
            last_row = t == frames - 1
            want_blank = [sum(p for p, col, last in paths
                              if col == y[:n] and (last_row or last == blank))
                          for n in range(max_labels + 1)]
            want_label = [sum(p for p, col, last in paths
                              if col == y[:n + 1] and last != blank)
                          for n in range(max_labels)]
            close(log_blank[t, b].exp(), torch.tensor(want_blank, dtype=F64), atol=1e-12)
            close(log_label[t, b].exp(), torch.tensor(want_label, dtype=F64), atol=1e-12)


def test_ctc_repeats_with_one_to_one_alignment():
    """optax's case: frames just enough for the labels, so one alignment is left."""
    gen = fresh_generator()
    labels = torch.tensor([[1, 2, 2, 3], [2, 3, 4, 4], [1, 1, 1, 1], [1, 1, 2, 3],
                           [1, 1, 1, 2]])
    alignments = [[1, 2, 0, 2, 3], [2, 3, 4, 0, 4], [1, 0, 1, 0, 1, 0, 1],
                  [1, 0, 1, 2, 3], [1, 0, 1, 0, 1, 2]]
    labels = torch.nn.functional.pad(labels, (0, 2))
    frame_len = torch.tensor([len(a) for a in alignments])
    logits = torch.randn(5, 7, 5, generator=gen, dtype=F64)
    loss = ctc_loss(logits, _paddings(frame_len, 7), labels,
                    _paddings(torch.full((5,), 4), 6))
    logp = logits.log_softmax(-1)
    want = torch.stack([-sum(logp[b, t, k] for t, k in enumerate(a))
                        for b, a in enumerate(alignments)])
    close(loss, want, rtol=1e-9)


def test_ctc_edge_lengths():
    """No label: every frame blank. No frame: loss 0 for no label, about -log_epsilon
    otherwise."""
    gen = fresh_generator()
    logits = torch.randn(3, 4, 3, generator=gen, dtype=F64)
    labels = torch.randint(1, 3, (3, 2), generator=gen)
    frame_pad = _paddings(torch.tensor([4, 0, 0]), 4)
    label_pad = _paddings(torch.tensor([0, 0, 2]), 2)
    loss = ctc_loss(logits, frame_pad, labels, label_pad, log_epsilon=-1e4)
    close(loss[0], -logits[0].log_softmax(-1)[:, 0].sum())
    assert loss[1] == 0
    assert 0.9e4 < loss[2] < 2.1e4
    empty = ctc_loss(logits, frame_pad[:, :4], labels[:, :0], label_pad[:, :0])
    close(empty[0], loss[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ctc_low_precision_runs_in_float32(dtype):
    gen = fresh_generator()
    frame_len, labels, label_len = _feasible_batch(gen, 3, 6, 4, 3, 0)
    logits = torch.randn(3, 6, 4, generator=gen).to(dtype)
    args = (_paddings(frame_len, 6), labels, _paddings(label_len, 3))
    loss, log_blank, log_label = ctc_loss_with_forward_probs(logits, *args)
    assert loss.dtype == log_blank.dtype == log_label.dtype == torch.float32
    close(loss, ctc_loss(logits.to(F64), *args), rtol=1e-5, atol=1e-5)


def test_ctc_gradients_and_vmap():
    gen = fresh_generator()
    frame_len, labels, label_len = _feasible_batch(gen, 2, 4, 3, 2, 0)
    frame_pad, label_pad = _paddings(frame_len, 4), _paddings(label_len, 2)
    logits = torch.randn(2, 4, 3, generator=gen, dtype=F64, requires_grad=True)
    f = lambda x: ctc_loss(x, frame_pad, labels, label_pad)
    assert torch.autograd.gradcheck(f, (logits,))
    autograd, = torch.autograd.grad(f(logits).sum(), logits)
    close(torch.func.grad(lambda x: f(x).sum())(logits.detach()), autograd)

    stack = torch.randn(3, 2, 4, 3, generator=gen, dtype=F64)
    frame_pads = (torch.rand(3, 2, 4, generator=gen) < 0.3).to(F64)
    label_pads = torch.stack([label_pad] * 3)
    labels3 = torch.randint(1, 3, (3, 2, 2), generator=gen)
    batched = torch.func.vmap(ctc_loss_with_forward_probs)(stack, frame_pads, labels3,
                                                           label_pads)
    for i in range(3):
        one = ctc_loss_with_forward_probs(stack[i], frame_pads[i], labels3[i],
                                          label_pads[i])
        for got, want in zip(batched, one):
            close(got[i], want, rtol=0, atol=0)


@pytest.mark.parametrize("change, error, match", [
    (dict(logits=[[[0.0]]]), TypeError, "ctc_loss: logits must be a torch.Tensor, got list"),
    (dict(logits=torch.zeros(2, 3, 4, dtype=torch.long)), TypeError,
     "ctc_loss: logits must be a real floating-point tensor, got torch.int64"),
    (dict(logits=torch.zeros(2, 3)), ValueError,
     r"ctc_loss: logits must have shape \(B, T, K\), got \(2, 3\)"),
    (dict(labels=torch.zeros(2, 2)), TypeError,
     "ctc_loss: labels must be a tensor of integer class labels"),
    (dict(labels=torch.zeros(2, dtype=torch.long)), ValueError,
     r"ctc_loss: labels must have shape \(B, N\), got \(2,\)"),
    (dict(logit_paddings=torch.zeros(2, 4)), ValueError,
     r"ctc_loss: logit_paddings must have shape \(2, 3\) .*, got \(2, 4\)"),
    (dict(labels=torch.zeros(3, 2, dtype=torch.long)), ValueError,
     "ctc_loss: labels must have batch size 2 .*, got 3"),
    (dict(label_paddings=torch.zeros(2, 3)), ValueError,
     r"ctc_loss: label_paddings must have shape \(2, 2\) .*, got \(2, 3\)"),
    (dict(logits=torch.zeros(2, 0, 4), logit_paddings=torch.zeros(2, 0)), ValueError,
     "ctc_loss: logits must have at least one frame"),
    (dict(blank_id=4), ValueError, r"ctc_loss: blank_id must be in \[0, 4\) .*, got 4"),
    (dict(blank_id=1.0), TypeError, "ctc_loss: blank_id must be an int, got float"),
    (dict(log_epsilon=0.5), ValueError, "ctc_loss: log_epsilon must be < 0, got 0.5"),
    (dict(log_epsilon="x"), TypeError,
     "ctc_loss: log_epsilon must be a real number or a tensor, got str"),
    (dict(log_epsilon=torch.zeros(2)), ValueError,
     r"ctc_loss: log_epsilon must be a number or a 0-d floating-point tensor, got shape "
     r"\(2,\)"),
])
def test_ctc_errors(change, error, match):
    gen = fresh_generator()
    args = dict(logits=torch.randn(2, 3, 4, generator=gen), logit_paddings=torch.zeros(2, 3),
                labels=torch.ones(2, 2, dtype=torch.long), label_paddings=torch.zeros(2, 2))
    args.update(change)
    with pytest.raises(error, match=match):
        ctc_loss(**args)


# --- sparsemax -------------------------------------------------------------------------

def _simplex_bisection(z: torch.Tensor) -> torch.Tensor:
    """Projection of each row onto the simplex, max(z - tau, 0) with tau the root of
    sum(max(z - tau, 0)) = 1, found by bisection in float64."""
    z = z.to(F64)
    lo = z.min(-1, keepdim=True).values - 1
    hi = z.max(-1, keepdim=True).values
    for _ in range(200):
        mid = (lo + hi) / 2
        above = (z - mid).clamp_min(0).sum(-1, keepdim=True) > 1
        lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
    return (z - (lo + hi) / 2).clamp_min(0)


def _multiclass_reference(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    p = _simplex_bisection(z)
    z = z.to(F64)
    z_y = z.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return (p * z).sum(-1) + 0.5 * (1 - p.square().sum(-1)) - z_y


def _sparse_plus(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x <= -1, 0.0, torch.where(x >= 1, x, (x + 1) ** 2 / 4))


@pytest.mark.parametrize("lead", [(), (6,), (2, 3)])
def test_multiclass_sparsemax_loss_value_and_gradient(lead):
    gen = fresh_generator()
    classes = int(torch.randint(2, 8, (), generator=gen))
    scores = torch.randn(*lead, classes, generator=gen, dtype=F64, requires_grad=True)
    labels = torch.randint(0, classes, lead, generator=gen)
    loss = multiclass_sparsemax_loss(scores, labels)
    assert loss.shape == lead
    close(loss, _multiclass_reference(scores.detach(), labels))
    assert (loss >= -1e-12).all()
    grad, = torch.autograd.grad(loss.sum(), scores)
    one_hot = torch.nn.functional.one_hot(labels, classes).to(F64)
    close(grad, _simplex_bisection(scores.detach()) - one_hot)
    close(torch.func.grad(lambda s: multiclass_sparsemax_loss(s, labels).sum())(
        scores.detach()), grad)
    f32 = multiclass_sparsemax_loss(scores.detach().float(), labels)
    close(f32, loss, rtol=1e-5, atol=1e-5)


def test_multiclass_sparsemax_loss_zero_gradcheck_and_vmap():
    gen = fresh_generator()
    scores = torch.randn(5, 4, generator=gen, dtype=F64)
    labels = torch.randint(0, 4, (5,), generator=gen)
    confident = scores + 2 * torch.nn.functional.one_hot(labels, 4) * (
        scores.abs().max() + 1)
    assert (multiclass_sparsemax_loss(confident, labels) == 0).all()
    assert torch.autograd.gradcheck(lambda s: multiclass_sparsemax_loss(s, labels),
                                    (scores.requires_grad_(True),))
    stack = torch.randn(3, 5, 4, generator=gen)
    ys = torch.randint(0, 4, (3, 5), generator=gen)
    batched = torch.func.vmap(multiclass_sparsemax_loss)(stack, ys)
    for i in range(3):
        close(batched[i], multiclass_sparsemax_loss(stack[i], ys[i]), rtol=0, atol=0)
    assert multiclass_sparsemax_loss(torch.zeros(0, 3), ys[0, :0]).shape == (0,)


def test_binary_sparsemax_loss():
    gen = fresh_generator()
    logits = 3 * torch.randn(7, 5, generator=gen, dtype=F64)
    labels = torch.randint(0, 2, (7, 5), generator=gen)
    loss = sparsemax_loss(logits, labels)
    close(loss, _sparse_plus(torch.where(labels == 1, -logits, logits)))
    # The binary loss is the two-class sparsemax loss of the scores (z, 0).
    pair = torch.stack([logits, torch.zeros_like(logits)], -1)
    close(loss, multiclass_sparsemax_loss(pair, 1 - labels))
    close(sparsemax_loss(logits, labels.bool()), loss, rtol=0, atol=0)
    close(sparsemax_loss(logits, labels.to(F64)), loss, rtol=0, atol=0)
    close(sparsemax_loss(logits, labels[0]), _sparse_plus(
        torch.where(labels[0] == 1, -logits, logits)))
    close(sparsemax_loss(torch.tensor(10.0), torch.tensor(1)), torch.tensor(0.0))
    close(sparsemax_loss(torch.tensor([10.0, 20.0]), torch.tensor([1, 0])),
          torch.tensor([0.0, 20.0]))
    x = logits[0].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda v: sparsemax_loss(v, labels[0]), (x,))


@pytest.mark.parametrize("call, error, match", [
    (lambda: sparsemax_loss(torch.zeros(3, dtype=torch.long), torch.zeros(3)), TypeError,
     "sparsemax_loss: logits must be a real floating-point tensor, got torch.int64"),
    (lambda: sparsemax_loss(torch.zeros(3), [0, 1, 0]), TypeError,
     "sparsemax_loss: labels must be a torch.Tensor, got list"),
    (lambda: sparsemax_loss(torch.zeros(3), torch.zeros(2)), ValueError,
     r"sparsemax_loss: logits and labels must have shapes that broadcast together, got "
     r"\(3,\) and \(2,\)"),
    (lambda: multiclass_sparsemax_loss(torch.zeros(3, 4), torch.zeros(3)), TypeError,
     "multiclass_sparsemax_loss: labels must be a tensor of integer class labels"),
    (lambda: multiclass_sparsemax_loss(torch.zeros(3, 4), torch.zeros(4, dtype=torch.long)),
     ValueError, r"multiclass_sparsemax_loss: labels must have shape \(3,\) .*, got \(4,\)"),
    (lambda: multiclass_sparsemax_loss(torch.tensor(1.0), torch.tensor(0)), ValueError,
     r"multiclass_sparsemax_loss: scores must have shape \(\.\.\., K\) with K >= 1, "
     r"got \(\)"),
    (lambda: multiclass_sparsemax_loss([[1.0]], torch.tensor([0])), TypeError,
     "multiclass_sparsemax_loss: scores must be a torch.Tensor, got list"),
])
def test_sparsemax_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --- Fenchel-Young ---------------------------------------------------------------------

def _logsumexp(v: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(v, -1)


def test_fenchel_young_logsumexp_is_softmax_cross_entropy():
    gen = fresh_generator()
    fy = make_fenchel_young_loss(_logsumexp)
    scores = torch.randn(4, 3, 6, generator=gen, dtype=F64, requires_grad=True)
    targets = torch.randn(4, 3, 6, generator=gen, dtype=F64).softmax(-1)
    loss = fy(scores, targets)
    z = scores.detach()
    top = z.max(-1, keepdim=True).values
    log_softmax = z - top - (z - top).exp().sum(-1, keepdim=True).log()
    close(loss, -(targets * log_softmax).sum(-1))
    labels = torch.randint(0, 6, (4, 3), generator=gen)
    one_hot = torch.nn.functional.one_hot(labels, 6).to(F64)
    close(fy(z, one_hot), -log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1))

    grad, = torch.autograd.grad(loss.sum(), scores)
    close(grad, log_softmax.exp() - targets)
    close(torch.func.grad(lambda s: fy(s, targets).sum())(z), grad)
    targets_grad = torch.func.grad(lambda t: fy(z, t).sum())(targets)
    close(targets_grad, -z)
    batched = torch.func.vmap(fy)(z, targets)
    for i in range(4):
        close(batched[i], fy(z[i], targets[i]), rtol=1e-14, atol=1e-14)
    x = z[0].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda s: fy(s, targets[0]), (x,))
    assert torch.autograd.gradgradcheck(lambda s: fy(s, targets[0]), (x,))


def test_fenchel_young_args_broadcast_and_sparsemax():
    gen = fresh_generator()
    smooth = make_fenchel_young_loss(lambda v, t, *, shift=0.0: t * _logsumexp(v / t) + shift)
    scores = torch.randn(3, 5, generator=gen, dtype=F64)
    target = torch.randn(5, generator=gen, dtype=F64).softmax(-1)
    got = smooth(scores, target, 0.5, shift=2.0)
    assert got.shape == (3,)
    close(got, 0.5 * torch.logsumexp(scores / 0.5, -1) + 2.0 - scores @ target)
    grad = torch.func.grad(lambda s: smooth(s, target, 0.5).sum())(scores)
    close(grad, (scores / 0.5).softmax(-1) - target)

    # With the Gini max function the loss is the multiclass sparsemax loss, and its
    # gradient sparsemax(scores) - targets.
    def gini_max(v: torch.Tensor) -> torch.Tensor:
        p = multiclass_sparsemax_proba(v)
        return (p * v).sum() + 0.5 * (1 - p.square().sum())

    fy = make_fenchel_young_loss(gini_max)
    labels = torch.randint(0, 5, (3,), generator=gen)
    one_hot = torch.nn.functional.one_hot(labels, 5).to(F64)
    close(fy(scores, one_hot), _multiclass_reference(scores, labels))
    grad = torch.func.grad(lambda s: fy(s, one_hot).sum())(scores)
    close(grad, _simplex_bisection(scores) - one_hot)


def multiclass_sparsemax_proba(v: torch.Tensor) -> torch.Tensor:
    """Sparsemax of a vector, through the loss's gradient (loss gradient + one-hot)."""
    label = torch.zeros((), dtype=torch.long)
    grad = torch.func.grad(multiclass_sparsemax_loss)(v, label)
    return grad + torch.nn.functional.one_hot(label, v.shape[-1]).to(v.dtype)


@pytest.mark.parametrize("call, error, match", [
    (lambda fy: make_fenchel_young_loss(3), TypeError,
     "make_fenchel_young_loss: max_fun must be a callable, got int"),
    (lambda fy: fy([1.0], torch.zeros(1)), TypeError,
     "fenchel_young_loss: scores must be a torch.Tensor, got list"),
    (lambda fy: fy(torch.zeros(3), torch.zeros(3, dtype=torch.long)), TypeError,
     "fenchel_young_loss: targets must be a real floating-point tensor, got torch.int64"),
    (lambda fy: fy(torch.tensor(1.0), torch.zeros(1)), ValueError,
     "fenchel_young_loss: scores must have at least one axis"),
    (lambda fy: fy(torch.zeros(2, 3), torch.zeros(2, 4)), ValueError,
     r"fenchel_young_loss: targets must have a last axis of size 3 .*, got shape \(2, 4\)"),
    (lambda fy: fy(torch.zeros(2, 3), torch.zeros(4, 3)), ValueError,
     r"fenchel_young_loss: scores' leading axes and targets' leading axes must have shapes "
     r"that broadcast together, got \(2,\) and \(4,\)"),
    (lambda fy: make_fenchel_young_loss(lambda v: v)(torch.zeros(2, 3), torch.zeros(3)),
     ValueError, r"fenchel_young_loss: max_fun must return a 0-d tensor .* got shape \(3,\)"),
])
def test_fenchel_young_errors(call, error, match):
    with pytest.raises(error, match=match):
        call(make_fenchel_young_loss(_logsumexp))


# --- ranking softmax -------------------------------------------------------------------

def _ranking_reference(s, y, where=None, weights=None, reduce="mean"):
    """The loss list by list in float64: over the valid items i of a list,
    -sum_i w_i y_i log(exp(s_i) / sum_j exp(s_j))."""
    s, y = s.to(F64), y.to(F64)
    where = torch.ones_like(s, dtype=torch.bool) if where is None else where
    weights = torch.ones_like(s) if weights is None else weights.to(F64)
    lead = s.shape[:-1]
    losses, counted = [], []
    for idx in itertools.product(*map(range, lead)):
        keep = where[idx]
        if not keep.any():
            losses.append(0.0)
            counted.append(False)
            continue
        si = s[idx][keep].tolist()
        norm = math.log(sum(math.exp(v - max(si)) for v in si)) + max(si)
        terms = [w * t * (v - norm) for v, t, w in
                 zip(si, y[idx][keep].tolist(), weights[idx][keep].tolist())]
        losses.append(-sum(terms))
        counted.append(True)
    per_list = torch.tensor(losses, dtype=F64).reshape(lead)
    if reduce is None:
        return per_list
    total = sum(v for v, c in zip(losses, counted) if c)
    return torch.tensor(total / max(sum(counted), 1) if reduce == "mean" else total,
                        dtype=F64)


def test_ranking_softmax_loss_hand_values():
    """Values from optax's docstring and tests, which are worked by hand."""
    scores = torch.tensor([2.0, 1.0, 3.0], requires_grad=True)
    loss = ranking_softmax_loss(scores, torch.tensor([1.0, 0.0, 0.0]))
    assert f"{loss:.3f}" == "1.408"
    grad, = torch.autograd.grad(loss, scores)
    assert [round(float(g), 3) for g in grad] == [-0.755, 0.09, 0.665]
    loss = ranking_softmax_loss(torch.tensor([[2.0, 1.0, 0.0], [1.0, 0.5, 1.5]]),
                                torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]),
                                where=torch.tensor([[True, True, False], [True] * 3]))
    assert f"{loss:.3f}" == "0.497"
    exp, log = math.exp, math.log
    loss = ranking_softmax_loss(torch.tensor([0.0, -2.1e26, 3.4e37, 42.0]),
                                torch.tensor([0.0, 1.0, 1.0, 0.0]), reduce_fn=torch.sum)
    close(loss, torch.tensor(-((-2.1e26 - (-2.1e26 + 3.4e37 + 42.0)) + (3.4e37 - (
        -2.1e26 + 3.4e37 + 42.0)))), rtol=1e-3, atol=0)
    loss = ranking_softmax_loss(torch.tensor([0.0, 3.0, 2.0, 1.0]),
                                torch.tensor([0.0, 0.0, 1.0, 1.0]),
                                weights=torch.tensor([1.0, 1.0, 2.0, 1.0]),
                                reduce_fn=torch.sum)
    norm = exp(0.0) + exp(3.0) + exp(1.0) + exp(2.0)
    close(loss, torch.tensor(-(2 * log(exp(2.0) / norm) + log(exp(1.0) / norm))),
          rtol=1e-5, atol=0)


@pytest.mark.parametrize("lead", [(), (5,), (2, 4)])
def test_ranking_softmax_loss_against_definition(lead):
    gen = fresh_generator()
    size = 6
    scores = torch.randn(*lead, size, generator=gen, dtype=F64, requires_grad=True)
    labels = torch.randint(0, 3, (*lead, size), generator=gen).to(F64)
    labels[(0,) * len(lead)] = 0  # a list with no relevant item
    weights = torch.rand(*lead, size, generator=gen, dtype=F64) + 0.5
    where = torch.rand(*lead, size, generator=gen) < 0.7
    if lead:
        where[(1,) * len(lead)] = False  # a list with no valid item
    for kwargs in (dict(), dict(where=where), dict(weights=weights),
                   dict(where=where, weights=weights)):
        for fn, name in ((torch.mean, "mean"), (torch.sum, "sum"), (None, None)):
            got = ranking_softmax_loss(scores, labels, reduce_fn=fn, **kwargs)
            close(got, _ranking_reference(scores.detach(), labels, reduce=name, **kwargs))
        loss = ranking_softmax_loss(scores, labels, reduce_fn=torch.sum, **kwargs)
        grad, = torch.autograd.grad(loss, scores)
        # d/ds_i = (sum_k w_k y_k) softmax_i - w_i y_i over the valid items, else 0.
        mask = kwargs.get("where", torch.ones_like(labels, dtype=torch.bool))
        wy = torch.where(mask, labels * kwargs.get("weights", 1.0), 0.0)
        soft = torch.where(mask, scores.detach(), -math.inf).softmax(-1).nan_to_num(0.0)
        close(grad, wy.sum(-1, keepdim=True) * soft - wy)
        func = torch.func.grad(
            lambda s, kw=kwargs: ranking_softmax_loss(s, labels, reduce_fn=torch.sum, **kw))
        close(func(scores.detach()), grad)


def test_ranking_softmax_loss_masking_edges_and_vmap():
    gen = fresh_generator()
    scores = torch.randn(4, 5, generator=gen, requires_grad=True)
    labels = torch.rand(4, 5, generator=gen)
    nothing = torch.zeros(4, 5, dtype=torch.bool)
    loss = ranking_softmax_loss(scores, labels, where=nothing)
    grad, = torch.autograd.grad(loss, scores)
    assert loss == 0 and (grad == 0).all()
    per_list = ranking_softmax_loss(scores, labels, where=nothing, reduce_fn=None)
    assert per_list.shape == (4,) and (per_list == 0).all()
    custom = ranking_softmax_loss(scores, labels, reduce_fn=lambda v: v.max())
    close(custom, ranking_softmax_loss(scores, labels, reduce_fn=None).max(), rtol=0, atol=0)
    x = scores.detach().to(F64).requires_grad_(True)
    where = torch.rand(4, 5, generator=gen) < 0.6
    assert torch.autograd.gradcheck(
        lambda s: ranking_softmax_loss(s, labels.to(F64), where=where), (x,))

    stack = torch.randn(3, 4, 5, generator=gen)
    ys = torch.rand(3, 4, 5, generator=gen)
    wheres = torch.rand(3, 4, 5, generator=gen) < 0.5
    f = functools.partial(ranking_softmax_loss, reduce_fn=torch.mean)
    batched = torch.func.vmap(lambda s, y, w: f(s, y, where=w))(stack, ys, wheres)
    for i in range(3):
        close(batched[i], f(stack[i], ys[i], where=wheres[i]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("change, error, match", [
    (dict(logits=[1.0, 2.0]), TypeError,
     "ranking_softmax_loss: logits must be a torch.Tensor, got list"),
    (dict(logits=torch.zeros(3, dtype=torch.long)), TypeError,
     "ranking_softmax_loss: logits must be a real floating-point tensor, got torch.int64"),
    (dict(logits=torch.tensor(1.0)), ValueError,
     r"ranking_softmax_loss: logits must have shape \[\.\.\., list_size\], got a 0-d"),
    (dict(labels=torch.zeros(4)), ValueError,
     r"ranking_softmax_loss: labels must have a shape that broadcasts to logits' shape "
     r"\(3,\), got \(4,\)"),
    (dict(labels=[1.0, 0.0, 0.0]), TypeError,
     "ranking_softmax_loss: labels must be a torch.Tensor, got list"),
    (dict(where=torch.ones(3)), TypeError,
     "ranking_softmax_loss: where must be a bool tensor, got torch.float32"),
    (dict(where=torch.ones(2, dtype=torch.bool)), ValueError,
     r"ranking_softmax_loss: where must have a shape that broadcasts to logits' shape "
     r"\(3,\), got \(2,\)"),
    (dict(weights=torch.ones(5)), ValueError,
     r"ranking_softmax_loss: weights must have a shape that broadcasts to logits' shape "
     r"\(3,\), got \(5,\)"),
    (dict(reduce_fn="mean"), TypeError,
     "ranking_softmax_loss: reduce_fn must be torch.mean, torch.sum, None or a callable"),
])
def test_ranking_errors(change, error, match):
    args = dict(logits=torch.randn(3, generator=fresh_generator()),
                labels=torch.tensor([1.0, 0.0, 0.0]))
    args.update(change)
    with pytest.raises(error, match=match):
        ranking_softmax_loss(**args)
