r"""Connectionist temporal classification (CTC) loss (optax's ``ctc_loss`` and
``ctc_loss_with_forward_probs``), for torch tensors.

The CTC loss of a frame sequence and a label sequence :math:`y_{1:L}` is
:math:`-\log \sum_\pi \prod_t p_t(\pi_t)`, the sum over every alignment :math:`\pi`
(one class per unpadded frame) that collapses to :math:`y`: merge runs of equal
classes, then drop the blank. :math:`p_t` is ``softmax(logits[b, t])``.

Conventions (optax's):

* ``logits`` is ``(B, T, K)``, ``labels`` ``(B, N)``; paddings are ``(B, T)`` and
  ``(B, N)`` with 1.0 marking a padded frame or label; labels are right-padded. An
  element counts as padded where it is nonzero (``bool`` paddings work too); the values
  are not read on the host, so the functions run under ``torch.func`` transforms.
* The loss is computed in log space with the dynamic program of Graves et al. (2006).
  ``log_epsilon`` stands for :math:`\log 0`: it is *added* to the log-probability of a
  forbidden transition, so an infeasible pair (more labels and repeats than frames) gets
  a loss of the order of ``-log_epsilon`` rather than ``inf``.
* The computation runs in ``logits``' dtype promoted to at least float32 (16-bit floats
  cannot hold ``log_epsilon = -1e5``); the outputs have that dtype.
* Labels are not range-checked on the host (that would read a tensor's value): a label
  outside ``[0, K)`` makes torch's indexing raise.
"""

from __future__ import annotations

import numbers

import torch

from ftopt.losses import _checks as check

__all__ = ["ctc_loss", "ctc_loss_with_forward_probs"]


def _check_inputs(fn: str, logits: torch.Tensor, logit_paddings: torch.Tensor,
                  labels: torch.Tensor, label_paddings: torch.Tensor, blank_id: int,
                  log_epsilon: float | torch.Tensor) -> None:
    named = {"logits": logits, "logit_paddings": logit_paddings, "labels": labels,
             "label_paddings": label_paddings}
    for name, x in named.items():
        check.tensor(fn, name, x)
    check.floating(fn, "logits", logits)
    if logits.dim() != 3:
        raise ValueError(f"{fn}: logits must have shape (B, T, K), got "
                         f"{tuple(logits.shape)}")
    check.integer(fn, "labels", labels)
    if labels.dim() != 2:
        raise ValueError(f"{fn}: labels must have shape (B, N), got {tuple(labels.shape)}")
    for name in ("logit_paddings", "label_paddings"):
        check.real(fn, name, named[name])
    batch, frames, classes = logits.shape
    if tuple(logit_paddings.shape) != (batch, frames):
        raise ValueError(f"{fn}: logit_paddings must have shape {(batch, frames)} "
                         f"(logits' first two), got {tuple(logit_paddings.shape)}")
    if labels.shape[0] != batch:
        raise ValueError(f"{fn}: labels must have batch size {batch} (logits'), "
                         f"got {labels.shape[0]}")
    if label_paddings.shape != labels.shape:
        raise ValueError(f"{fn}: label_paddings must have shape {tuple(labels.shape)} "
                         f"(labels'), got {tuple(label_paddings.shape)}")
    if frames == 0:
        raise ValueError(f"{fn}: logits must have at least one frame (T >= 1), got T = 0")
    if not isinstance(blank_id, numbers.Integral) or isinstance(blank_id, bool):
        raise TypeError(f"{fn}: blank_id must be an int, got {type(blank_id).__name__}")
    if not 0 <= blank_id < classes:
        raise ValueError(f"{fn}: blank_id must be in [0, {classes}) (the classes), "
                         f"got {blank_id}")
    if isinstance(log_epsilon, torch.Tensor) and (log_epsilon.dim() != 0
                                                  or not log_epsilon.is_floating_point()):
        raise ValueError(f"{fn}: log_epsilon must be a number or a 0-d floating-point "
                         f"tensor, got shape {tuple(log_epsilon.shape)} {log_epsilon.dtype}")
    check.number(fn, "log_epsilon", log_epsilon, "< 0")


