"""optax's linear-algebra utilities (``power_iteration``, ``matrix_inverse_pth_root``,
``nnls``) against torch.linalg in float64, optax's own tests and docstring examples, and
float64 transcriptions of optax's loops."""

from __future__ import annotations

import math

import pytest
import torch

import ftopt
from ftopt.linear_algebra import get_spectral_radius_upper_bound

F64 = torch.float64


def _psd(n: int, seed: int, dtype=F64) -> torch.Tensor:
    x = torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=F64)
    return (x @ x.T).to(dtype)


def _aligned(v: torch.Tensor) -> torch.Tensor:
    return v * torch.sign(v[0])


# ----------------------------------------------------------------------------------------
# power_iteration


def test_power_iteration_diagonal_example():
    eig, vec = ftopt.power_iteration(torch.tensor([[2.0, 0.0], [0.0, 1.0]]))
    assert float(eig) == pytest.approx(2.0, abs=1e-5)
    assert torch.allclose(_aligned(vec), torch.tensor([1.0, 0.0]), atol=1e-3)


@pytest.mark.parametrize("implicit", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_power_iteration_matches_eigh(implicit, dtype):
    # optax's test_power_iteration: a random 6x6 PSD matrix, v0 = ones, tol 1e-3
    matrix = _psd(6, 0, dtype)
    v0 = torch.ones(6, dtype=dtype)
    tol = 1e-3
    target = (lambda v: matrix @ v) if implicit else matrix
    eig, vec = ftopt.power_iteration(target, v0=v0, error_tolerance=tol, num_iters=100)
    w, V = torch.linalg.eigh(matrix.to(F64))
    assert eig.dtype == dtype and vec.dtype == dtype and vec.shape == (6,)
    assert float(eig) == pytest.approx(float(w[-1]), abs=10 * tol)
    assert torch.allclose(_aligned(vec).to(F64), _aligned(V[:, -1]), atol=1.5e-3)


def test_power_iteration_float64_tight():
    matrix = _psd(12, 1)
    eig, vec = ftopt.power_iteration(matrix, num_iters=5000, error_tolerance=1e-13, key=3)
    w, V = torch.linalg.eigh(matrix)
    assert float(eig) == pytest.approx(float(torch.linalg.eigvalsh(matrix)[-1]), rel=1e-11)
    assert torch.allclose(_aligned(vec), _aligned(V[:, -1]), atol=1e-6)
    assert float(torch.linalg.vector_norm(vec)) == pytest.approx(1.0, rel=1e-14)


def test_power_iteration_dominant_eigenvalue_in_modulus_may_be_negative():
    q, _ = torch.linalg.qr(torch.randn(5, 5, dtype=F64,
                                       generator=torch.Generator().manual_seed(2)))
    matrix = q @ torch.diag(torch.tensor([-4.0, 2.0, 1.0, 0.5, -0.1], dtype=F64)) @ q.T
    eig, vec = ftopt.power_iteration(matrix, num_iters=2000, error_tolerance=1e-12)
    assert float(eig) == pytest.approx(-4.0, rel=1e-10)
    assert torch.allclose(matrix @ vec, -4.0 * vec, atol=1e-8)


def test_power_iteration_hermitian_complex():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 5, dtype=torch.complex128, generator=gen)
    matrix = x @ x.mH
    eig, vec = ftopt.power_iteration(matrix, num_iters=5000, error_tolerance=1e-13)
    lam = float(torch.linalg.eigvalsh(matrix)[-1])
    assert eig.dtype == torch.complex128
    assert eig.real.item() == pytest.approx(lam, rel=1e-10) and abs(eig.imag.item()) < 1e-9
    assert torch.allclose(matrix @ vec, lam * vec, atol=1e-6)


