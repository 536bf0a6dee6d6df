"""add_noise / noisy_sgd: the counter-based noise, the same on every backend.

The uniforms are compared bit for bit between the fused kernel (the Triton interpreter on
a CPU) and the eager torch ops, through probe rules that return the 32-bit words and the
uniforms themselves (through ``o.paired``, as the noise draws them: the even element of a
pair gets one value, the odd element the other); the normals within the bound of the two
math libraries' ``log`` and of the multiply-adds the fused kernel may contract
(NORMAL_ULPS float32 ulps of |z| + 1; 0.84 measured in the interpreter), and both against
Box-Muller in float64 from those uniforms. The angle's polynomial sine and cosine are
checked on every offset the noise can draw. The statistics run eagerly on 2**17 elements
with fixed seeds (so they cannot flake).
"""

from __future__ import annotations

import math

import pytest
import torch

import ftopt
from ftopt.rule_transform import rule_transform
from ftopt.rules import Rule
from ftopt.transforms import noise

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS32 = torch.finfo(torch.float32).eps
NORMAL_ULPS = 8

pytestmark = pytest.mark.usefixtures("one_thread")

# Leaf sizes: one element, 0-d, odd, more than one kernel block with a ragged tail.
SHAPES = {"a": (1,), "b": (), "c": (7, 5), "d": (2, 1500)}


def _tree(gen, shapes=SHAPES, device=DEVICE):
    return {k: torch.randn(s, generator=gen).to(device) for k, s in shapes.items()}


