"""Test configuration: without a GPU, Triton kernels run in the interpreter."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture(params=["guards", "python"])
def tensor_checks(request, monkeypatch):
    """Runs a test with both ways the fused paths check new tensors against their
    cached tables: torch's C++ guards and the per-property Python passes."""
    from ftopt.lowering import checks

    monkeypatch.setattr(checks, "USE_GUARDS", request.param == "guards")
    return request.param


@pytest.fixture(scope="module")
def one_thread():
    """Small tensors: intra-op threads only add overhead (and spin on a busy machine).
    Modules use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