def test_power_iteration_pytree():
    # optax's test_power_iteration_pytree: a block-diagonal product on a dict
    def product(x):
        return {"a": 2 * x["a"], "b": x["b"]}

    v0 = {"a": torch.ones(6), "b": torch.ones(6)}
    eig, vec = ftopt.power_iteration(product, v0=v0, error_tolerance=1e-3, num_iters=100)
    assert float(eig) == pytest.approx(2.0, abs=1e-2)
    assert set(vec) == {"a", "b"}
    assert torch.allclose(vec["a"], torch.full((6,), 6 ** -0.5), atol=1e-3)
    assert float(vec["b"].abs().max()) < 1e-3


def _mlp(params: dict, x: torch.Tensor) -> torch.Tensor:
    h = torch.nn.functional.gelu(x @ params["w0"].T + params["b0"])
    h = torch.nn.functional.gelu(h @ params["w1"].T + params["b1"])
    return h @ params["w2"].T + params["b2"]


def test_power_iteration_mlp_hessian():
    # optax's test_power_iteration_mlp_hessian: a Hessian-vector product over an MLP's
    # params (a pytree) against eigh of the flattened Hessian
    gen = torch.Generator().manual_seed(0)
    sizes = [(8, 6), (5, 8), (3, 5)]
    params = {}
    for i, (o, n) in enumerate(sizes):
        params[f"w{i}"] = torch.randn(o, n, dtype=F64, generator=gen) / math.sqrt(n)
        params[f"b{i}"] = 0.1 * torch.randn(o, dtype=F64, generator=gen)
    x = torch.randn(6, dtype=F64, generator=gen)
    y = torch.randn(3, dtype=F64, generator=gen)

    def loss(p):
        return ((_mlp(p, x) - y) ** 2).sum()

    def hvp(t):
        return torch.func.jvp(torch.func.grad(loss), (params,), (t,))[1]

    ones = {k: torch.ones_like(v) for k, v in params.items()}
    eig, vec = ftopt.power_iteration(hvp, v0=ones, num_iters=3000, error_tolerance=1e-12)
    keys = list(params)
    shapes = [params[k].shape for k in keys]

    def flat_loss(flat):
        chunks = torch.split(flat, [math.prod(s) for s in shapes])
        return loss({k: c.reshape(s) for k, c, s in zip(keys, chunks, shapes)})

    hessian = torch.autograd.functional.hessian(
        flat_loss, torch.cat([params[k].reshape(-1) for k in keys]))
    w, V = torch.linalg.eigh(hessian)
    top = int(w.abs().argmax())
    assert float(eig) == pytest.approx(float(w[top]), rel=1e-8)
    flat_vec = torch.cat([vec[k].reshape(-1) for k in keys])
    assert torch.allclose(_aligned(flat_vec), _aligned(V[:, top]), atol=1e-5)


def test_power_iteration_stops_once_the_residual_is_small():
    # optax's test_power_iteration_cond_fun: given the exact dominant eigenvector the loop
    # stops after one iteration (λ starts at 0, so the first test never stops it)
    matrix = _psd(6, 0)
    w, V = torch.linalg.eigh(matrix)
    calls = []

    def product(v):
        calls.append(1)
        return matrix @ v

    eig, vec = ftopt.power_iteration(product, v0=V[:, -1].clone(), error_tolerance=1e-3)
    assert len(calls) == 2 and float(eig) == pytest.approx(float(w[-1]), rel=1e-12)
    calls.clear()
    eig, vec = ftopt.power_iteration(product, v0=torch.ones(6, dtype=F64), num_iters=0)
    assert len(calls) == 1 and float(eig) == 0.0
    z = matrix @ torch.ones(6, dtype=F64)
    assert torch.allclose(vec, z / z.norm(), rtol=1e-14)