def _probe(fn, seed: int = 0x12345678):
    """A rule whose update is ``fn(o, x)``: the noise's inner values, on any backend."""
    def body(o, x):
        return fn(o, x), {}

    hparams = {"eta": 1.0, "gamma": 0.0, "seed_lo": float(seed % 65536),
               "seed_hi": float(seed // 65536)}
    return rule_transform(Rule("noise_probe", body, state_class=noise.AddNoiseState,
                               hparams=hparams, scalars=noise._noise_scalars, counted=True,
                               indexed=True))


def _at_count(tx, params, count: int):
    state = tx.init(params)
    return state._replace(count=torch.tensor(count, dtype=torch.int32, device=DEVICE))


def _fused_and_eager(tx, params, grads, state):
    fused, _ = ftopt.step(tx, params, grads, state, backend="fused")
    eager, _ = ftopt.step(tx, params, grads, state, backend="eager")
    return fused, eager


def _per_pair(fn):
    """A probe body: ``fn(o, k, key) -> (even, odd)`` of each element's pair."""
    return lambda o, x: o.paired(fn, x.index, noise.leaf_key(o, x))


def _halves(o, word):
    return o.to_float(o.shr(word, 16)), o.to_float(o.shr(o.mul32(word, 65536), 16))


@pytest.mark.parametrize("count", [0, 70_000])  # a step beyond 2**16 uses both halves
def test_words_and_uniforms_are_bit_identical_fused_and_eager(count):
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.zeros_like(v) for k, v in _tree(gen).items()}
    grads = _tree(gen)
    probes = {  # each 16-bit half of both words, and the uniforms, of every pair
        "first": _per_pair(lambda o, k, key: _halves(o, noise.pair_words(o, k, key)[0])),
        "second": _per_pair(lambda o, k, key: _halves(o, noise.pair_words(o, k, key)[1])),
        "uniforms": _per_pair(noise.pair_uniforms),
    }
    for name, fn in probes.items():
        tx = _probe(fn)
        fused, eager = _fused_and_eager(tx, params, grads, _at_count(tx, params, count))
        for k in params:
            assert torch.equal(fused[k].view(torch.int32), eager[k].view(torch.int32)), \
                (name, k)
    assert eager["d"].unique().numel() > 2900  # the words of 3000 elements are distinct


def test_normals_fused_within_the_math_library_bound():
    gen = torch.Generator().manual_seed(1)
    params = {k: torch.zeros_like(v) for k, v in _tree(gen).items()}
    tx = _probe(noise.standard_normal)
    fused, eager = _fused_and_eager(tx, params, _tree(gen), _at_count(tx, params, 3))
    for k in params:
        diff = (fused[k].double() - eager[k].double()).abs()
        bound = NORMAL_ULPS * EPS32 * (eager[k].double().abs() + 1)
        assert (diff <= bound).all(), (k, float((diff / bound).max()))


def _ulps(value: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|value − exact| in float32 ulps of ``exact`` (the spacing at its binade)."""
    spacing = torch.exp2(torch.floor(torch.log2(exact.abs())) - 23)
    return (value.double() - exact).abs() / spacing


def test_quarter_sin_cos_within_an_ulp_on_every_offset_drawn():
    """Every offset ρ = (j + 0.5 − 2**20)·π/2**22 of the 2**21 the noise draws, against
    float64 sin and cos of the float32 ρ; the ends of the range (±π/4) and small |ρ|
    included."""
    j = torch.arange(1 << 21, dtype=torch.float32)
    r = (j - (float(1 << 20) - 0.5)) * (math.pi / (1 << 22))
    assert float(r.min()) > -math.pi / 4 and float(r.max()) < math.pi / 4
    s, c = noise.quarter_sin_cos(r)
    assert s.dtype == c.dtype == torch.float32
    r64 = r.double()
    sin_err, cos_err = _ulps(s, torch.sin(r64)), _ulps(c, torch.cos(r64))
    assert float(sin_err.max()) <= 1.5, float(sin_err.max())
    assert float(cos_err.max()) <= 1.5, float(cos_err.max())
    assert float(sin_err.mean()) < 0.4 and float(cos_err.mean()) < 0.4  # mostly rounding


def _pairs(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The even and odd elements of the whole pairs of a flattened leaf."""
    flat = values.reshape(-1)[: values.numel() // 2 * 2]
    return flat[0::2], flat[1::2]


def test_angle_and_normals_match_float64_box_muller_from_the_uniforms():
    """cos θ, sin θ and the normals, fused and eager, against float64 from the same
    (bit-identical) uniforms: θ = 2π u2 − π/4, z = sqrt(−2 ln u1)·(cos θ, sin θ)."""
    gen = torch.Generator().manual_seed(14)
    shapes = {"w": (4096,), "c": (7, 5)}
    params = {k: torch.zeros_like(v) for k, v in _tree(gen, shapes).items()}
    grads = _tree(gen, shapes)
    runs = {}
    probes = {"uniforms": _per_pair(noise.pair_uniforms),
              "circle": _per_pair(lambda o, k, key: noise.unit_circle(
                  o, noise.pair_words(o, k, key)[1])),
              "normals": _per_pair(noise.pair_normals)}
    for name, fn in probes.items():
        tx = _probe(fn)
        runs[name] = _fused_and_eager(tx, params, grads, _at_count(tx, params, 5))
    for k in params:
        u1, u2 = (u.double() for u in _pairs(runs["uniforms"][1][k]))
        assert torch.equal(runs["uniforms"][0][k], runs["uniforms"][1][k])
        theta = 2 * math.pi * u2 - math.pi / 4
        radius = torch.sqrt(-2 * torch.log(u1))
        for backend in (0, 1):  # fused, eager
            cos, sin = (v.double() for v in _pairs(runs["circle"][backend][k]))
            assert float((cos - torch.cos(theta)).abs().max()) <= 2 * EPS32, (k, backend)
            assert float((sin - torch.sin(theta)).abs().max()) <= 2 * EPS32, (k, backend)
            assert torch.allclose(cos * cos + sin * sin, torch.ones_like(cos), atol=4 * EPS32)
            for z, exact in zip(_pairs(runs["normals"][backend][k]),
                                (radius * torch.cos(theta), radius * torch.sin(theta))):
                bound = NORMAL_ULPS * EPS32 * (exact.abs() + 1)
                assert ((z.double() - exact).abs() <= bound).all(), (k, backend)


@pytest.mark.parametrize("donate", [False, True])
def test_noisy_sgd_fused_matches_eager_over_steps(donate):
    tx = ftopt.noisy_sgd(0.1, eta=0.3, gamma=0.55, seed=7)
    gen = torch.Generator().manual_seed(2)
    start = _tree(gen)
    runs = {}
    for backend in ("fused", "eager"):
        params = {k: v.clone() for k, v in start.items()}
        state = tx.init(params)
        step_gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            params, state = ftopt.step(tx, params, _tree(step_gen), state, backend=backend,
                                       donate=donate)
        runs[backend] = params
        assert int(state[0].count) == 3
    for k in start:
        scale = 0.1 * math.sqrt(0.3) * NORMAL_ULPS * EPS32 * 7  # lr·σ·(bound at |z| <= 6)
        diff = (runs["fused"][k] - runs["eager"][k]).abs()
        assert (diff <= scale * 3 + 4 * EPS32 * runs["eager"][k].abs()).all(), k


def test_uniforms_and_normals_are_well_distributed():
    n = 1 << 17
    params = {"w": torch.zeros(2 * n)}
    grads = {"w": torch.ones(2 * n)}
    probe = _probe(_per_pair(noise.pair_uniforms))
    u, _ = probe.update(grads, probe.init(params), params)
    u1, u2 = {"w": u["w"][0::2]}, {"w": u["w"][1::2]}  # the two uniforms of each pair
    for u in (u1["w"], u2["w"]):
        assert 0.0 < float(u.min()) and float(u.max()) < 1.0
        counts = torch.bincount((u.double() * 64).long(), minlength=64).double()
        chi2 = float(((counts - n / 64) ** 2 / (n / 64)).sum())
        assert chi2 < 63 + 5 * math.sqrt(2 * 63), chi2  # 63 degrees of freedom, 5 sigma
    # The two uniforms of a pair, and neighbouring pairs, are uncorrelated.
    for a, b in ((u1["w"], u2["w"]), (u1["w"][1:], u1["w"][:-1])):
        corr = float(torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1])
        assert abs(corr) < 5 / math.sqrt(n), corr
    # The angle's quadrant is the second word's top 2 bits: the four equally often.
    quadrant = torch.bincount((u2["w"].double() * 4).long(), minlength=4).double()
    assert float(((quadrant - n / 4) ** 2 / (n / 4)).sum()) < 3 + 5 * math.sqrt(6), quadrant


@pytest.mark.parametrize("steps", [1, 4])
def test_noise_has_mean_zero_and_variance_eta_over_t_to_the_gamma(steps):
    n = 1 << 17
    eta, gamma = 0.3, 0.55
    tx = ftopt.add_noise(eta, gamma, seed=11)
    params = {"w": torch.zeros(n)}
    grads = {"w": torch.randn(n, generator=torch.Generator().manual_seed(4))}
    state = tx.init(params)
    for _ in range(steps):
        updates, state = tx.update(grads, state, params)
    z = (updates["w"].double() - grads["w"].double())
    variance = eta / steps**gamma
    assert abs(float(z.mean())) < 5 * math.sqrt(variance / n)
    # var of a sample variance: 2σ⁴/n; five standard errors.
    assert abs(float(z.var()) / variance - 1) < 5 * math.sqrt(2 / n)
    # Kolmogorov-Smirnov against N(0, σ²): D below the 0.1% critical value 1.95/√n.
    cdf = torch.special.ndtr(z.sort().values / math.sqrt(variance))
    i = torch.arange(1, n + 1, dtype=torch.float64)
    d = max(float((i / n - cdf).max()), float((cdf - (i - 1) / n).max()))
    assert d < 1.95 / math.sqrt(n), d
    # The two draws of a pair (r cos θ, r sin θ), and neighbouring pairs, are uncorrelated.
    for a, b in ((z[0::2], z[1::2]), (z[1:-1:2], z[2::2])):
        corr = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
        assert abs(corr) < 5 / math.sqrt(n / 2), corr
    # The angle of a pair is uniform (64 sectors: each quadrant's rotation and the
    # polynomials inside it) and independent of its radius (its sectors alike in the
    # inner and the outer half of the radii, split at the median r² = 2 ln 2).
    angle = torch.atan2(z[1::2], z[0::2])
    sector = ((angle + math.pi) / (2 * math.pi) * 64).long().clamp(max=63)
    outer = (z[0::2] ** 2 + z[1::2] ** 2) / variance > 2 * math.log(2)
    for part in (sector, sector[outer], sector[~outer]):
        counts = torch.bincount(part, minlength=64).double()
        expected = part.numel() / 64
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 63 + 5 * math.sqrt(2 * 63), chi2


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_a_leaf_starting_at_any_position_draws_those_of_the_full_leaf(backend, monkeypatch):
    """A leaf whose elements start at ``start`` of a full tensor (a shard) draws the noise
    of those positions of the full leaf, bit for bit, for even and odd starts (the fused
    blocks of an odd start cut pairs in two: they draw each element's own pair)."""
    from ftopt import shards

    gen = torch.Generator().manual_seed(13)
    full_g = torch.randn(3000, generator=gen).to(DEVICE)
    tx = ftopt.add_noise(1.0, 0.0, seed=5)
    full = {"w": torch.zeros(3000, device=DEVICE)}
    whole, _ = ftopt.step(tx, full, {"w": full_g}, tx.init(full), backend=backend)
    for start, n in ((1, 1), (2, 1500), (1027, 1800), (1, 2999)):
        monkeypatch.setattr(shards, "element_offset", lambda path, who, s=start: s)
        part = {"w": torch.zeros(n, device=DEVICE)}
        grads = {"w": full_g[start:start + n].clone()}
        new, _ = ftopt.step(tx, part, grads, tx.init(part), backend=backend)
        assert torch.equal(new["w"], whole["w"][start:start + n]), start


def _noise(tx, params, grads, state):
    updates, state = tx.update(grads, state, params)
    return {k: updates[k] - grads[k] for k in grads if grads[k] is not None}, state


def test_reproducible_across_calls_and_instances():
    gen = torch.Generator().manual_seed(5)
    params, grads = _tree(gen, device="cpu"), _tree(gen, device="cpu")
    tx = ftopt.add_noise(0.1, 0.5, seed=3)
    first, _ = tx.update(grads, tx.init(params), params)
    again, _ = tx.update(grads, tx.init(params), params)
    other = ftopt.add_noise(0.1, 0.5, seed=3)
    third, _ = other.update(grads, other.init(params), params)
    for k in params:
        assert torch.equal(first[k], again[k]) and torch.equal(first[k], third[k]), k


def test_different_across_steps_seeds_and_leaves():
    shapes = {"x": (40, 50), "y": (40, 50)}
    gen = torch.Generator().manual_seed(6)
    params, grads = _tree(gen, shapes, "cpu"), _tree(gen, shapes, "cpu")
    tx = ftopt.add_noise(1.0, 0.0, seed=0)  # gamma 0: the same scale every step
    n1, state = _noise(tx, params, grads, tx.init(params))
    n2, _ = _noise(tx, params, grads, state)
    seeded = ftopt.add_noise(1.0, 0.0, seed=1)
    s1, _ = _noise(seeded, params, grads, seeded.init(params))
    pairs = {"steps": (n1["x"], n2["x"]), "seeds": (n1["x"], s1["x"]),
             "leaves": (n1["x"], n1["y"])}
    for what, (a, b) in pairs.items():
        assert int((a == b).sum()) < 5, what
        corr = float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])
        assert abs(corr) < 5 / math.sqrt(a.numel()), (what, corr)