def _add_after_first(phi: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """``phi`` with ``phi[:, n + 1]`` replaced by ``logaddexp(phi[:, n + 1], extra[:, n])``."""
    return torch.cat([phi[:, :1], torch.logaddexp(phi[:, 1:], extra)], dim=1)


def ctc_loss_with_forward_probs(
    logits: torch.Tensor,
    logit_paddings: torch.Tensor,
    labels: torch.Tensor,
    label_paddings: torch.Tensor,
    *,
    blank_id: int = 0,
    log_epsilon: float | torch.Tensor = -1e5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""CTC loss per sequence and the forward log-probabilities of its dynamic program.

    With :math:`\phi` the blank, the forward variables after frame :math:`t` are

    * :math:`\alpha_\phi(t, n)`: the probability of the frames :math:`1..t` emitting
      :math:`y_{1:n}` (collapsed) and frame :math:`t` being a blank, for
      :math:`n = 0..N`;
    * :math:`\alpha_y(t, n)`: the probability of them emitting :math:`y_{1:n+1}` with
      frame :math:`t` emitting :math:`y_{n+1}`, for :math:`n = 0..N-1`.

    A padded frame leaves both unchanged. In the last row, :math:`\alpha_\phi(T, n)`
    also counts the paths ending in the label :math:`y_n`, so that the loss is
    :math:`-\log \alpha_\phi(T, L_b)` with :math:`L_b` the number of unpadded labels.

    Args:
        logits: ``(B, T, K)`` unnormalised scores of the ``K`` classes (blank
            included) per frame; ``log_softmax`` is applied over ``K``.
        logit_paddings: ``(B, T)``, 1.0 where the frame is padding, else 0.0.
        labels: ``(B, N)`` integer labels in ``[0, K)``, right-padded.
        label_paddings: ``(B, N)``, 1.0 where the label is padding, else 0.0.
        blank_id: the class of the blank.
        log_epsilon: the finite stand-in for :math:`\log 0` (a number < 0, or a 0-d
            tensor, which is differentiated).

    Returns:
        ``(loss, logalpha_blank, logalpha_label)``: the ``(B,)`` loss, and the
        ``(T, B, N + 1)`` :math:`\log\alpha_\phi` and ``(T, B, N)`` :math:`\log\alpha_y`
        (time first, as optax's).
    """
    return _ctc("ctc_loss_with_forward_probs", logits, logit_paddings, labels,
                label_paddings, blank_id, log_epsilon)


def _ctc(fn: str, logits: torch.Tensor, logit_paddings: torch.Tensor, labels: torch.Tensor,
         label_paddings: torch.Tensor, blank_id: int, log_epsilon: float | torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`ctc_loss_with_forward_probs`, its errors naming ``fn``."""
    _check_inputs(fn, logits, logit_paddings, labels, label_paddings, blank_id, log_epsilon)
    batch, frames, _ = logits.shape
    num_labels = labels.shape[1]
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logprobs = torch.log_softmax(logits.to(dtype), dim=-1)
    if isinstance(log_epsilon, torch.Tensor):
        eps = log_epsilon.to(device=logits.device, dtype=dtype)
    else:
        eps = torch.scalar_tensor(log_epsilon, dtype=dtype, device=logits.device)

    index = labels.long()
    frame_padded = logit_paddings != 0
    label_len = num_labels - (label_paddings != 0).sum(dim=1)
    # repeat[b, n]: label n is followed by an equal label, so a blank must separate them.
    repeat = torch.cat([index[:, 1:] == index[:, :-1],
                        torch.zeros_like(index[:, :min(num_labels, 1)], dtype=torch.bool)],
                       dim=1)
    # Log-penalties: a label may hand over to the next label's state only when it is not
    # repeated; the explicit label -> blank step is taken only when it is (otherwise the
    # hand-over followed by a blank self-loop already counts that path).
    no_handover = eps * repeat.to(dtype)
    no_blank_step = eps * (~repeat).to(dtype)
    label_lp = logprobs.gather(2, index.unsqueeze(1).expand(-1, frames, -1))  # (B, T, N)
    blank_lp = logprobs[:, :, blank_id : blank_id + 1]  # (B, T, 1)

    zeros = torch.zeros(batch, num_labels, dtype=dtype, device=logits.device)
    phi = torch.cat([zeros.new_zeros(batch, 1), zeros + eps], dim=1)
    emit = zeros + eps
    phis, emits = [], []
    for t in range(frames):
        ready = _add_after_first(phi, emit + no_handover)
        new_emit = torch.logaddexp(ready[:, :-1], emit) + label_lp[:, t]
        new_phi = _add_after_first(ready + blank_lp[:, t],
                                   emit + blank_lp[:, t] + no_blank_step)
        keep = frame_padded[:, t : t + 1]
        phi = torch.where(keep, phi, new_phi)
        emit = torch.where(keep, emit, new_emit)
        phis.append(phi)
        emits.append(emit)
    # After the last frame, a path may also end on its last label.
    phis[-1] = _add_after_first(phis[-1], emits[-1])
    loss = -phis[-1].gather(1, label_len.unsqueeze(1)).squeeze(1)
    return loss, torch.stack(phis), torch.stack(emits)


def ctc_loss(
    logits: torch.Tensor,
    logit_paddings: torch.Tensor,
    labels: torch.Tensor,
    label_paddings: torch.Tensor,
    *,
    blank_id: int = 0,
    log_epsilon: float | torch.Tensor = -1e5,
) -> torch.Tensor:
    r"""CTC loss per sequence, :math:`-\log \sum_{\pi \to y} \prod_t p_t(\pi_t)`.

    The arguments are :func:`ctc_loss_with_forward_probs`'s; returns its ``(B,)`` loss.
    """
    return _ctc("ctc_loss", logits, logit_paddings, labels, label_paddings, blank_id,
                log_epsilon)[0]
