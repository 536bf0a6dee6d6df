"""``ftopt.projections`` (optax's ``optax.projections``): optax's test cases and docstring
examples ported; in float64 on fresh random trees, each projection is the argmin of the
distance over its set (feasible, and the variational inequality ⟨x − P(x), y − P(x)⟩ <= 0
for random feasible y; distance compared directly for the non-convex spheres), against
independent references (bisection for the simplex); idempotence; whole-tree semantics over
pytrees; autograd and torch.func (jacrev = jacfwd = the known Jacobian, gradcheck, vmap);
fp32 and fp64 on every device here; purity; errors naming the argument and path; and
projected gradient descent with ftopt optimizers reaching known constrained optima."""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch
from torch.func import grad, jacfwd, jacrev, jvp, vjp, vmap

import ftopt
from ftopt import projections as proj

F64 = torch.float64
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _vec(tree) -> torch.Tensor:
    return torch.cat([t.reshape(-1).to(F64) for t in ftopt.tree.leaves(tree)])


def _unvec(v: torch.Tensor, like):
    leaves, spec = ftopt.tree.leaves(like), ftopt.tree.structure(like)
    parts = torch.split(v, [t.numel() for t in leaves])
    return ftopt.tree.unflatten(spec, [p.reshape(t.shape).to(t.dtype)
                                       for p, t in zip(parts, leaves)])


def _tree(gen, scale=3.0, dtype=F64, device="cpu"):
    def r(*shape):
        return (scale * torch.randn(*shape, generator=gen, dtype=F64)).to(device, dtype)
    return {"w": r(3, 4), "b": [r(5), r(())], "none": None}


def _copy(tree):
    return ftopt.tree.map(lambda t: t.clone(), tree)


def _same(a, b):
    return ftopt.tree.structure(a) == ftopt.tree.structure(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        for x, y in zip(ftopt.tree.leaves(a), ftopt.tree.leaves(b)))


def _close(a, b, **tol):
    assert ftopt.tree.structure(a) == ftopt.tree.structure(b)
    for x, y in zip(ftopt.tree.leaves(a), ftopt.tree.leaves(b)):
        torch.testing.assert_close(x, torch.as_tensor(y, dtype=x.dtype), **tol)


def _t(*xs):
    return tuple(torch.tensor(x) for x in xs)


# --- optax's test cases ------------------------------------------------------------------

def test_optax_non_negative():
    x = torch.tensor([-1.0, 2.0, 3.0])
    expected = torch.tensor([0.0, 2.0, 3.0])
    assert torch.equal(proj.projection_non_negative(x), expected)
    assert _same(proj.projection_non_negative((x, x)), (expected, expected))
    tree = (torch.tensor(-1.0), {"k1": torch.tensor(1.0), "k2": _t(1.0, 1.0)}, torch.tensor(1.0))
    want = (torch.tensor(0.0), {"k1": torch.tensor(1.0), "k2": _t(1.0, 1.0)}, torch.tensor(1.0))
    assert _same(proj.projection_non_negative(tree), want)


def test_optax_box():
    lower, upper = 0.0, 2.0
    x = torch.tensor([-1.0, 2.0, 3.0])
    expected = torch.tensor([0.0, 2.0, 2.0])
    assert torch.equal(proj.projection_box(x, lower, upper), expected)
    assert torch.equal(proj.projection_box(x, torch.ones(3) * lower, torch.ones(3) * upper),
                       expected)
    assert _same(proj.projection_box((x, x), (lower, lower), (upper, upper)),
                 (expected, expected))
    tree = (torch.tensor(-1.0), {"k1": torch.tensor(2.0), "k2": _t(2.0, 3.0)}, torch.tensor(3.0))
    want = (torch.tensor(0.0), {"k1": torch.tensor(2.0), "k2": _t(2.0, 2.0)}, torch.tensor(2.0))
    lower_tree = (0.0, {"k1": 0.0, "k2": (0.0, 0.0)}, 0.0)
    upper_tree = (2.0, {"k1": 2.0, "k2": (2.0, 2.0)}, 2.0)
    assert _same(proj.projection_box(tree, lower_tree, upper_tree), want)
    # ftopt: a number bound applies to every leaf of a tree
    assert _same(proj.projection_box(tree, 0.0, 2.0), want)


def test_optax_hypercube():
    x = torch.tensor([-1.0, 2.0, 0.5])
    assert torch.equal(proj.projection_hypercube(x), torch.tensor([0.0, 1.0, 0.5]))
    expected = torch.tensor([0.0, 0.8, 0.5])
    assert torch.equal(proj.projection_hypercube(x, 0.8), expected)
    assert torch.equal(proj.projection_hypercube(x, torch.ones(3) * 0.8), expected)


