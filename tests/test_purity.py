"""Purity (SPEC §1): ``init``, ``update``, ``apply_updates`` and ``step(donate=False)`` never
modify an input tensor: params, grads, state and hyperparameter tensors keep their bits and
their ``_version`` counters. ``step(donate=True, backend="eager")`` writes in place and
returns the very same tensor objects.

Every entry of the test registry (``tests/registry.py``) as a standalone optimizer, and
chains of several transforms; 32-bit and 8-bit states (a 64x80 leaf is quantized: 5120 >=
min_size 4096), with and without ``skip_zeros``.
"""

from __future__ import annotations

import pytest
import torch
from registry import BY_NAME, TRANSFORMS, standalone

import ftopt

SEED = 4242


def _hp(**values):
    """0-d float32 hyperparameter tensors (their bits and versions are checked too)."""
    return {k: torch.tensor(v) for k, v in values.items()}


# Per-suite choices for registry entries (keyed by registry name): structural options and
# values other than the entry's defaults.
OVERRIDES = {
    "sgd[momentum]": {"nesterov": True},
    "rmsprop": {"eps_in_sqrt": False, "initial_scale": 0.1},
}


def _registry_case(e):
    """Every registry entry as a standalone optimizer; its float hyperparameters that may be
    tensors are 0-d tensors (checked with the rest)."""
    defaults = {**e.defaults(tensors=True), **OVERRIDES.get(e.name, {})}
    hp = {k: v for k, v in defaults.items() if isinstance(v, torch.Tensor)}
    rest = {k: v for k, v in defaults.items() if k not in hp}
    return (lambda h, sz, sb: standalone(e, skip_zeros=sz, state_bits=sb, **rest, **h), hp)


# name -> (factory(hp, skip_zeros, state_bits), hyperparameter tensors): every registry
# entry, and chains of several transforms.
ALIASES = {e.name: _registry_case(e) for e in TRANSFORMS}
COMPOSITES = {
    "adam_nesterov": (lambda h, sz, sb: ftopt.adam(h["lr"], nesterov=True, skip_zeros=sz,
                                                   state_bits=sb), _hp(lr=1e-2)),
    "ademamix_sched": (lambda h, sz, sb: ftopt.ademamix(
        ftopt.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 20),
        b3=ftopt.ademamix_b3_warmup(0.9, 0.999, 10), alpha=ftopt.ademamix_alpha_warmup(5.0, 10),
        skip_zeros=sz, state_bits=sb), {}),
    "clip_global_adam": (lambda h, sz, sb: _chain_sz(
        [ftopt.clip_by_global_norm(h["c"]), ftopt.adam(h["lr"])], sz, sb),
        _hp(c=1.0, lr=1e-2)),
    "bnb_lamb": (lambda h, sz, sb: _chain_sz(
        [ftopt.scale_by_adam(), ftopt.clip_by_param_norm_ratio(h["r"]),
         ftopt.add_decayed_weights(h["wd"]), ftopt.scale_by_learning_rate(h["lr"])], sz, sb),
        _hp(r=1.0, wd=0.01, lr=1e-2)),
    "bnb_adagrad": (lambda h, sz, sb: _chain_sz(
        [ftopt.add_decayed_weights(0.01), ftopt.scale_by_rss(0.0, 1e-7, eps_in_sqrt=False),
         ftopt.scale_by_learning_rate(h["lr"])], sz, sb), _hp(lr=1e-2)),
    "masked_dict": (lambda h, sz, sb: _chain_sz(
        [ftopt.masked(ftopt.scale_by_adam(b1=h["b1"]), {"big": True, "w": False, "b": True,
                                                         "s": False}),
         ftopt.scale_by_learning_rate(h["lr"])], sz, sb), _hp(b1=0.9, lr=1e-2)),
    "partition_aliases": (lambda h, sz, sb: ftopt.quantize_states(ftopt.partition(
        {"a": ftopt.adamw(h["lr"], skip_zeros=sz), "b": ftopt.sgd(h["lr"], momentum=0.9,
                                                                  skip_zeros=sz)},
        {"big": "a", "w": "b", "b": "a", "s": "b"}), bits=sb), _hp(lr=1e-2)),
    "named_chain_skip": (lambda h, sz, sb: ftopt.quantize_states(ftopt.named_chain(
        ("adam", ftopt.scale_by_adam()), ("decay", ftopt.add_decayed_weights(h["wd"])),
        ("lr", ftopt.scale_by_learning_rate(h["lr"])),
        *([("skip", ftopt.skip_zeros())] if sz else [])), bits=sb), _hp(wd=0.1, lr=1e-2)),
}
assert not set(ALIASES) & set(COMPOSITES)
ALIASES.update(COMPOSITES)


