"""A step's torch ops do not depend on where its state came from (SPEC §1: ``donate=True``
and a state through ``torch.save``/``torch.load`` give the bits of ``donate=False``).

Found by the fuzz on an H200 (prodigy's ``numerator_weighted``, and an 8-bit chain of
ema, Muon, factored RMS and Rprop, one bit off): a state whose step count the host did not
know (a clone, a loaded checkpoint, a donated step's write-back) made the eager path
compute its per-step scalars on the device, with other ops than the host's (a float b1
made a float32 tensor before widening, 1 − β taken in float32), and on an accelerator
those round differently. Now the eager path reads such a count once, on every device, as
the fused path does (:func:`ftopt.eager.known_count`), and a donated step's write-back
keeps the host's record of the new count; the device-scalar path (``torch.func``, counts
decided on the device) computes its scalars as the host does.

The ops are recorded with a dispatch mode, each with the shapes, dtypes and strides of its
tensors and its numbers; the write-back's copies, the one read of the count and
allocations aside, the sequences must be equal.
"""

from __future__ import annotations

import io

import optree
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ftopt
from ftopt._counts import mark_device_decided

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
READ = "aten._local_scalar_dense.default([torch.int32"  # a count's one read

pytestmark = pytest.mark.usefixtures("one_thread")


class Recorder(TorchDispatchMode):
    """The ATen ops dispatched, in order, with their arguments' layouts and numbers."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append(f"{func}({_describe(args)}, {_describe(kwargs)})")
        return func(*args, **kwargs)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype}{tuple(x.shape)}/{tuple(x.stride())}@{x.device.type}"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}={_describe(v)}" for k, v in x.items()) + "}"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_describe(v) for v in x) + "]"
    return repr(x)


def _recorded(tx, params, grads, state, donate: bool = False):
    with Recorder() as rec:
        out = ftopt.step(tx, params, grads, state, donate=donate, backend="eager")
    return out, rec.ops


def _without_write_back(ops: list[str]) -> list[str]:
    """The ops before the donated step's final copies into the given tensors."""
    end = len(ops)
    while end and ops[end - 1].startswith("aten.copy_.default"):
        end -= 1
    return ops[:end]


def _reads(ops: list[str]) -> list[str]:
    return [op for op in ops if op.startswith(READ)]


def _without_reads(ops: list[str]) -> list[str]:
    return [op for op in ops if not op.startswith(READ)]


def _math(ops: list[str]) -> list[str]:
    """The ops that compute (allocations aside: the eager CPU path reuses its scratch
    buffers from one call to the next)."""
    return [op for op in ops if not op.startswith("aten.empty")]


def _clone(tree):
    return optree.tree_map(torch.clone, tree, namespace="ftopt")