def test_power_iteration_default_v0_is_uniform_from_the_key():
    # num_iters=0 on the identity returns v0/|v0|: the draw itself
    eye = torch.eye(7, dtype=F64)
    _, vec = ftopt.power_iteration(eye, num_iters=0, key=5)
    v0 = 2 * torch.rand(7, generator=torch.Generator().manual_seed(5), dtype=F64) - 1
    assert torch.allclose(vec, v0 / torch.linalg.vector_norm(v0), rtol=1e-14, atol=0)
    _, default = ftopt.power_iteration(eye, num_iters=0)
    _, zero = ftopt.power_iteration(eye, num_iters=0, key=0)
    _, from_gen = ftopt.power_iteration(eye, num_iters=0,
                                        key=torch.Generator().manual_seed(0))
    _, from_tensor = ftopt.power_iteration(eye, num_iters=0, key=torch.tensor(0))
    assert torch.equal(default, zero) and torch.equal(default, from_gen)
    assert torch.equal(default, from_tensor) and not torch.equal(default, vec)


def test_power_iteration_is_deterministic_given_the_seed():
    matrix = _psd(9, 6)
    a = ftopt.power_iteration(matrix, num_iters=4, key=11)
    b = ftopt.power_iteration(matrix, num_iters=4, key=11)
    c = ftopt.power_iteration(matrix, num_iters=4, key=12)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1])


def test_power_iteration_leaves_its_inputs_alone():
    matrix, v0 = _psd(5, 7), torch.randn(5, dtype=F64)
    m0, v00 = matrix.clone(), v0.clone()
    ftopt.power_iteration(matrix, v0=v0)
    assert torch.equal(matrix, m0) and torch.equal(v0, v00)


@pytest.mark.parametrize("call,match", [
    (lambda: ftopt.power_iteration(lambda v: v), "v0 must be provided"),
    (lambda: ftopt.power_iteration(torch.ones(3, 4)), "matrix must be a square"),
    (lambda: ftopt.power_iteration(torch.ones(2, 3, 3)), "matrix must be a square"),
    (lambda: ftopt.power_iteration(torch.ones(3, 3, dtype=torch.int64)), "matrix must be a "
                                                                         "floating"),
    (lambda: ftopt.power_iteration(torch.eye(3), v0=torch.ones(4)), "v0 must be a tensor of "
                                                                     "shape \\(3,\\)"),
    (lambda: ftopt.power_iteration(lambda v: {"a": v["a"]},
                                   v0={"a": torch.ones(2), "b": torch.ones(2)}),
     "matrix-vector product does not match the v0 tree"),
    (lambda: ftopt.power_iteration(lambda v: {"a": v["a"][:1]}, v0={"a": torch.ones(2)}),
     "product at \\['a'\\] must be a tensor of v0's shape"),
    (lambda: ftopt.power_iteration(lambda v: v, v0={"a": torch.ones(2, dtype=torch.int32)}),
     "v0 at \\['a'\\] must be a floating"),
    (lambda: ftopt.power_iteration(lambda v: v, v0={}), "v0 holds no tensor"),
    (lambda: ftopt.power_iteration(torch.eye(3), num_iters=-1), "num_iters"),
    (lambda: ftopt.power_iteration(torch.eye(3), error_tolerance=-1.0), "error_tolerance"),
    (lambda: ftopt.power_iteration(torch.eye(3), precision="fast"), "precision"),
    (lambda: ftopt.power_iteration(torch.eye(3), key=-1), "key"),
    (lambda: ftopt.power_iteration(torch.eye(3), key=torch.tensor(1.0)), "key"),
])
def test_power_iteration_bad_inputs(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_power_iteration_bad_key_type():
    with pytest.raises(TypeError, match="power_iteration: key must be an int seed"):
        ftopt.power_iteration(torch.eye(3), key=1.5)


@pytest.mark.parametrize("precision", [None, "default", "HIGH", "highest", "tensorfloat32"])
def test_precision_is_accepted_and_changes_nothing(precision):
    matrix = _psd(4, 8, torch.float32)
    before = torch.get_float32_matmul_precision()
    a = ftopt.power_iteration(matrix, precision=precision)
    b = ftopt.power_iteration(matrix)
    assert torch.equal(a[0], b[0]) and torch.get_float32_matmul_precision() == before
    r1 = ftopt.matrix_inverse_pth_root(matrix, 2, precision=precision)
    r2 = ftopt.matrix_inverse_pth_root(matrix, 2)
    assert torch.equal(r1[0], r2[0])


# ----------------------------------------------------------------------------------------
# matrix_inverse_pth_root


def _root_by_eigh(matrix: torch.Tensor, p: int, ridge: float = 0.0) -> torch.Tensor:
    w, V = torch.linalg.eigh(matrix.to(F64))
    lam = float(w[-1])
    w = w + ridge * max(lam, 1e-16)
    return V @ torch.diag(w ** (-1.0 / p)) @ V.T


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
def test_pth_root_float64_matches_eigh(p):
    matrix = _psd(10, p) + 0.5 * torch.eye(10, dtype=F64)
    root, error = ftopt.matrix_inverse_pth_root(matrix, p, ridge_epsilon=1e-3,
                                                error_tolerance=1e-13)
    ref = _root_by_eigh(matrix, p, 1e-3)
    assert root.dtype == F64 and error.dtype == F64 and error.shape == ()
    assert float(error) < 1e-12
    assert torch.allclose(root, ref, rtol=0, atol=1e-10 * float(ref.abs().max()))
    # the defining property: root^p (A + εI) = I
    damped = matrix + 1e-3 * float(torch.linalg.eigvalsh(matrix)[-1]) * torch.eye(10,
                                                                                  dtype=F64)
    assert torch.allclose(torch.linalg.matrix_power(root, p) @ damped, torch.eye(10, dtype=F64),
                          atol=1e-9)


def _ortho(n: int, seed: int) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, n, dtype=F64,
                                       generator=torch.Generator().manual_seed(seed)))
    return q * torch.sign(torch.diagonal(r))