pytestmark = pytest.mark.usefixtures("one_thread")


def _chain_sz(parts, skip_zeros, state_bits):
    tx = ftopt.chain(*parts, *([ftopt.skip_zeros()] if skip_zeros else []))
    return ftopt.quantize_states(tx, bits=state_bits)


def _data(seed, zeros: bool = True):
    gen = torch.Generator().manual_seed(seed)
    shapes = {"big": (64, 80), "w": (7, 5), "b": (33,), "s": ()}
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}

    def grads():
        g = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
        if zeros:
            for k in ("big", "w"):
                g[k][torch.rand(g[k].shape, generator=gen) < 0.25] = 0.0
            g["big"][:, :4] = -0.0  # whole 256-blocks of zeros as well
        return g

    return params, [grads() for _ in range(2)]


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``x`` (NaN-safe, -0.0 != +0.0)."""
    return x.detach().contiguous().reshape(-1).view(torch.uint8)


class Snapshot:
    """Clones and ``_version`` counters of every tensor in a set of trees."""

    def __init__(self, *trees):
        self.items = []
        for tree in trees:
            for leaf in ftopt.tree.leaves(tree):
                if isinstance(leaf, torch.Tensor):
                    self.items.append((leaf, leaf.detach().clone(), leaf._version))
        assert self.items

    def check(self, what: str):
        for i, (leaf, clone, version) in enumerate(self.items):
            assert leaf._version == version, f"{what}: input tensor #{i} was written"
            assert leaf.dtype == clone.dtype and leaf.shape == clone.shape
            assert torch.equal(_bits(leaf), _bits(clone)), (
                f"{what}: input tensor #{i} changed its bits")


def _bitwise_equal_trees(a, b):
    la, lb = ftopt.tree.leaves(a), ftopt.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(_bits(x), _bits(y))


CASES = [(name, bits, sz) for name in sorted(ALIASES) for bits in (32, 8) for sz in (False, True)]


@pytest.mark.parametrize("name,bits,skip", CASES,
                         ids=[f"{n}-{b}bit-{'skip' if s else 'noskip'}" for n, b, s in CASES])
def test_inputs_never_modified(name, bits, skip):
    factory, hp = ALIASES[name]
    params, grads_seq = _data(SEED)
    tx = factory(hp, skip, bits)

    snap = Snapshot(params, hp)
    state = tx.init(params)
    snap.check("init")
    if bits == 8 and (name in COMPOSITES or BY_NAME[name].quantizable):
        codes = [x for x in ftopt.tree.leaves(state) if x.dtype == torch.uint8]
        assert codes, "state_bits=8 must quantize the 64x80 leaf"

    p = params
    for step_i, g in enumerate(grads_seq):
        snap = Snapshot(p, g, state, hp)
        u, new_state = tx.update(g, state, p)
        snap.check(f"update (step {step_i})")
        snap_u = Snapshot(p, u, g, new_state, hp)
        new_p = ftopt.apply_updates(p, u)
        snap_u.check(f"apply_updates (step {step_i})")

        # ftopt.step(donate=False): same results, inputs untouched.
        snap = Snapshot(p, g, state, hp)
        sp, sstate = ftopt.step(tx, p, g, state, donate=False)
        snap.check(f"step (step {step_i})")
        _bitwise_equal_trees(sp, new_p)
        _bitwise_equal_trees(sstate, new_state)
        # No output aliases an input that could later be written (donate) by the caller.
        inputs = {id(x) for x in ftopt.tree.leaves((p, g, state))}
        assert not any(id(x) in inputs for x in ftopt.tree.leaves(sp))

        p, state = new_p, new_state
    if name in COMPOSITES or BY_NAME[name].moves:
        assert not torch.equal(p["b"], params["b"])


@pytest.mark.parametrize("name,bits,skip", [(n, b, s) for n in ("adam", "lamb", "ademamix",
                                                                 "partition_aliases",
                                                                 "named_chain_skip")
                                            for b in (32, 8) for s in (False, True)])
def test_donated_step_updates_in_place(name, bits, skip):
    factory, hp = ALIASES[name]
    params, grads_seq = _data(SEED + 1)
    tx = factory(hp, skip, bits)
    ref_p, ref_state = params, tx.init(params)
    p = {k: v.clone() for k, v in params.items()}
    state = tx.init(p)
    p_ids = [id(x) for x in ftopt.tree.leaves(p)]
    s_ids = [id(x) for x in ftopt.tree.leaves(state)]
    for g in grads_seq:
        ref_p, ref_state = ftopt.step(tx, ref_p, g, ref_state, donate=False)
        snap_g = Snapshot(g, hp)
        new_p, new_state = ftopt.step(tx, p, g, state, donate=True, backend="eager")
        snap_g.check("grads/hyperparameters under donate=True")
        assert [id(x) for x in ftopt.tree.leaves(new_p)] == p_ids
        assert [id(x) for x in ftopt.tree.leaves(new_state)] == s_ids
        assert ftopt.tree.structure(new_state) == ftopt.tree.structure(state)
        _bitwise_equal_trees(new_p, ref_p)
        _bitwise_equal_trees(new_state, ref_state)
        p, state = new_p, new_state
    # The original objects hold the final values.
    for k in params:
        assert not torch.equal(p[k], params[k]) or k == "s" and name == "lion"


def test_donate_true_with_16bit_params_keeps_dtype():
    gen = torch.Generator().manual_seed(SEED + 2)
    p = {"w": torch.randn(8, 8, generator=gen).to(torch.bfloat16),
         "h": torch.randn(5, generator=gen).to(torch.float16)}
    g = {k: torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in p.items()}
    tx = ftopt.adamw(1e-2, weight_decay=0.1)
    ref_p, ref_s = ftopt.step(tx, p, g, tx.init(p))
    objs = dict(p)
    state = tx.init(p)
    out_p, _ = ftopt.step(tx, p, g, state, donate=True, backend="eager")
    for k in p:
        assert out_p[k] is objs[k] and out_p[k].dtype == objs[k].dtype
        assert torch.equal(out_p[k], ref_p[k])
    assert state[0].mu["w"].dtype == torch.float32  # state stays fp32


def test_hyperparameter_tensor_change_between_steps_is_read():
    """A 0-d lr tensor is read each step: changing it (out of place) changes the update;
    ftopt never writes into it."""
    lr = torch.tensor(0.1)
    tx = ftopt.sgd(lr)
    p = {"w": torch.ones(3)}
    g = {"w": torch.ones(3)}
    state = tx.init(p)
    v = lr._version
    u, state = tx.update(g, state, p)
    assert torch.equal(u["w"], torch.full((3,), -0.1))
    lr.fill_(0.5)  # the caller may change it in place between steps
    u, state = tx.update(g, state, p)
    assert torch.equal(u["w"], torch.full((3,), -0.5))
    assert lr._version == v + 1  # only the caller's fill_
