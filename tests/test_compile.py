"""``torch.compile(fullgraph=True)`` of a training step that calls ``ftopt.step``, and a
step captured in a CUDA graph."""

from __future__ import annotations

import os

import pytest
import torch

import ftopt

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _problem(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 1)).to(DEVICE)
    params = {k: torch.randn(v.shape, generator=gen).to(DEVICE) * 0.3
              for k, v in model.named_parameters()}
    x = torch.randn(32, 8, generator=gen).to(DEVICE)
    y = torch.randn(32, 1, generator=gen).to(DEVICE)

    def loss_fn(p):
        return ((torch.func.functional_call(model, p, (x,)) - y) ** 2).mean()

    return params, loss_fn


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("make_tx", [
    lambda: ftopt.adamw(torch.tensor(1e-2), weight_decay=0.1, skip_zeros=True),
    lambda: ftopt.lamb(1e-2, weight_decay=0.01),
], ids=["adamw_skip", "lamb"])
def test_compiled_training_step_has_no_graph_break(make_tx, donate):
    tx = make_tx()
    params, loss_fn = _problem()

    def train_step(p, s):
        grads = torch.func.grad(loss_fn)(p)
        return ftopt.step(tx, p, grads, s, donate=donate, backend="fused")

    reference = ({k: v.clone() for k, v in params.items()}, None)
    ref_p, ref_s = reference[0], tx.init(reference[0])
    for _ in range(3):
        ref_p, ref_s = train_step(ref_p, ref_s)
    compiled = torch.compile(train_step, fullgraph=True, backend="aot_eager")
    p = {k: v.clone() for k, v in params.items()}
    s = tx.init(p)
    for _ in range(3):
        p, s = compiled(p, s)
    for k in p:
        # Compiled autograd may round the gradients differently from eager on a GPU.
        assert torch.allclose(p[k], ref_p[k], rtol=1e-5, atol=1e-6), k
    assert int(s[0].count) == 3


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("norms", [False, True])
def test_step_with_tensor_hyperparameters_replays_in_a_cuda_graph(norms):
    """With norms: a global clip and LAMB's per-leaf trust ratios, whose reduction
    passes (per-leaf and global sums, one zeroed buffer) are captured too."""
    lr = torch.tensor(1e-2, device=DEVICE)
    b1 = torch.tensor(0.9, device=DEVICE)

    def make():
        if norms:
            return ftopt.chain(ftopt.clip_by_global_norm(0.5),
                               ftopt.lamb(lr, b1=b1, weight_decay=0.1))
        return ftopt.adamw(lr, b1=b1, weight_decay=0.1)

    tx = make()
    tx_ref = make()  # its own cached tables
    params, loss_fn = _problem(1)
    grads = torch.func.grad(loss_fn)(params)
    static_g = {k: v.clone() for k, v in grads.items()}

    ref_p = {k: v.clone() for k, v in params.items()}
    ref_s = tx_ref.init(ref_p)
    p = {k: v.clone() for k, v in params.items()}
    s = tx.init(p)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm up: kernels compiled, tables built
            p, s = ftopt.step(tx, p, static_g, s, donate=True)
            ref_p, ref_s = ftopt.step(tx_ref, ref_p, static_g, ref_s, donate=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ftopt.step(tx, p, static_g, s, donate=True)
    for value in (1e-2, 5e-3, 2e-2):
        lr.fill_(value)
        graph.replay()
        ref_p, ref_s = ftopt.step(tx_ref, ref_p, static_g, ref_s, donate=True)
    torch.cuda.synchronize()
    counted = s[-1][0] if norms else s[0]
    assert int(counted.count) == int((ref_s[-1][0] if norms else ref_s[0]).count) == 5
    for k in p:
        assert torch.allclose(p[k], ref_p[k], rtol=1e-6, atol=1e-7), k


def test_the_constant_mark_is_the_one_dynamo_sets():
    """ftopt marks its registration function as Dynamo's decorator would, without
    importing Dynamo when ftopt is imported."""
    from ftopt.lowering import op

    marked = torch.compiler.assume_constant_result(lambda: 0)
    assert getattr(marked, "_dynamo_marked_constant", None) is True
    assert op._register._dynamo_marked_constant is True


def test_importing_ftopt_imports_neither_triton_nor_dynamo():
    import subprocess
    import sys

    code = ("import sys, ftopt; print('torch._dynamo' in sys.modules, "
            "'triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False"], out


def test_cpu_steps_and_updates_import_no_triton_until_a_step_may_fuse():
    """``backend="auto"`` fuses only on an accelerator: steps and updates whose leaves
    are all on the CPU run eagerly without importing the fused backend (Triton); one that
    asks for the fused backend imports it (the control)."""
    import subprocess
    import sys

    code = """
import sys, torch, ftopt
p = {"w": torch.randn(8, 3), "b": None}
g = {"w": torch.randn(8, 3), "b": None}
tx = ftopt.chain(ftopt.clip_by_global_norm(1.0), ftopt.adam(1e-2, skip_zeros=True))
s = tx.init(p)
p2, s2 = ftopt.step(tx, p, g, s)
u, _ = tx.update(g, s, p)
same = torch.allclose(p2["w"], ftopt.apply_updates(p, u)["w"])
p3, _ = ftopt.step(tx, p, g, s, donate=True)
print('triton' in sys.modules, 'ftopt.lowering.entry' in sys.modules, same)
try:
    ftopt.step(tx, p3, g, s, backend="fused")
except RuntimeError as err:  # (no GPU, no interpreter: the fused backend says why)
    print("raised", "cannot fuse" in str(err))
print('ftopt.lowering.entry' in sys.modules)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env).stdout.split()
    assert out == ["False", "False", "True", "raised", "True", "True"], out