def test_leaf_id_is_the_position_in_the_whole_tree():
    """A masked noise, a leaf without gradient and a partition draw a leaf's noise by its
    position in the flattened params, as the plain transform over the whole tree does."""
    gen = torch.Generator().manual_seed(8)
    params, grads = _tree(gen, device="cpu"), _tree(gen, device="cpu")
    tx = ftopt.add_noise(0.2, 0.5, seed=9)
    full, _ = _noise(tx, params, grads, tx.init(params))
    only_c = ftopt.masked(tx, {k: k == "c" for k in params})
    masked, _ = _noise(only_c, params, grads, only_c.init(params))
    assert torch.equal(masked["c"], full["c"])
    holes = {**grads, "a": None, "b": None}
    partial, _ = _noise(tx, params, holes, tx.init(params))
    assert torch.equal(partial["d"], full["d"])
    labels = {k: ("even" if k in "ac" else "odd") for k in params}
    split = ftopt.partition({"even": tx, "odd": ftopt.add_noise(0.2, 0.5, seed=9)}, labels)
    parts, _ = _noise(split, params, grads, split.init(params))
    for k in params:
        assert torch.equal(parts[k], full[k]), k


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_a_frozen_none_param_keeps_the_positions_of_the_others(backend):
    """A param held as ``None`` (frozen) counts as a leaf: the others draw the noise of
    their positions in the tree with it a tensor, bit for bit, on each backend."""
    gen = torch.Generator().manual_seed(11)
    params, grads = _tree(gen), _tree(gen)
    tx = ftopt.add_noise(0.2, 0.5, seed=6)
    full, _ = tx.update(grads, tx.init(params), params, backend=backend)
    frozen_p, frozen_g = {**params, "a": None}, {**grads, "a": None}
    out, _ = tx.update(frozen_g, tx.init(frozen_p), frozen_p, backend=backend)
    assert out["a"] is None
    for k in params:
        if k != "a":
            assert torch.equal(out[k], full[k]), k


