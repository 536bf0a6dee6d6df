"""Every optimizer of the catalogue (each registry entry, ``tests/registry.py``, as a
standalone optimizer: an alias as it is, a transform followed by a learning rate) through
the ``torch.optim`` front door: ``ftopt.Optimizer`` over a module, its ``state_dict``
through ``torch.save`` / ``torch.load(weights_only=True)`` into a fresh optimizer, and
the resumed run equal to the uninterrupted one bit for bit (the per-parameter views of
every kind of state: per-element slots, per-leaf values, matrix stages' row moments and
factors, schedules' counts)."""

from __future__ import annotations

import io

import pytest
import torch
from registry import TRANSFORMS, names, standalone

import ftopt
from ftopt.combine import update_keywords

pytestmark = pytest.mark.usefixtures("one_thread")

# (aliases whose update reads more than the loss, which a closure gives: the line
# searches' value_fn, Sophia's obj_fn, SAM's grad_fn, are driven by their own suites)
ENTRIES = [e for e in TRANSFORMS if update_keywords(standalone(e)) <= {"value"}]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(),
                               torch.nn.Linear(12, 3))


def _run(model, opt, batches) -> None:
    for x, y in batches:
        def closure(x=x, y=y):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss
        opt.step(closure)


@pytest.mark.parametrize("skip", [False, True], ids=["plain", "skip_zeros"])
@pytest.mark.parametrize("name", names(ENTRIES))
def test_every_entry_resumes_through_the_torch_optimizer(name, skip):
    e = next(x for x in ENTRIES if x.name == name)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 6, generator=gen), torch.randn(16, 3, generator=gen))
               for _ in range(5)]
    for x, _ in batches:  # (two inputs always 0: their weights' gradients are exactly 0)
        x[:, :2] = 0.0

    def fresh():
        model = _model()
        return model, ftopt.Optimizer(model.named_parameters(),
                                      standalone(e, skip_zeros=skip), backend="eager")

    straight, opt = fresh()
    _run(straight, opt, batches)
    first, opt = fresh()
    _run(first, opt, batches[:3])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed, opt2 = fresh()
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    _run(resumed, opt2, batches[3:])
    for (k, p), q in zip(resumed.named_parameters(), straight.parameters()):
        assert torch.equal(p, q), k
    if e.moves:
        assert any(not torch.equal(p, q) for p, q in zip(straight.parameters(),
                                                          _model().parameters()))