@pytest.mark.parametrize("scale", [1.0, 0.8])
def test_optax_simplex_array_pytree_and_edge_case(scale):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, generator=gen)
    p = proj.projection_simplex(x, scale)
    assert float(p.sum()) == pytest.approx(scale, abs=1e-4)
    assert bool((p >= 0).all()) and bool((p <= scale).all())
    new = proj.projection_simplex({"w": torch.tensor([2.5, 3.2]), "b": torch.tensor(0.5)},
                                  scale)
    assert float(_vec(new).sum()) == pytest.approx(scale, abs=1e-4)
    edge = proj.projection_simplex(torch.tensor([0.0, 0.0, -math.inf]), scale)
    torch.testing.assert_close(edge, torch.tensor([scale / 2, scale / 2, 0.0]))


def _simplex_jacobian(p: torch.Tensor) -> torch.Tensor:
    support = (p > 0).to(p.dtype)
    return torch.diag(support) - torch.outer(support, support) / support.sum()


def test_optax_simplex_jacobian():
    gen = torch.Generator().manual_seed(0)
    x, v = torch.rand(5, generator=gen), torch.randn(5, generator=gen)
    f = proj.projection_simplex
    jac_true = _simplex_jacobian(f(x))
    assert 1 < int((f(x) > 0).sum()) < 5  # the support is neither a vertex nor everything
    torch.testing.assert_close(jacfwd(f)(x), jac_true)
    torch.testing.assert_close(jacrev(f)(x), jac_true)
    tangent = jvp(f, (x,), (v,))[1]
    eps = 1e-3
    torch.testing.assert_close(tangent, (f(x + eps * v) - f(x - eps * v)) / (2 * eps),
                               atol=1e-3, rtol=0)
    torch.testing.assert_close(vjp(f, x)[1](v)[0], v @ jac_true)
    torch.testing.assert_close(tangent, jac_true @ v)


@pytest.mark.parametrize("scale", [1.0, 0.8])
def test_optax_simplex_vmap(scale):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, generator=gen)
    scales = torch.full((3,), scale)
    p = vmap(proj.projection_simplex)(x, scales)
    torch.testing.assert_close(p.sum(1), scales)
    assert bool((p >= 0).all()) and bool((p <= scale).all())


_A1 = torch.tensor([0.5, 2.1, -3.5])
DATA = {"array_1d": _A1, "array_2d": torch.tensor([[0.5, 2.1, -3.5], [1.0, 2.0, 3.0]]),
        "tree": (_A1, _A1)}


def _norm(tree, ord):
    v = _vec(tree)
    return float(torch.linalg.vector_norm(v, ord))


NORMS = {"l1": (proj.projection_l1_ball, 1), "l2": (proj.projection_l2_ball, 2),
         "linf": (proj.projection_linf_ball, math.inf)}


@pytest.mark.parametrize("data_key", sorted(DATA))
@pytest.mark.parametrize("scale", [1.0, 3.21])
def test_optax_spheres(data_key, scale):
    x = DATA[data_key]
    assert _norm(proj.projection_l1_sphere(x, scale), 1) == pytest.approx(scale, abs=1e-4)
    assert _norm(proj.projection_l2_sphere(x, scale), 2) == pytest.approx(scale, abs=1e-4)


@pytest.mark.parametrize("data_key", sorted(DATA))
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_optax_balls(data_key, norm):
    fn, order = NORMS[norm]
    x = DATA[data_key]
    value = _norm(x, order)
    _close(fn(x, 2 * value), x)        # inside: unchanged
    _close(fn(x, value), x)            # on the boundary: unchanged
    assert _norm(fn(x, value / 2), order) == pytest.approx(value / 2, abs=1e-4)


@pytest.mark.parametrize("fn", [proj.projection_l2_ball, proj.projection_l1_ball])
def test_optax_ball_gradient_at_zero(fn):
    g = grad(fn)(torch.tensor(0.0))
    assert not torch.isnan(g) and float(g) == 1.0
    x = torch.tensor(0.0, requires_grad=True)
    fn(x).backward()
    assert float(x.grad) == 1.0