@pytest.mark.parametrize("e", range(2, 12))
def test_pth_root_conditioning(e):
    # optax's test_matrix_inverse_pth_root: 16x16, condition number 10^e, float32, p = 4,
    # error < 0.1 guaranteed below 10^7 only
    u = _ortho(16, e)
    cond = 10.0 ** e
    ms = u @ torch.diag(torch.tensor([cond ** (-i / 15) for i in range(16)], dtype=F64)) @ u.T
    assert abs(float(torch.linalg.cond(ms)) - cond) < 0.01 * cond
    root, error = ftopt.matrix_inverse_pth_root(ms.float(), 4, ridge_epsilon=1e-12)
    assert root.dtype == torch.float32 and error.dtype == torch.float32
    if e < 7:
        assert float(error) < 0.1


def _pth_root_optax(matrix, p, num_iters, ridge_epsilon, tol):
    """optax's loop, transcribed literally (state tuples; the unrolled powers 1, 2, 4, 8)."""
    n, alpha = matrix.shape[0], -1.0 / p
    eye = torch.eye(n, dtype=F64)
    lam = float(torch.linalg.eigvalsh(matrix)[-1])  # power_iteration's limit
    ridge = ridge_epsilon * max(lam, 1e-16)

    def power(m):
        for _ in range(round(math.log2(p))):
            m = m @ m
        return m

    damped = matrix + ridge * eye
    z = (1 + p) / (2 * float(torch.linalg.matrix_norm(damped)))
    m0 = damped * z
    h0 = eye * z ** (1.0 / p)
    state = (0, m0, h0, h0, float((m0 - eye).abs().max()), True)
    while state[0] < num_iters and state[4] > tol and state[5]:
        i, m, h, _, err, _ = state
        mi = (1 - alpha) * eye + alpha * m
        new_m = power(mi) @ m
        new_err = float((new_m - eye).abs().max())
        state = (i + 1, new_m, h @ mi, h, new_err, new_err < err * 1.2)
    _, m, h, old_h, _, converged = state
    return (h if converged else old_h), float((m - eye).abs().max()), state[0]


