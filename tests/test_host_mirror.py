"""The host mirror of step counts (``ftopt._counts``) changes only in ftopt's own calls.

A weak reference's callback runs wherever the garbage collector does, also while
torch.compile traces a function that reads the mirror: the callbacks only note the dead
tensor, and the next call outside a trace drops its entry (not a new tensor's that took
the same id)."""

from __future__ import annotations

import gc

import torch

from ftopt import _counts


def test_a_dead_count_is_dropped_at_the_next_call_not_by_the_collector():
    gc.collect()
    _counts.remember_count(torch.zeros((), dtype=torch.int32), 0)  # (purges what is left)
    count = torch.zeros((), dtype=torch.int32)
    _counts.remember_count(count, 3)
    assert _counts.host_count(count) == 3
    key = id(count)
    del count
    gc.collect()
    assert key in _counts._mirror and (_counts._mirror, key) in _counts._dead
    other = torch.zeros((), dtype=torch.int32)
    _counts.remember_count(other, 1)
    assert key not in _counts._mirror or _counts._mirror[key][0]() is not None
    assert (_counts._mirror, key) not in _counts._dead
    assert _counts.host_count(other) == 1


def test_a_key_taken_by_a_new_tensor_keeps_its_entry():
    count = torch.zeros((), dtype=torch.int32)
    _counts.remember_count(count, 5)
    _counts._dead.append((_counts._mirror, id(count)))  # as if an old tensor of that id died
    _counts.remember_count(torch.zeros((), dtype=torch.int32), 0)
    assert _counts.host_count(count) == 5


def test_no_purge_while_compiling(monkeypatch):
    count = torch.zeros((), dtype=torch.int32)
    _counts.remember_count(count, 2)
    key = id(count)
    del count
    gc.collect()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    _counts.remember_count(torch.zeros((), dtype=torch.int32), 0)
    assert key in _counts._mirror and (_counts._mirror, key) in _counts._dead
    monkeypatch.undo()
    _counts.remember_count(torch.zeros((), dtype=torch.int32), 0)
    assert (_counts._mirror, key) not in _counts._dead