def test_optax_vector_hyperplane_halfspace():
    x, a = _t(1.0, 2.0), _t(3.0, 4.0)
    _close(proj.projection_vector(x, a), (33 / 25, 44 / 25))
    _close(proj.projection_hyperplane(x, a, 5.0), (7 / 25, 26 / 25))
    _close(proj.projection_halfspace(x, a, 5.0), (7 / 25, 26 / 25))
    inside = _t(1.0, -2.0)
    assert _same(proj.projection_halfspace(inside, a, 5.0), inside)


def test_optax_docstring_examples():
    data = {"w": torch.tensor([2.5, 3.2]), "b": torch.tensor(0.5)}
    assert float(_vec(data).sum()) == pytest.approx(6.2)
    for fn in (proj.projection_simplex, proj.projection_l1_ball):
        new = fn(data)
        assert float(_vec(new).abs().sum()) == pytest.approx(1.0, abs=1e-6)
        # sorted 3.2, 2.5, 0.5: two in the support, τ = (5.7 − 1)/2 = 2.35
        _close(new, {"w": torch.tensor([0.15, 0.85]), "b": torch.tensor(0.0)})


# --- float64: the argmin over the set ----------------------------------------------------

class Case(NamedTuple):
    project: object   # tree -> projected tree
    sample: object    # (gen, m) -> m feasible points, rows of an (m, n) float64 tensor
    violation: object  # vector -> how far it is from the set (0 inside)
    convex: bool = True


def _rand(gen, *shape):
    return torch.rand(*shape, generator=gen, dtype=F64)


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=F64)


def _dirichlet(gen, m, n):
    e = -torch.log(_rand(gen, m, n))
    return e / e.sum(1, keepdim=True)


def _cases(gen, x, to=None) -> dict[str, Case]:
    """The sets, their parameters drawn from ``gen``; ``to`` moves the tree parameters (a
    normal, box bounds) as the ``x`` given to ``project`` is moved."""
    to = to or (lambda t: t)
    xv = _vec(x)
    n = xv.numel()
    s = 0.5 + 2 * float(_rand(gen, ()))
    lo, hi = -2 * _rand(gen, n), 2 * _rand(gen, n)
    lo_tree, hi_tree = ftopt.tree.map(to, _unvec(lo, x)), ftopt.tree.map(to, _unvec(hi, x))
    a = _unvec(_randn(gen, n), x)
    a_moved = ftopt.tree.map(to, a)
    av = _vec(a_moved)
    b = float(_randn(gen, ()))
    aa = float(av @ av)

    def box_viol(p, low, high):
        return float(torch.maximum(low - p, p - high).clamp(min=0).max())

    def in_halfspace(gen, m):
        z = 3 * _randn(gen, m, n)
        z = z - ((z @ av - b).clamp(min=0) / aa)[:, None] * av
        return z - _rand(gen, m, 1) * av

    def on_plane(gen, m):
        z = 3 * _randn(gen, m, n)
        return z + ((b - z @ av) / aa)[:, None] * av

    def on_sphere(gen, m, p, order):
        z = torch.cat([_randn(gen, m, n), p + 0.01 * _randn(gen, m, n)])
        if order == 1:
            z = torch.cat([z, torch.sign(xv) * _dirichlet(gen, m, n)])
        return s * z / torch.linalg.vector_norm(z, order, dim=1, keepdim=True)

    def l_ball(gen, m, order):
        z = torch.cat([_randn(gen, m, n), torch.eye(n, dtype=F64), -torch.eye(n, dtype=F64)])
        z = z / torch.linalg.vector_norm(z, order, dim=1, keepdim=True)
        return s * z * torch.cat([_rand(gen, m, 1), torch.ones(2 * n, 1, dtype=F64)])

    def norm(p, order):
        return float(torch.linalg.vector_norm(p, order))

    return {
        "non_negative": Case(proj.projection_non_negative, lambda g, m: 5 * _rand(g, m, n),
                             lambda p: float((-p).clamp(min=0).max())),
        "box": Case(lambda t: proj.projection_box(t, lo_tree, hi_tree),
                    lambda g, m: lo + _rand(g, m, n) * (hi - lo),
                    lambda p: box_viol(p, lo, hi)),
        "hypercube": Case(lambda t: proj.projection_hypercube(t, s),
                          lambda g, m: s * _rand(g, m, n),
                          lambda p: box_viol(p, torch.zeros(n, dtype=F64), s)),
        "linf_ball": Case(lambda t: proj.projection_linf_ball(t, s),
                          lambda g, m: s * (2 * _rand(g, m, n) - 1),
                          lambda p: max(norm(p, math.inf) - s, 0.0)),
        "simplex": Case(lambda t: proj.projection_simplex(t, s),
                        lambda g, m: s * torch.cat([_dirichlet(g, m, n),
                                                    torch.eye(n, dtype=F64)]),
                        lambda p: max(float((-p).clamp(min=0).max()),
                                      abs(float(p.sum()) - s))),
        "l1_ball": Case(lambda t: proj.projection_l1_ball(t, s), lambda g, m: l_ball(g, m, 1),
                        lambda p: max(norm(p, 1) - s, 0.0)),
        "l2_ball": Case(lambda t: proj.projection_l2_ball(t, s), lambda g, m: l_ball(g, m, 2),
                        lambda p: max(norm(p, 2) - s, 0.0)),
        "halfspace": Case(lambda t: proj.projection_halfspace(t, a_moved, b), in_halfspace,
                          lambda p: max(float(p @ av) - b, 0.0)),
        "hyperplane": Case(lambda t: proj.projection_hyperplane(t, a_moved, b), on_plane,
                           lambda p: abs(float(p @ av) - b)),
        "vector": Case(lambda t: proj.projection_vector(t, a_moved),
                       lambda g, m: 3 * _randn(g, m, 1) * av,
                       lambda p: norm(p - float(p @ av) / aa * av, 2)),
        "l1_sphere": Case(lambda t: proj.projection_l1_sphere(t, s),
                          lambda g, m: on_sphere(g, m, _vec(proj.projection_l1_sphere(x, s)), 1),
                          lambda p: abs(norm(p, 1) - s), convex=False),
        "l2_sphere": Case(lambda t: proj.projection_l2_sphere(t, s),
                          lambda g, m: on_sphere(g, m, _vec(proj.projection_l2_sphere(x, s)), 2),
                          lambda p: abs(norm(p, 2) - s), convex=False),
    }