def test_param_groups_fused_draw_by_position_in_the_joined_tree():
    """Two groups of one chain (other learning rates) fuse as one partition; each leaf's
    noise is that of its position in the joined tree, fused and eager."""
    gen = torch.Generator().manual_seed(10)
    params, grads = _tree(gen), _tree(gen)
    labels = {k: ("g0" if k in "ab" else "g1") for k in params}
    tx = ftopt.partition({"g0": ftopt.noisy_sgd(0.1, seed=4), "g1": ftopt.noisy_sgd(
        0.2, seed=4)}, labels)
    fused, eager = _fused_and_eager(tx, params, grads, tx.init(params))
    whole = ftopt.noisy_sgd(1.0, seed=4)
    updates, _ = whole.update(grads, whole.init(params), params)
    for k in params:
        lr = 0.1 if labels[k] == "g0" else 0.2
        expected = params[k] + lr * updates[k]
        tol = 0.1 * 0.2 * NORMAL_ULPS * EPS32 * 7 + 4 * EPS32 * expected.abs()
        assert ((fused[k] - eager[k]).abs() <= tol).all(), k
        assert ((eager[k] - expected).abs() <= 4 * EPS32 * (expected.abs() + 1)).all(), k


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_skip_zeros_adds_no_noise_where_the_gradient_is_zero(backend):
    gen = torch.Generator().manual_seed(12)
    params, grads = _tree(gen), _tree(gen)
    grads["c"][1] = 0.0
    grads["d"][:, 100:900] = -0.0
    zero = {k: g == 0 for k, g in grads.items()}
    skip = ftopt.noisy_sgd(0.1, eta=0.5, seed=2, skip_zeros=True)
    plain = ftopt.noisy_sgd(0.1, eta=0.5, seed=2)
    new_s, state = ftopt.step(skip, params, grads, skip.init(params), backend=backend)
    new_p, _ = ftopt.step(plain, params, grads, plain.init(params), backend=backend)
    assert int(state[0].count) == 1  # the count advances
    for k in params:
        z = zero[k]
        assert torch.equal(new_s[k][z].view(torch.int32), params[k][z].view(torch.int32)), k
        assert torch.equal(new_s[k][~z], new_p[k][~z]), k
        if z.any():
            assert not torch.equal(new_p[k][z], params[k][z]), k  # the control: noise moves


def test_chunked_cpu_evaluator_declines_and_eager_runs():
    from ftopt import dispatch

    chunked = dispatch.backend("chunked")
    params = {"w": torch.randn(64)}
    grads = {"w": torch.randn(64)}
    tx = ftopt.noisy_sgd(0.1)
    assert chunked.step(tx, params, grads, tx.init(params), False) is None
    new, _ = ftopt.step(tx, params, grads, tx.init(params), backend="eager")
    assert not torch.equal(new["w"], params["w"] - 0.1 * grads["w"])


@pytest.mark.parametrize("seed, error", [(-1, ValueError), (1 << 32, ValueError),
                                         (1.5, TypeError), (True, TypeError)])
def test_bad_seed_is_refused(seed, error):
    with pytest.raises(error, match="seed"):
        ftopt.add_noise(0.01, 0.55, seed=seed)


def test_negative_eta_is_refused():
    with pytest.raises(ValueError, match="eta"):
        ftopt.noisy_sgd(0.1, eta=-0.1)