@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("num_iters", [0, 1, 3, 100])
def test_pth_root_follows_optax_loop(p, num_iters):
    matrix = _psd(7, 20 + p)
    root, error = ftopt.matrix_inverse_pth_root(matrix, p, num_iters=num_iters,
                                                ridge_epsilon=1e-4, error_tolerance=1e-9)
    ref, ref_error, _ = _pth_root_optax(matrix, p, num_iters, 1e-4, 1e-9)
    assert torch.allclose(root, ref, rtol=1e-8, atol=1e-12)
    assert float(error) == pytest.approx(ref_error, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("seed,p", [(17, 1), (3, 2), (9, 1)])
def test_pth_root_returns_the_previous_h_when_the_error_rises(seed, p):
    # indefinite matrices: the iteration diverges, the error first rising by less than
    # 1.2x (the loop goes on), then by more (between 1.2x and 1.6x: the loop stops);
    # optax returns the H before that last step, with that step's error
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(4, 4, dtype=F64, generator=gen))
    matrix = q @ torch.diag(2 * torch.randn(4, dtype=F64, generator=gen)) @ q.T
    ref, ref_error, steps = _pth_root_optax(matrix, p, 100, 0.0, 1e-9)
    root, error = ftopt.matrix_inverse_pth_root(matrix, p, ridge_epsilon=0.0,
                                                error_tolerance=1e-9)
    assert 2 <= steps <= 3  # a rise below 1.2x went on, the next one stopped it
    assert torch.allclose(root, ref, rtol=1e-10, atol=1e-12)
    assert float(error) == pytest.approx(ref_error, rel=1e-9)


@pytest.mark.parametrize("p", [1, 2, 3])
def test_pth_root_one_by_one(p):
    root, error = ftopt.matrix_inverse_pth_root(torch.tensor([[4.0]], dtype=F64), p,
                                                ridge_epsilon=0.25)
    assert root.shape == (1, 1) and float(error) == 0.0
    assert float(root) == pytest.approx((4.0 + 0.25 * 4.0) ** (-1.0 / p), rel=1e-6)


def test_pth_root_dtypes_and_purity():
    matrix = _psd(5, 30, torch.bfloat16) + torch.eye(5, dtype=torch.bfloat16)
    before = matrix.clone()
    root, error = ftopt.matrix_inverse_pth_root(matrix, 2)
    assert root.dtype == torch.bfloat16 and error.dtype == torch.float32
    assert torch.equal(matrix, before)
    ref = _root_by_eigh(matrix, 2, 1e-6)
    assert torch.allclose(root.to(F64), ref, rtol=0.02, atol=0.02 * float(ref.abs().max()))


@pytest.mark.parametrize("kwargs,match", [
    ({"matrix": torch.ones(2, 3), "p": 2}, "matrix must be a square"),
    ({"matrix": torch.eye(2, dtype=torch.complex64), "p": 2}, "matrix must be real"),
    ({"matrix": [[1.0]], "p": 2}, "matrix must be a tensor"),
    ({"matrix": torch.eye(2), "p": 0}, "p must be a positive int"),
    ({"matrix": torch.eye(2), "p": 1.5}, "p must be a positive int"),
    ({"matrix": torch.eye(2), "p": 2, "num_iters": -1}, "num_iters"),
    ({"matrix": torch.eye(2), "p": 2, "ridge_epsilon": -1e-3}, "ridge_epsilon"),
    ({"matrix": torch.eye(2), "p": 2, "error_tolerance": float("nan")}, "error_tolerance"),
    ({"matrix": torch.eye(2), "p": 2, "precision": 3}, "precision"),
])
def test_pth_root_bad_inputs(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=f"matrix_inverse_pth_root: {match}"):
        ftopt.matrix_inverse_pth_root(**kwargs)


# ----------------------------------------------------------------------------------------
# nnls