CASE_NAMES = sorted(_cases(torch.Generator().manual_seed(0),
                           _tree(torch.Generator().manual_seed(0))))
assert len(CASE_NAMES) == len(proj.__all__)
TOL = 1e-9


def _optimality_gap(case: Case, x, p, gen, also=None) -> float:
    """max over sampled feasible y (and the rows of ``also``) of ⟨x − p, y − p⟩ (convex
    sets: <= 0 at the argmin) or of ‖x − p‖ − ‖x − y‖ (the spheres: <= 0 at the argmin)."""
    xv, pv = _vec(x), _vec(p)
    ys = case.sample(gen, 400)
    ys = ys if also is None else torch.cat([ys, also])
    assert max(case.violation(y) for y in ys) < 1e-9, "the sampler left the set"
    if case.convex:
        return float(((ys - pv) @ (xv - pv)).max())
    return float(torch.linalg.vector_norm(xv - pv) - torch.linalg.vector_norm(xv - ys, dim=1)
                 .min())


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("name", CASE_NAMES)
def test_argmin_over_the_set_float64(name, seed):
    gen = torch.Generator().manual_seed(seed)
    x = _tree(gen)
    case = _cases(gen, x)[name]
    before = _copy(x)
    p = case.project(x)
    assert _same(x, before), "the input was modified"
    assert ftopt.tree.structure(p) == ftopt.tree.structure(x) and p["none"] is None
    assert all(t.dtype == F64 for t in ftopt.tree.leaves(p))
    assert case.violation(_vec(p)) < TOL
    assert _optimality_gap(case, x, p, gen) < TOL
    again = case.project(p)      # idempotent: a point of the set is its own projection
    _close(again, p, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", ["l2_ball", "simplex", "box"])
def test_the_optimality_check_can_fail(name):
    # a feasible point that is not the projection fails the inequality (for y = the
    # projection at least)
    gen = torch.Generator().manual_seed(5)
    x = _tree(gen)
    case = _cases(gen, x)[name]
    p = _vec(case.project(x))
    centre = {"l2_ball": torch.zeros_like(p), "simplex": torch.full_like(p, p.sum() / p.numel()),
              "box": torch.full_like(p, float(p.mean()))}[name]
    wrong = _unvec(0.9 * p + 0.1 * centre, x)
    assert case.violation(_vec(wrong)) < TOL
    assert _optimality_gap(case, x, wrong, gen, also=p[None]) > 1e-3


def _simplex_by_bisection(v: torch.Tensor, s: float) -> torch.Tensor:
    """argmin over the simplex: max(v − τ, 0) with Σ max(v − τ, 0) = s, τ by bisection."""
    low, high = float(v.min()) - s, float(v.max())
    for _ in range(200):
        tau = (low + high) / 2
        low, high = (tau, high) if float((v - tau).clamp(min=0).sum()) > s else (low, tau)
    return (v - (low + high) / 2).clamp(min=0)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("scale", [1.0, 0.3, 17.0])
def test_simplex_and_l1_against_bisection(seed, scale):
    gen = torch.Generator().manual_seed(seed)
    x = _tree(gen)
    v = _vec(x)
    want = _simplex_by_bisection(v, scale)
    assert 1 <= int((want > 0).sum()) < v.numel()
    torch.testing.assert_close(_vec(proj.projection_simplex(x, scale)), want, atol=1e-12,
                               rtol=0)
    sphere = torch.sign(v) * _simplex_by_bisection(v.abs(), scale)
    torch.testing.assert_close(_vec(proj.projection_l1_sphere(x, scale)), sphere, atol=1e-12,
                               rtol=0)
    inside = v.abs().sum() <= scale
    torch.testing.assert_close(_vec(proj.projection_l1_ball(x, scale)),
                               v if inside else sphere, atol=1e-12, rtol=0)


def test_closed_forms_float64():
    gen = torch.Generator().manual_seed(7)
    x, a = _tree(gen), _tree(gen, 1.0)
    v, av = _vec(x), _vec(a)
    norm = torch.linalg.vector_norm(v)
    for s in (0.5, float(norm) * 2):
        torch.testing.assert_close(_vec(proj.projection_l2_ball(x, s)),
                                   v * min(1.0, s / float(norm)), atol=1e-13, rtol=0)
        torch.testing.assert_close(_vec(proj.projection_l2_sphere(x, s)), v * s / norm)
        torch.testing.assert_close(_vec(proj.projection_linf_ball(x, s)), v.clamp(-s, s))
    b = float(v @ av) + 1.0   # x inside the halfspace: unchanged
    assert _same(proj.projection_halfspace(x, a, b), x)
    on = proj.projection_hyperplane(x, a, b)
    assert float(_vec(on) @ av) == pytest.approx(b, abs=1e-12)
    torch.testing.assert_close(_vec(proj.projection_vector(x, a)), (v @ av) / (av @ av) * av)


# --- dtypes, devices, pytrees ------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", CASE_NAMES)
def test_dtypes_and_devices(name, dtype, device):
    x = _tree(torch.Generator().manual_seed(11))

    def moved(t):
        return t.to(device, dtype)

    case = _cases(torch.Generator().manual_seed(12), x, moved)[name]
    reference = _cases(torch.Generator().manual_seed(12), x,
                       lambda t: moved(t).to("cpu", F64))[name]
    x_moved = ftopt.tree.map(moved, x)
    before = _copy(x_moved)
    p = case.project(x_moved)
    assert _same(x_moved, before)
    assert all(t.dtype == dtype and t.device.type == device for t in ftopt.tree.leaves(p))
    want = reference.project(ftopt.tree.map(lambda t: t.to("cpu", F64), x_moved))
    tol = 1e-12 if dtype == F64 else 2e-5
    torch.testing.assert_close(_vec(p).cpu(), _vec(want), atol=tol * 10, rtol=tol)


def test_whole_tree_ops_mix_dtypes_in_the_widest():
    gen = torch.Generator().manual_seed(3)
    tree = {"h": torch.randn(6, generator=gen).to(torch.bfloat16),
            "f": torch.randn(4, generator=gen), "d": torch.randn(3, generator=gen, dtype=F64)}
    flat = _vec(tree)   # the values as given, in float64
    for fn in (proj.projection_simplex, proj.projection_l2_sphere, proj.projection_l1_ball):
        out = fn(tree, 0.7)
        assert {k: v.dtype for k, v in out.items()} == {k: v.dtype for k, v in tree.items()}
        want = fn({"all": flat}, 0.7)["all"]   # one float64 vector
        parts = dict(zip(["d", "f", "h"], torch.split(want, [3, 4, 6])))  # optree sorts keys
        for k in tree:
            torch.testing.assert_close(out[k], parts[k].to(tree[k].dtype))


class Pair(NamedTuple):
    left: torch.Tensor
    right: list


def test_pytree_kinds_and_none_subtrees():
    gen = torch.Generator().manual_seed(4)
    leaves = [torch.randn(3, generator=gen, dtype=F64) for _ in range(3)]
    tree = Pair(leaves[0], [leaves[1], None, (leaves[2],)])
    flat = torch.cat(leaves)
    for name in ("simplex", "l1_sphere", "l2_ball", "non_negative", "linf_ball"):
        fn = getattr(proj, f"projection_{name}")
        out = fn(tree) if name == "non_negative" else fn(tree, 0.9)
        assert isinstance(out, Pair) and out.right[1] is None
        assert ftopt.tree.structure(out) == ftopt.tree.structure(tree)
        whole = fn(flat) if name == "non_negative" else fn(flat, 0.9)
        torch.testing.assert_close(_vec(out), whole)
    assert proj.projection_non_negative(None) is None
    assert proj.projection_l2_ball({}) == {}
    assert proj.projection_box([], 0.0, 1.0) == []


def test_tensor_bounds_broadcast_per_leaf():
    x = {"m": torch.tensor([[-2.0, 0.5, 3.0], [1.0, -1.0, 9.0]]), "v": torch.tensor([4.0, -4.0])}
    lower = {"m": torch.tensor([0.0, 0.0, 1.0]), "v": -1.0}     # a row bound broadcasts
    upper = {"m": torch.tensor([[2.0], [0.5]]), "v": torch.tensor(1.0)}
    out = proj.projection_box(x, lower, upper)
    assert torch.equal(out["m"], torch.tensor([[0.0, 0.5, 2.0], [0.5, 0.0, 0.5]]))
    assert torch.equal(out["v"], torch.tensor([1.0, -1.0]))
    # open sides and lower > upper (the result is upper, as jnp.clip)
    assert torch.equal(proj.projection_box(x["v"], -math.inf, 2.0), torch.tensor([2.0, -4.0]))
    assert torch.equal(proj.projection_box(x["v"], 3.0, 1.0), torch.tensor([1.0, 1.0]))


# --- autograd and torch.func -------------------------------------------------------------

def _flat_fn(case: Case, like):
    return lambda v: _vec(case.project(_unvec(v, like)))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_jacobians_gradcheck_and_vmap(name):
    gen = torch.Generator().manual_seed(21)
    x = {"w": 2 * torch.randn(2, 3, generator=gen, dtype=F64),
         "b": 2 * torch.randn(2, generator=gen, dtype=F64)}
    case = _cases(gen, x)[name]
    f = _flat_fn(case, x)
    v = _vec(x)
    j_rev, j_fwd = jacrev(f)(v), jacfwd(f)(v)
    torch.testing.assert_close(j_rev, j_fwd)
    torch.testing.assert_close(j_rev, torch.autograd.functional.jacobian(f, v))
    assert torch.autograd.gradcheck(f, (v.clone().requires_grad_(),))
    batch = 2 * torch.randn(4, v.numel(), generator=gen, dtype=F64)
    torch.testing.assert_close(vmap(f)(batch), torch.stack([f(r) for r in batch]))
    # through a pytree, torch.func.grad of a scalar loss matches autograd
    w = torch.randn(v.numel(), generator=gen, dtype=F64)
    g = grad(lambda t: _vec(case.project(t)) @ w)(x)
    leaf = ftopt.tree.map(lambda t: t.clone().requires_grad_(), x)
    (_vec(case.project(leaf)) @ w).backward()
    _close(g, ftopt.tree.map(lambda t: t.grad, leaf))


def test_abs_has_jax_derivative_at_zero():
    # |x|' = 1 at 0 as in JAX, so optax's Jacobian of the l1 sphere: sign(xᵢ)·Jᵢⱼ·|xⱼ|'
    # with J = I − 11ᵀ/3 (all three in the support) gives −1/3 in column 0
    x = torch.tensor([0.0, 0.2, 0.1], dtype=F64)
    torch.testing.assert_close(proj.projection_l1_sphere(x),
                               torch.tensor([0.0, 0.2 + 0.7 / 3, 0.1 + 0.7 / 3], dtype=F64))
    want = torch.tensor([[0.0, 0.0, 0.0], [-1 / 3, 2 / 3, -1 / 3], [-1 / 3, -1 / 3, 2 / 3]],
                        dtype=F64)
    torch.testing.assert_close(jacrev(proj.projection_l1_sphere)(x), want)
    torch.testing.assert_close(jacfwd(proj.projection_l1_sphere)(x), want)


def test_simplex_jacobian_over_a_tree():
    gen = torch.Generator().manual_seed(8)
    x = {"a": torch.rand(3, generator=gen, dtype=F64), "b": torch.rand(4, generator=gen,
                                                                         dtype=F64)}
    f = _flat_fn(Case(proj.projection_simplex, None, None), x)
    p = f(_vec(x))
    assert 1 < int((p > 0).sum()) < 7
    torch.testing.assert_close(jacrev(f)(_vec(x)), _simplex_jacobian(p))


@pytest.mark.parametrize("fn,args", [
    (proj.projection_simplex, ()), (proj.projection_l1_sphere, ()),
    (proj.projection_l1_ball, ()), (proj.projection_l2_sphere, ()),
    (proj.projection_l2_ball, ()), (proj.projection_linf_ball, ()),
    (proj.projection_hypercube, ()),
])
def test_differentiable_in_the_scale_and_vmapped_over_it(fn, args):
    gen = torch.Generator().manual_seed(9)
    x = 2 * torch.randn(7, generator=gen, dtype=F64)
    s = torch.tensor(1.3, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s: fn(x, s), (s,))
    scales = torch.tensor([0.4, 1.1, 2.5], dtype=F64)
    torch.testing.assert_close(vmap(lambda s: fn(x, s))(scales),
                               torch.stack([fn(x, float(s)) for s in scales]))


def test_differentiable_in_the_normal_offset_and_bounds():
    gen = torch.Generator().manual_seed(10)
    x, a = torch.randn(5, generator=gen, dtype=F64), torch.randn(5, generator=gen, dtype=F64)
    b = (x @ a - 1.0).detach().requires_grad_()     # x outside: the halfspace is active
    a.requires_grad_()
    for fn in (proj.projection_hyperplane, proj.projection_halfspace):
        assert torch.autograd.gradcheck(lambda a, b, fn=fn: fn(x, a, b), (a, b))
    assert torch.autograd.gradcheck(lambda a: proj.projection_vector(x, a), (a,))
    lo = (-0.5 * torch.rand(5, generator=gen, dtype=F64)).requires_grad_()
    hi = (0.5 * torch.rand(5, generator=gen, dtype=F64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda lo, hi: proj.projection_box(x, lo, hi), (lo, hi))


# --- bad input ---------------------------------------------------------------------------

ERRORS = [
    (lambda: proj.projection_simplex({"w": torch.ones(2), "b": 0.5}), TypeError,
     r"projection_simplex: tree at \['b'\]: expected a tensor, got float"),
    (lambda: proj.projection_l2_ball({"w": torch.ones(2, dtype=torch.int64)}), TypeError,
     r"projection_l2_ball: tree at \['w'\]: expected a real floating-point tensor"),
    (lambda: proj.projection_non_negative([torch.ones(2, dtype=torch.complex64)]), TypeError,
     r"projection_non_negative: tree at \[0\]: expected a real floating-point tensor"),
    (lambda: proj.projection_l1_ball({"s": torch.ones(3).to_sparse()}), TypeError,
     r"projection_l1_ball: tree at \['s'\]: expected a dense tensor"),
    (lambda: proj.projection_simplex(torch.ones(3), -1.0), ValueError,
     r"projection_simplex: scale must be > 0, got -1.0"),
    (lambda: proj.projection_l2_sphere(torch.ones(3), 0), ValueError,
     r"projection_l2_sphere: scale must be > 0"),
    (lambda: proj.projection_l1_sphere(torch.ones(3), math.nan), ValueError,
     r"projection_l1_sphere: scale must be finite"),
    (lambda: proj.projection_l2_ball(torch.ones(3), True), TypeError,
     r"projection_l2_ball: scale must be a number or a 0-d real tensor, got bool"),
    (lambda: proj.projection_l1_ball(torch.ones(3), torch.ones(2)), ValueError,
     r"projection_l1_ball: scale must be a number or a 0-d real tensor, got a tensor of "
     r"shape \(2,\)"),
    (lambda: proj.projection_linf_ball(torch.ones(3), -0.1), ValueError,
     r"projection_linf_ball: scale must be >= 0"),
    (lambda: proj.projection_box({"w": torch.ones(2), "b": torch.ones(1)}, {"w": 0.0}, 1.0),
     ValueError, r"projection_box: lower does not match the projected tree: missing \['b'\]"),
    (lambda: proj.projection_box({"w": torch.ones(3)}, 0.0, {"w": torch.ones(4)}), ValueError,
     r"projection_box: upper at \['w'\] has shape \(4,\), which does not broadcast"),
    (lambda: proj.projection_box({"w": torch.ones(3)}, {"w": math.nan}, 1.0), ValueError,
     r"projection_box: lower at \['w'\] is nan"),
    (lambda: proj.projection_box({"w": torch.ones(3)}, 0.0, {"w": "1"}), TypeError,
     r"projection_box: upper at \['w'\]: expected a real number or tensor, got str"),
    (lambda: proj.projection_hypercube([torch.ones(3), torch.ones(2)], [1.0]), ValueError,
     r"projection_hypercube: scale does not match the projected tree"),
    (lambda: proj.projection_vector({"w": torch.ones(3)}, {"v": torch.ones(3)}), ValueError,
     r"projection_vector: a does not match the x tree"),
    (lambda: proj.projection_hyperplane({"w": torch.ones(3)}, {"w": torch.ones(2)}, 1.0),
     ValueError, r"projection_hyperplane: a at \['w'\] has shape \(2,\), x has \(3,\)"),
    (lambda: proj.projection_halfspace({"w": torch.ones(3)}, {"w": 1.0}, 1.0), TypeError,
     r"projection_halfspace: a at \['w'\]: expected a tensor, got float"),
    (lambda: proj.projection_halfspace({"w": torch.ones(3)}, {"w": torch.ones(3)}, math.inf),
     ValueError, r"projection_halfspace: b must be finite"),
    (lambda: proj.projection_l2_sphere({"a": torch.ones(2), "b": torch.ones(2, device="meta")}),
     ValueError, r"projection_l2_sphere: tree at \['b'\] is on meta, expected cpu"),
    (lambda: proj.projection_vector([torch.ones(2)], [torch.ones(2, device="meta")]),
     ValueError, r"projection_vector: a at \[0\] is on meta, expected cpu"),
    (lambda: proj.projection_simplex({"w": torch.ones(0)}), ValueError,
     r"projection_simplex: tree has no elements"),
]


@pytest.mark.parametrize("index", range(len(ERRORS)))
def test_bad_input_names_the_argument(index):
    call, kind, message = ERRORS[index]
    with pytest.raises(kind, match=message):
        call()


# --- projected gradient descent with ftopt optimizers -----------------------------------

def test_projected_sgd_on_the_simplex_reaches_the_constrained_optimum():
    # min Σ wᵢ pᵢ² over the probability simplex (all leaves together): pᵢ ∝ 1/wᵢ
    gen = torch.Generator().manual_seed(0)
    weights = {"a": 1 + 2 * torch.rand(3, generator=gen, dtype=F64),
               "b": 1 + 2 * torch.rand(2, 2, generator=gen, dtype=F64)}

    def loss(params):
        return sum((w * p * p).sum() for w, p in zip(ftopt.tree.leaves(weights),
                                                       ftopt.tree.leaves(params)))

    params = proj.projection_simplex(ftopt.tree.map(
        lambda w: torch.randn(w.shape, generator=gen, dtype=F64), weights))
    tx = ftopt.sgd(learning_rate=0.1)
    state = tx.init(params)
    for _ in range(300):
        updates, state = tx.update(grad(loss)(params), state, params)
        params = proj.projection_simplex(ftopt.apply_updates(params, updates))
    inverse = ftopt.tree.map(lambda w: 1 / w, weights)
    optimum = ftopt.tree.map(lambda r: r / _vec(inverse).sum(), inverse)
    _close(params, optimum, atol=1e-12, rtol=0)


def test_projected_sgd_nonnegative_least_squares_reaches_the_kkt_point():
    # min ½‖A p − y‖² s.t. p >= 0, with y built so that p* (some coordinates 0, their
    # gradient > 0; the others > 0, their gradient 0) satisfies KKT, A of full rank
    gen = torch.Generator().manual_seed(1)
    q, _ = torch.linalg.qr(torch.randn(6, 6, generator=gen, dtype=F64))
    a = q * (1 + torch.rand(6, generator=gen, dtype=F64))      # singular values in [1, 2]
    p_star = torch.tensor([1.5, 0.0, 0.7, 0.0, 2.0, 0.3], dtype=F64)
    g_star = torch.tensor([0.0, 0.8, 0.0, 1.3, 0.0, 0.0], dtype=F64)
    y = a @ p_star - torch.linalg.solve(a.T, g_star)
    tx = ftopt.sgd(learning_rate=0.2, momentum=0.3)
    params = {"p": torch.randn(6, generator=gen, dtype=F64)}
    state = tx.init(params)
    for _ in range(400):
        grads = {"p": a.T @ (a @ params["p"] - y)}
        params, state = ftopt.step(tx, params, grads, state, backend="eager")
        params = proj.projection_non_negative(params)
    torch.testing.assert_close(params["p"], p_star, atol=1e-10, rtol=0)