def _bits(t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        return t
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def _assert_same_bits(a, b, what: str) -> None:
    la, sa = optree.tree_flatten(a, namespace="ftopt")
    lb, sb = optree.tree_flatten(b, namespace="ftopt")
    assert sa == sb, f"{what}: tree structures differ"
    for i, (x, y) in enumerate(zip(la, lb)):
        assert x.dtype == y.dtype and torch.equal(_bits(x), _bits(y)), \
            f"{what}: leaf {i} differs in its bits"


def _prodigy():
    return ftopt.prodigy(0.57, betas=(0.9, 0.999), eps=1.3e-4, estim_lr0=1.9e-3,
                         estim_lr_coef=0.54, weight_decay=0.035, safeguard_warmup=True)


def _prodigy_8bit():
    return ftopt.prodigy(5.0, betas=(0.8, 0.9), eps=1e-3, estim_lr0=1e-3,
                         weight_decay=0.05, state_bits=8)


def _matrix_chain():
    """The fuzz's 3:0:855: elementwise and matrix stages with counts, 8-bit states."""
    inner = ftopt.chain(
        ftopt.keep_params_nonnegative(), ftopt.ema(0.667, debias=True),
        ftopt.scale_by_muon(ns_steps=2, beta=0.999, eps=1e-3, ns_dtype=torch.float32),
        ftopt.scale_by_factored_rms(factored=False, decay_rate=0.64, epsilon=1e-6,
                                    min_dim_size_to_factor=2),
        ftopt.scale_by_rprop(1.2e-4, eta_minus=0.55, eta_plus=1.57, min_step_size=0.0,
                             max_step_size=7.4))
    return ftopt.quantize_states(ftopt.skip_zeros(inner), bits=8, min_size=0)


TRANSFORMS = {"prodigy": _prodigy, "prodigy_8bit": _prodigy_8bit,
              "matrix_chain": _matrix_chain}
SHAPES = {"prodigy": [(7,), (7,)], "prodigy_8bit": [(64, 80), (70,)],
          "matrix_chain": [(513,), (16, 17), (257,)]}


def _case(name: str, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(5)
    params = {f"w{i}": torch.randn(s, generator=gen).to(DEVICE, dtype)
              for i, s in enumerate(SHAPES[name])}

    def grads():
        out = {}
        for k, p in params.items():
            g = torch.randn(p.shape, generator=gen)
            g[torch.rand(p.shape, generator=gen) < 0.2] = 0.0
            out[k] = g.to(DEVICE, dtype)
        return out
    return TRANSFORMS[name](), params, [grads() for _ in range(3)]


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_donated_and_reloaded_states_step_with_the_same_ops(name):
    dtype = torch.float16 if name == "prodigy" else torch.float32
    tx, params, grads = _case(name, dtype)
    p, s = params, tx.init(params)
    dp, ds = _clone(p), _clone(s)  # counts the host does not know: read once
    for k, g in enumerate(grads):
        (p1, s1), plain = _recorded(tx, p, g, s)
        (dp, ds), donated = _recorded(tx, dp, g, ds, donate=True)
        plain = _math(plain)
        assert not _reads(plain)
        assert bool(_reads(donated)) == (k == 0), \
            "a donated step's write-back forgot the host's record of the count"
        assert _math(_without_reads(_without_write_back(donated))) == plain, \
            f"step {k}: donate=True runs other ops than donate=False"
        _assert_same_bits((dp, ds), (p1, s1), f"step {k}: donated vs not")
        buf = io.BytesIO()
        torch.save(s, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        (p2, s2), reloaded = _recorded(tx, p, g, loaded)
        assert _math(_without_reads(reloaded)) == plain, \
            f"step {k}: a reloaded state runs other ops than the original"
        _assert_same_bits((p2, s2), (p1, s1), f"step {k}: reloaded vs the original")
        p, s = p1, s1


def _device_decided(state):
    out = _clone(state)
    for t in optree.tree_leaves(out, namespace="ftopt"):
        if t.ndim == 0 and not t.is_floating_point():
            mark_device_decided(t)
    return out


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_device_scalars_have_the_host_scalars_bits(name):
    """Where a count is never read (decided on the device, or under ``torch.func``) the
    scalars are computed with torch ops in float64, as the host computes them in Python:
    on the CPU (one math library for both) the same bits. Before, prodigy's b1 went
    through float32 and 1 − β of the factored RMS was taken in float32."""
    tx, params, grads = _case(name, torch.float32)
    params = optree.tree_map(lambda t: t.cpu(), params, namespace="ftopt")
    p, s = params, tx.init(params)
    for k, g in enumerate(grads):
        g = optree.tree_map(lambda t: t.cpu(), g, namespace="ftopt")
        host = ftopt.step(tx, p, g, s, backend="eager")
        with Recorder() as rec:
            device = ftopt.step(tx, p, g, _device_decided(s), backend="eager")
        assert not _reads(rec.ops), "a count decided on the device was read"
        _assert_same_bits(device, host, f"step {k}: device scalars vs host scalars")
        p, s = host
