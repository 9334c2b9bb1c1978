"""Tests for linalg.py: eigh fallback, root inverse, the refresh criterion and QR."""

import math
import warnings

import pytest
import torch

from hf_shampoo import DistributedShampoo, eigenbasis, linalg
from tests.helpers import generator, torch_threads

pytestmark = [pytest.mark.unit, pytest.mark.device]


def _spd(n, d, seed=0, dtype=torch.float64):
    g = generator(seed)
    x = torch.randn(n, d, 2 * d, generator=g, dtype=dtype)
    return x @ x.mT / (2 * d)


def test_regularized_eigenvalues_shift_rule():
    values = torch.tensor([[-1e-3, 0.5, 2.0], [0.1, 0.2, 0.3]], dtype=torch.float64)
    out = linalg.regularized_eigenvalues(values, 1e-2)
    # λ_min < ε: every eigenvalue shifted by ε - λ_min; otherwise unchanged
    torch.testing.assert_close(out[0], values[0] + (1e-2 + 1e-3))
    torch.testing.assert_close(out[1], values[1])


def test_inverse_root_matches_dense_power():
    a = _spd(3, 5)
    values, vectors = torch.linalg.eigh(a)
    root = linalg.inverse_root_from_eigen(values, vectors, 0.25)
    for i in range(3):
        expected = torch.linalg.matrix_power(root[i], 4) @ a[i]
        torch.testing.assert_close(expected, torch.eye(5, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("exponent", [-0.25, -1 / 3, -1 / 6, 0.3, -0.5, 1 / 8])
def test_power_gives_a_row_the_same_bits_in_any_stack(dtype, exponent):
    """``linalg.power`` (the roots' eigenvalue powers, the diagonal long side, the coupled
    iterations' starting scale) gives a block's row the same bits alone and in stacks of
    2, 3 and 5, at any position: on CPU ``pow`` rounds its vectorised body and its scalar
    tail differently, and an owner stacks only its own blocks where one process stacks
    them all."""
    g = generator(3)
    for d in (1, 3, 8, 31, 33, 70):
        rows = torch.rand(5, d, generator=g, dtype=dtype) * 10 + 1e-4
        rows[1] *= 1e-5
        alone = [linalg.power(rows[i:i + 1].clone(), exponent)[0] for i in range(5)]
        for n in (2, 3, 5):
            for start in range(6 - n):
                stacked = rows[start:start + n].clone()
                for got in (linalg.power(stacked, exponent),
                            linalg.power(stacked.clone(), exponent, in_place=True)):
                    for i in range(n):
                        assert torch.equal(got[i], alone[start + i]), (d, n, start, i)
        # a stack of scalars (the coupled iterations' z), one per block
        column = rows[:, 0].contiguous()
        for n in (1, 2, 3, 5):
            assert torch.equal(linalg.power(column[:n], exponent),
                               torch.stack([a[0] for a in alone[:n]]))


def test_batched_eigh_falls_back_per_matrix(monkeypatch):
    a = _spd(3, 4)
    real = torch.linalg.eigh
    calls = {"batched": 0}

    def flaky(m, out=None):
        if m.dim() == 3:  # the batched call fails, single matrices succeed except one
            calls["batched"] += 1
            raise torch.linalg.LinAlgError("forced")
        if torch.equal(m.to(torch.float64), a[1]):
            raise torch.linalg.LinAlgError("forced")
        return real(m)

    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    with torch_threads(1):  # one batched call (with more threads: one call per matrix)
        result = linalg.batched_eigh(a)
    assert calls["batched"] == 1
    assert result.ok == [True, False, True]
    expected = real(a[0])[0]
    torch.testing.assert_close(result.eigenvalues[0], expected)


def test_stale_mask_skips_exactly_when_basis_is_exact():
    a = _spd(4, 6)
    _, exact = torch.linalg.eigh(a)
    perturbed = exact.clone()
    rotation = torch.linalg.matrix_exp(0.3 * (torch.eye(6) - torch.eye(6).roll(1, 0)).double())
    perturbed[2] = exact[2] @ torch.linalg.qr(rotation)[0]
    stale, diagonal = eigenbasis.stale_mask(a, perturbed, 1e-6)
    assert stale.tolist() == [False, False, True, False]
    torch.testing.assert_close(diagonal[0], torch.linalg.eigvalsh(a[0]))
    # tolerance 0 always refreshes
    assert eigenbasis.stale_mask(a, exact, 0.0)[0].all()


def test_qr_iteration_converges_to_eigh_basis():
    a = _spd(2, 6, seed=3)
    values, vectors = torch.linalg.eigh(a)
    basis = torch.linalg.qr(torch.randn(2, 6, 6, dtype=torch.float64))[0]
    basis, estimates, _ = eigenbasis.qr_iteration(a, basis, 500)
    torch.testing.assert_close(estimates, values.flip(-1), rtol=1e-8, atol=1e-10)
    # same eigenvectors (descending order) up to sign
    overlap = (basis.mT @ vectors.flip(-1)).abs()
    torch.testing.assert_close(overlap, torch.eye(6, dtype=torch.float64).expand(2, 6, 6),
                               rtol=0, atol=1e-6)


def test_single_qr_step_keeps_a_good_descending_basis_good():
    """A warm start from a nearly exact basis must get better, not scramble its columns."""
    a = _spd(1, 6, seed=7)
    _, vectors = torch.linalg.eigh(a)
    noise = torch.linalg.matrix_exp(1e-2 * (lambda m: m - m.mT)(torch.randn(1, 6, 6).double()))
    start = vectors.flip(-1) @ noise
    before = eigenbasis.off_diagonal_ratio(a, start)[1]
    basis, _, order = eigenbasis.qr_iteration(a, start, 1)
    after = eigenbasis.off_diagonal_ratio(a, basis)[1]
    assert after < before
    assert order.tolist() == [list(range(6))]


def test_qr_iteration_stops_early_when_tolerance_met():
    a = _spd(2, 5, seed=2)
    _, vectors = torch.linalg.eigh(a)
    exact = vectors.flip(-1)
    basis, _, _ = eigenbasis.qr_iteration(a, exact.clone(), 50, tolerance=1e-3)
    # after the first (mandatory) step the basis already passes: no further steps taken
    one_step, _, _ = eigenbasis.qr_iteration(a, exact.clone(), 1)
    torch.testing.assert_close(basis, one_step, rtol=0, atol=0)


def test_qr_iteration_sorts_and_reports_permutation():
    a = torch.diag_embed(torch.tensor([[3.0, 1.0, 2.0]], dtype=torch.float64))
    basis, estimates, order = eigenbasis.qr_iteration(a, torch.eye(3, dtype=torch.float64)[None], 1)
    assert estimates.tolist() == [[3.0, 2.0, 1.0]]
    assert order.tolist() == [[0, 2, 1]]


def _train(steps=6, shape=(6, 4), **kw):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(*shape, dtype=torch.float64))
    opt = DistributedShampoo([w], factor_matrix_dtype=torch.float64, **kw)
    g = generator(1)
    for _ in range(steps):
        w.grad = torch.randn(*shape, generator=g, dtype=torch.float64)
        opt.step()
    return w.detach(), opt


# (8, 6) stays a single 2-D block with max_preconditioner_dim 8; after 12 gradients both
# factors have full rank and distinct eigenvalues, so orthogonal iteration converges.
_FULL_RANK = dict(steps=12, shape=(8, 6), max_preconditioner_dim=8, lr=0.1, betas=(0.0, 0.9),
                  precondition_frequency=4, epsilon=1e-10)


def test_qr_refresh_with_many_iterations_equals_eigh():
    ref, _ = _train(**_FULL_RANK)
    qr, _ = _train(eigendecomposition="qr", qr_max_iterations=2000, **_FULL_RANK)
    torch.testing.assert_close(qr, ref, rtol=1e-8, atol=1e-10)


def test_qr_refresh_basis_converges_to_eigh_basis_in_corrected_mode():
    _, ref = _train(preconditioner="eigenvalue_corrected", **_FULL_RANK)
    _, qr = _train(preconditioner="eigenvalue_corrected", eigendecomposition="qr",
                   qr_max_iterations=2000, **_FULL_RANK)
    for j in (0, 1):
        a = ref.state_dict()["state"][0][f"block_0.eigenvectors_{j}"]
        b = qr.state_dict()["state"][0][f"block_0.eigenvectors_{j}"]
        # both sorted by descending eigenvalue: equal up to the sign of each column
        torch.testing.assert_close((a.mT @ b).abs(), torch.eye(a.shape[0], dtype=a.dtype),
                                   rtol=0, atol=1e-6)


def test_tolerance_one_never_refreshes_after_first_basis():
    """τ = 1 always passes the criterion: the basis from the first refresh is kept."""
    common = dict(lr=0.1, betas=(0.0, 0.9), precondition_frequency=2,
                  preconditioner="eigenvalue_corrected")
    _, opt = _train(steps=2, eigenbasis_tolerance=1.0, **common)
    first = opt.state_dict()["state"][0]["block_0.eigenvectors_0"].clone()
    g = generator(5)
    w = opt.param_groups[0]["params"][0]
    for _ in range(4):
        w.grad = torch.randn(6, 4, generator=g, dtype=torch.float64)
        opt.step()
    assert torch.equal(opt.state_dict()["state"][0]["block_0.eigenvectors_0"], first)


def test_eigh_failures_keep_previous_root_then_raise(monkeypatch):
    w, opt = _train(steps=1, lr=0.1, betas=(0.0, 1.0), precondition_frequency=1)
    root = opt.state_dict()["state"][0]["block_0.inverse_root_0"].clone()

    def broken(m, out=None):
        raise torch.linalg.LinAlgError("forced")

    monkeypatch.setattr(torch.linalg, "eigh", broken)
    p = opt.param_groups[0]["params"][0]
    for _ in range(3):
        p.grad = torch.ones_like(p)
        with pytest.warns(UserWarning, match="keeping the previous preconditioner"):
            opt.step()
        assert torch.equal(opt.state_dict()["state"][0]["block_0.inverse_root_0"], root)
    p.grad = torch.ones_like(p)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="4th time in a row"):
            opt.step()


