"""Muon inside an outer partition, as a language model trains with it: Muon for the 2-D
weights of the blocks, AdamW for the rest (``benchmarks/muon_vs_adamw.py``).

Muon is itself a partition (Newton-Schulz for matrices, Adam for the rest), so its
inner Adam branch selects no leaf here. Its step counts must still live on the params'
device (the fused kernel increments them; a count elsewhere once sent the kernel too few
arguments), and the fused step must equal the eager one through ``ftopt.step`` and
``ftopt.Optimizer``, with schedules or constant learning rates, donated or not. Small
sizes: on the CPU the kernels run in the Triton interpreter.
"""

from __future__ import annotations

import optree
import pytest
import torch

import ftopt
from ftopt.lowering import counts as counts_lib
from ftopt.lowering import execute
from tests.step_checks import assert_trees_close

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

pytestmark = pytest.mark.usefixtures("one_thread")

# One block of the benchmark's byte-level model, tiny (d=8, 4 heads of 2, vocabulary 16).
SHAPES = {"wte.weight": (16, 8), "wpe.weight": (4, 8),
          "blocks.0.ln_1.weight": (8,), "blocks.0.ln_1.bias": (8,),
          "blocks.0.qkv.weight": (24, 8), "blocks.0.qkv.bias": (24,),
          "blocks.0.proj.weight": (8, 8), "blocks.0.fc.weight": (32, 8),
          "blocks.0.fc_proj.weight": (8, 32), "blocks.0.fc_proj.bias": (8,),
          "ln_f.weight": (8,), "head.weight": (16, 8)}
STEPS = 3


def _labels(params: dict) -> dict:
    return {k: "muon" if k.startswith("blocks.") and p.dim() == 2 else "adam"
            for k, p in params.items()}


def _lr(peak: float, scheduled: bool):
    if not scheduled:
        return peak
    # Warmup from 0 over 2 steps, then cosine to 10%: every step a different rate.
    return ftopt.warmup_cosine_decay_schedule(0.0, peak, 2, 10, 0.1 * peak)


def _muon(scheduled: bool) -> ftopt.GradientTransformation:
    return ftopt.muon(_lr(0.02, scheduled), weight_decay=0.1, ns_dtype=torch.float32)


def _split(scheduled: bool) -> ftopt.GradientTransformation:
    """The benchmark's ``muon`` optimizer."""
    adamw = ftopt.adamw(_lr(3e-3, scheduled), b1=0.9, b2=0.95, weight_decay=0.1)
    return ftopt.partition({"muon": _muon(scheduled), "adam": adamw}, _labels)


CASES = {
    "split_scheduled": (lambda: _split(True), SHAPES),
    "split_constant": (lambda: _split(False), SHAPES),
    "muon_scheduled": (lambda: _muon(True), SHAPES),
    # Only matrices: Muon's own Adam branch selects no leaf.
    "muon_matrices_scheduled": (lambda: _muon(True),
                                {k: s for k, s in SHAPES.items() if len(s) == 2}),
}


def _tree(gen, shapes: dict) -> dict:
    return {k: torch.randn(s, generator=gen).to(DEVICE) for k, s in shapes.items()}


def _step_run(tx, shapes: dict, backend: str, donate: bool):
    gen = torch.Generator().manual_seed(0)
    params = _tree(gen, shapes)
    state = tx.init(params)
    for _ in range(STEPS):
        params, state = ftopt.step(tx, params, _tree(gen, shapes), state, backend=backend,
                                   donate=donate)
    return params, state


def _optimizer_run(tx, shapes: dict, backend: str):
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.nn.Parameter(v) for k, v in _tree(gen, shapes).items()}
    opt = ftopt.Optimizer(params.items(), tx, backend=backend)
    for _ in range(STEPS):
        for p, g in zip(params.values(), _tree(gen, shapes).values()):
            p.grad = g
        opt.step()
    return {k: p.detach() for k, p in params.items()}, opt.state_dict()["state"]


def _close(a, b):
    # (Newton-Schulz amplifies last-bit differences of its input: a few ulps times ten.)
    assert_trees_close(a, b, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_step_fused_matches_eager(case, donate):
    make, shapes = CASES[case]
    tx = make()
    fused = _step_run(tx, shapes, "fused", donate)
    _close(fused, _step_run(tx, shapes, "eager", donate))
    counts = [x for x in optree.tree_leaves(fused[1], namespace="ftopt")
              if x.ndim == 0 and not x.is_floating_point()]
    assert counts and all(int(c) == STEPS for c in counts)


@pytest.mark.parametrize("case", ["split_scheduled", "muon_matrices_scheduled"])
def test_optimizer_fused_matches_eager(case):
    make, shapes = CASES[case]
    tx = make()
    fused = _optimizer_run(tx, shapes, "fused")
    eager = _optimizer_run(tx, shapes, "eager")
    _close(fused[0], eager[0])
    _close(fused[1], eager[1])


@pytest.mark.parametrize("case", ["split_scheduled", "muon_matrices_scheduled"])
def test_every_state_tensor_lives_on_the_params_device(case):
    """On the meta device (any device but the CPU would do): an empty branch's counts
    included."""
    make, shapes = CASES[case]
    params = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    state = make().init(params)
    paths, leaves, _ = optree.tree_flatten_with_path(state, namespace="ftopt")
    assert len(leaves) > len(shapes)
    assert [p for p, x in zip(paths, leaves) if x.device.type != "meta"] == []


@pytest.mark.parametrize("donate", [False, True])
def test_counts_off_the_kernels_device_are_counted_on_the_host(monkeypatch, donate):
    """A count that is not on the kernels' device (a state loaded with another
    ``map_location``) is incremented before the launch, and the kernel still gets its
    count arguments (dummies, with counting off)."""
    make, shapes = CASES["split_scheduled"]
    tx = make()
    eager = _step_run(tx, shapes, "eager", donate)
    monkeypatch.setattr(counts_lib, "counts_on", lambda counts, device: False)
    monkeypatch.setattr(execute, "counts_on", lambda counts, device: False)
    fused = _step_run(tx, shapes, "fused", donate)
    _close(fused, eager)