def test_nnls_docstring_example():
    x = ftopt.nnls(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([5.0, 6.0]), 10**3)
    assert f"{float(x[0]):.2f}" == "0.00" and f"{float(x[1]):.2f}" == "1.70"


@pytest.mark.parametrize("m", [10, 20])
@pytest.mark.parametrize("n", [11, 21])
@pytest.mark.parametrize("k", [(), (5,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nnls_optax_cases(m, n, k, dtype):
    gen = torch.Generator().manual_seed(m + n + len(k))
    A = torch.randn(m, n, generator=gen).to(dtype)  # noqa: N806
    b = torch.randn(m, *k, generator=gen).to(dtype)
    for iters in range(5):
        x = ftopt.nnls(A, b, iters=iters)
        assert x.dtype == dtype and x.shape == A.shape[-1:] + b.shape[1:]
        assert bool((x >= 0).all())


def _nnls_optax(A, b, iters, L=None):  # noqa: N803
    """optax's scan, transcribed in float64."""
    Q, q = A.T @ A, A.T @ b  # noqa: N806
    if L is None:
        L = min(float(torch.linalg.matrix_norm(Q)), float(Q.abs().sum(0).max()))  # noqa: N806
    L = 1.0 if L == 0 else L  # noqa: N806
    x = torch.zeros((A.shape[1],) + tuple(b.shape[1:]), dtype=F64)
    p, c = x, 0.0
    for _ in range(iters):
        cn = (1 + math.sqrt(1 + 4 * c**2)) / 2
        s = (c - 1) / cn
        xn = torch.clamp(p - (Q @ p - q) / L, min=0)
        x, p, c = xn, xn + s * (xn - x), cn
    return x


@pytest.mark.parametrize("k", [(), (3,)])
@pytest.mark.parametrize("L", [None, 50.0, 0.0])
def test_nnls_follows_optax_scan(k, L):  # noqa: N803
    gen = torch.Generator().manual_seed(40)
    A = torch.randn(9, 6, dtype=F64, generator=gen)  # noqa: N806
    b = torch.randn(9, *k, dtype=F64, generator=gen)
    for iters in (0, 1, 2, 7):
        got = ftopt.nnls(A, b, iters, L=L)
        assert torch.allclose(got, _nnls_optax(A, b, iters, L), rtol=1e-12, atol=1e-14)
    if L == 0.0:  # 0 counts as 1
        assert torch.equal(ftopt.nnls(A, b, 7, L=0.0), ftopt.nnls(A, b, 7, L=1.0))
    if L is not None:  # a 0-d tensor is the same bound
        assert torch.equal(ftopt.nnls(A, b, 7, L=torch.tensor(L)), ftopt.nnls(A, b, 7, L=L))


def test_nnls_float64_satisfies_kkt():
    gen = torch.Generator().manual_seed(41)
    A = torch.randn(40, 8, dtype=F64, generator=gen)  # noqa: N806
    b = torch.randn(40, 4, dtype=F64, generator=gen)
    x = ftopt.nnls(A, b, 3000)
    grad = A.T @ (A @ x - b)  # ∇ ½‖Ax − b‖²
    assert bool((x >= 0).all())
    assert bool((grad >= -1e-9).all())  # dual feasibility
    assert float((x * grad).abs().max()) < 1e-9  # complementary slackness
    assert bool((x == 0).any()) and bool((x > 0).any())  # both kinds of coordinates occur
    for j in range(4):  # columns are independent problems
        assert torch.allclose(ftopt.nnls(A, b[:, j], 3000), x[:, j], rtol=1e-12, atol=1e-14)


def test_spectral_radius_upper_bound():
    Q = _psd(6, 42)  # noqa: N806
    bound = get_spectral_radius_upper_bound(Q)
    assert float(bound) >= float(torch.linalg.eigvalsh(Q)[-1])
    assert float(bound) == pytest.approx(min(float(torch.linalg.matrix_norm(Q)),
                                             float(Q.abs().sum(0).max())), rel=1e-14)
    assert float(get_spectral_radius_upper_bound(torch.zeros(0, 0))) == 0.0


def test_nnls_purity_and_dtype_promotion():
    A = torch.randn(5, 3, dtype=torch.float32)  # noqa: N806
    b = torch.randn(5, dtype=F64)
    a0, b0 = A.clone(), b.clone()
    x = ftopt.nnls(A, b, 20, unroll=True)
    assert x.dtype == F64 and torch.equal(A, a0) and torch.equal(b, b0)
    assert torch.equal(x, ftopt.nnls(A.double(), b, 20, unroll=4))


@pytest.mark.parametrize("args,kwargs,match", [
    ((torch.ones(3), torch.ones(3), 5), {}, "A must have 2 dimensions"),
    ((torch.ones(3, 2), torch.ones(3, 2, 2), 5), {}, "b must have 1 or 2 dimensions"),
    ((torch.ones(3, 2), torch.ones(4), 5), {}, "b must have A's number of rows 3"),
    ((torch.ones(3, 2, dtype=torch.int64), torch.ones(3), 5), {}, "A must be a real floating"),
    (([[1.0]], torch.ones(1), 5), {}, "A must be a tensor"),
    ((torch.ones(3, 2), torch.ones(3), -1), {}, "iters"),
    ((torch.ones(3, 2), torch.ones(3), 2.0), {}, "iters"),
    ((torch.ones(3, 2), torch.ones(3), 5), {"unroll": 0}, "unroll"),
    ((torch.ones(3, 2), torch.ones(3), 5), {"L": -1.0}, "L must be >= 0"),
    ((torch.ones(3, 2), torch.ones(3), 5), {"L": torch.ones(2)}, "L must be a number"),
    ((torch.ones(3, 2), torch.ones(3), 5), {"L": "big"}, "L must be a number"),
])
def test_nnls_bad_inputs(args, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=f"nnls: {match}"):
        ftopt.nnls(*args, **kwargs)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_results_stay_on_the_data_device(device):
    matrix = _psd(6, 50).to(device) + torch.eye(6, dtype=F64, device=device)
    eig, vec = ftopt.power_iteration(matrix, num_iters=1000, error_tolerance=1e-12)
    assert eig.device.type == device and vec.device.type == device
    assert float(eig) == pytest.approx(float(torch.linalg.eigvalsh(matrix.cpu())[-1]),
                                       rel=1e-9)
    a = ftopt.power_iteration(matrix, num_iters=2, key=3)[1]
    b = ftopt.power_iteration(matrix, num_iters=2, key=torch.Generator().manual_seed(3))[1]
    assert torch.equal(a, ftopt.power_iteration(matrix, num_iters=2, key=3)[1])
    assert b.device.type == device  # a CPU generator's draw moves to the data
    root, error = ftopt.matrix_inverse_pth_root(matrix, 2, error_tolerance=1e-12)
    assert root.device.type == device and error.device.type == device
    assert torch.allclose(root.cpu(), _root_by_eigh(matrix.cpu(), 2, 1e-6), atol=1e-9)
    A = torch.randn(8, 6, dtype=F64, generator=torch.Generator().manual_seed(51))  # noqa: N806
    b = torch.randn(8, dtype=F64, generator=torch.Generator().manual_seed(52))
    x = ftopt.nnls(A.to(device), b.to(device), 50)
    assert x.device.type == device
    assert torch.allclose(x.cpu(), ftopt.nnls(A, b, 50), rtol=1e-10, atol=1e-12)
    dist = ftopt.multi_normal(torch.zeros(3, device=device), torch.zeros(3, device=device))
    draw = dist.sample((2,), 7)
    assert draw.device.type == device and torch.equal(draw, dist.sample((2,), 7))
    assert dist.sample((2,), torch.Generator().manual_seed(7)).device.type == device