# --------------------------------------------------------- matmul-based orthogonalisation
def _with_condition(n, d, condition, dtype, seed=0):
    """Square matrices ``U diag(s) Vᵀ`` with singular values from 1 down to 1/condition."""
    g = generator(seed)
    u = torch.linalg.qr(torch.randn(n, d, d, generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(n, d, d, generator=g, dtype=torch.float64))[0]
    s = torch.logspace(0, -math.log10(condition), d, dtype=torch.float64)
    return ((u * s.unsqueeze(-2)) @ v.mT).to(dtype)


def _same_up_to_column_signs(q, reference, atol):
    signs = torch.sign((q * reference).sum(dim=-2, keepdim=True))
    torch.testing.assert_close(q * signs, reference, rtol=0, atol=atol)


@pytest.mark.parametrize("dtype,condition", [(torch.float64, 1e2), (torch.float64, 1e10),
                                             (torch.float32, 1e2)])
def test_cholesky_qr_is_householder_up_to_signs(dtype, condition):
    """Shifted Cholesky-QR3 gives an orthogonal Q to working precision, also where plain
    Cholesky-QR would fail (κ² beyond 1/u), and Householder's Q up to column signs (to
    the accuracy QR's Q has at this condition number, κ·u)."""
    x = _with_condition(3, 48, condition, dtype)
    q, ok = eigenbasis.cholesky_qr_basis(x)
    assert ok.all()
    unit = torch.finfo(dtype).eps
    eye = torch.eye(48, dtype=dtype).expand(3, 48, 48)
    torch.testing.assert_close(q.mT @ q, eye, rtol=0, atol=50 * unit)
    r = q.mT @ x  # upper triangular with a positive diagonal
    assert (r.diagonal(dim1=-2, dim2=-1) > 0).all()
    assert r.tril(-1).abs().max() <= 1e3 * unit * x.abs().max()
    _same_up_to_column_signs(q, eigenbasis.orthonormal_basis(x), atol=100 * unit * condition)


def test_cholesky_qr_beyond_its_range_falls_back_to_householder():
    """float32 with κ = 1e5: the shift needed at d = 48 leaves the second pass too
    ill-conditioned, which the last Gram check catches; the result is Householder's."""
    x = _with_condition(3, 48, 1e5, torch.float32)
    assert not eigenbasis.cholesky_qr_basis(x)[1].any()
    torch.testing.assert_close(eigenbasis.orthonormal_basis(x, "cholesky_qr"),
                               eigenbasis.orthonormal_basis(x), rtol=0, atol=0)


def test_cholesky_qr_hands_rank_deficient_matrices_to_householder():
    x = _with_condition(3, 32, 1e2, torch.float32)
    x[1, :, -4:] = 0  # four zero columns: no R with a positive diagonal exists
    _, ok = eigenbasis.cholesky_qr_basis(x)
    assert ok.tolist() == [True, False, True]
    q = eigenbasis.orthonormal_basis(x, "cholesky_qr")
    eye = torch.eye(32).expand(3, 32, 32)
    torch.testing.assert_close(q.mT @ q, eye, rtol=0, atol=1e-5)
    torch.testing.assert_close(q[1], eigenbasis.orthonormal_basis(x[1:2])[0], rtol=0, atol=0)


def _rotated_frame_qr_algorithm(matrices, basis, iterations, tolerance):
    """Meta's ``matrix_functions.qr_algorithm``, matrix by matrix, as a reference:
    ``B = QᵀAQ``; while ``sqrt(‖B‖² - ‖diag B‖²) > τ‖B‖`` and iterations are left,
    ``Q', R = qr(B)``, ``B = R Q'``, ``Q = Q Q'``; then ``diag B`` sorted ascending
    (stable) with the columns of ``Q``."""
    bases, values = [], []
    for a, q in zip(matrices, basis):
        b = q.T @ a @ q
        for _ in range(iterations):
            norm = torch.linalg.matrix_norm(b)
            if torch.sqrt(norm**2 - b.diagonal().norm() ** 2) <= tolerance * norm:
                break
            step, r = torch.linalg.qr(b)
            b, q = r @ step, q @ step
        estimates, order = b.diagonal().sort(stable=True)
        bases.append(q[:, order])
        values.append(estimates)
    return torch.stack(bases), torch.stack(values)


@pytest.mark.parametrize("method", ["householder", "cholesky_qr"])
@pytest.mark.parametrize("iterations,tolerance", [(1, 0.0), (4, 0.0), (4, 0.05), (2, 0.9)])
def test_direct_qr_algorithm_equals_metas_rotated_frame(method, iterations, tolerance):
    """qr(AQ) = Q qr(QᵀAQ): same bases (up to column signs) and estimates as Meta's
    rotated-frame QR algorithm, also when matrices stop at different iterations."""
    a = _spd(4, 12, seed=5)
    a[3] = torch.diag(torch.arange(1.0, 13.0, dtype=torch.float64))  # diagonal: no iteration
    start = torch.linalg.qr(torch.randn(4, 12, 12, generator=generator(2),
                                        dtype=torch.float64))[0]
    start[3] = torch.eye(12, dtype=torch.float64)
    basis, values = _rotated_frame_qr_algorithm(a, start, iterations, tolerance)
    direct, direct_values = eigenbasis.qr_algorithm_direct(a, start, iterations, tolerance, method)
    torch.testing.assert_close(direct_values, values, rtol=1e-11, atol=0)
    _same_up_to_column_signs(direct, basis, atol=1e-9)
    torch.testing.assert_close(direct[3], torch.eye(12, dtype=torch.float64), rtol=0, atol=0)


@pytest.mark.parametrize("preconditioner", ["shampoo", "eigenvalue_corrected"])
def test_cholesky_qr_refreshes_train_like_householder(preconditioner):
    config = dict(preconditioner=preconditioner, eigendecomposition="qr",
                  qr_max_iterations=3, **_FULL_RANK)
    ref, _ = _train(**config)
    fast, _ = _train(orthogonalization="cholesky_qr", **config)
    torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-11)


def test_orthogonalization_is_validated():
    w = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="orthogonalization='gram_schmidt'.*householder"):
        DistributedShampoo([w], orthogonalization="gram_schmidt")
