"""Performance paths and options: staggered refreshes (``refresh_schedule``), the
symmetric product ``linalg.syrk``, the one-matmul basis criterion, and the allocation-free
mode products. Each must compute what the plain formulas compute."""

import pytest
import torch

from hf_shampoo import DistributedShampoo, eigenbasis, kronecker, linalg
from tests.helpers import F64, cpu_batch_invariance, generator, random_tensors, torch_threads
from tests.reference_shampoo import ReferenceShampoo

pytestmark = [pytest.mark.unit, pytest.mark.device]

# ------------------------------------------------------------ refresh_schedule


def test_refresh_schedule_is_validated():
    p = torch.nn.Parameter(torch.zeros(3))
    assert DistributedShampoo([p]).param_groups[0]["refresh_schedule"] == "all"
    with pytest.raises(ValueError, match="refresh_schedule"):
        DistributedShampoo([p], refresh_schedule="spread")


# Single-block parameters of different costs, so that the staggered schedule gives them
# different offsets; each is compared with the reference whose schedule runs that late.
# The vector is (3,): its factor is full rank from its third gradient, before its first
# refresh (a rank-deficient factor's null-space eigenvectors are arbitrary, so eigenbasis
# modes agree with a reference only by the accident of identical rounding).
SHAPES = [(6, 5), (4, 4), (3,), (3, 2, 2), (5, 3), (2,)]
STAGGERED = {"lr": 0.1, "epsilon": 1e-6, "max_preconditioner_dim": 8,
             "precondition_frequency": 3, "refresh_schedule": "staggered"}


def _run_staggered(config, steps=11):
    inits = [random_tensors(s, 1, seed=100 + i)[0] for i, s in enumerate(SHAPES)]
    grads = [random_tensors(s, steps, seed=200 + i) for i, s in enumerate(SHAPES)]
    params = [torch.nn.Parameter(w.clone()) for w in inits]
    opt = DistributedShampoo(params, factor_matrix_dtype=F64, **config)
    offsets = {row["param_index"]: row["refresh_offset"] for row in opt.describe_blocks()}
    reference_config = {k: v for k, v in config.items() if k != "refresh_schedule"}
    refs = [ReferenceShampoo(w, schedule_offset=offsets[i], **reference_config)
            for i, w in enumerate(inits)]
    for t in range(steps):
        for p, g in zip(params, grads):
            p.grad = g[t].clone()
        opt.step()
        for i, (p, ref) in enumerate(zip(params, refs)):
            ref.step(grads[i][t])
            torch.testing.assert_close(p.detach(), ref.param, rtol=1e-9, atol=1e-12,
                                       msg=lambda m, i=i, t=t: f"param {i} step {t + 1}: {m}")
    return offsets


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({}, id="shampoo"),
        pytest.param({"grafting": "adam", "betas": (0.9, 0.99)}, id="shampoo-adam-grafting"),
        pytest.param({"grafting": "rmsprop", "start_preconditioning_step": 4,
                      "weight_decay": 0.1}, id="shampoo-s4-rmsprop-wd"),
        pytest.param({"preconditioner": "eigenvalue_corrected", "betas": (0.9, 0.99),
                      "epsilon": 1e-8}, id="eigenvalue-corrected"),
        pytest.param({"preconditioner": "eigenvalue_corrected", "betas": (0.9, 0.99),
                      # ε 1e-2: the 1-D factors are rank-deficient at their first QR refresh, and
                      # QR of a nearly singular A + εI decides the null-space columns by
                      # round-off (different in two correct implementations)
                      "epsilon": 1e-2, "eigendecomposition": "qr", "qr_max_iterations": 2},
                     id="eigenvalue-corrected-qr"),
        pytest.param({"preconditioner": "eigenvalue_corrected", "betas": (0.9, 0.99),
                      "epsilon": 1e-8, "grafting": "adam", "momentum": 0.5},
                     id="eigenvalue-corrected-adam-momentum"),
    ],
)
def test_staggered_block_equals_reference_with_its_own_schedule(config):
    offsets = _run_staggered({**STAGGERED, **config})
    assert len(set(offsets.values())) == 3  # every offset 0, 1, 2 of f = 3 is in use


def test_staggered_offsets_balance_the_refresh_work():
    """Every offset gets about the same Σd³; the heaviest block gets offset 0."""
    params = [torch.nn.Parameter(torch.zeros(s)) for s in [(64, 64)] * 4 + [(32, 32)] * 8]
    opt = DistributedShampoo(params, precondition_frequency=4, refresh_schedule="staggered")
    rows = opt.describe_blocks()
    loads = [0] * 4
    for row in rows:
        loads[row["refresh_offset"]] += sum(d**3 for d in row["shape"])
    assert loads == [loads[0]] * 4
    # "all" (the default) gives every block offset 0
    opt = DistributedShampoo(params, precondition_frequency=4)
    assert {row["refresh_offset"] for row in opt.describe_blocks()} == {0}


def test_staggered_refreshes_spread_over_the_window():
    """With f = 4 and four equal blocks, each step after the start refreshes one block."""
    params = [torch.nn.Parameter(torch.zeros(8, 8)) for _ in range(4)]
    opt = DistributedShampoo(params, lr=0.1, precondition_frequency=4, max_preconditioner_dim=8,
                             refresh_schedule="staggered")
    calls = []
    real = linalg.batched_eigh_many

    def counting(stacks, *args, **kw):
        calls.extend(m.shape[0] for m in stacks)
        return real(stacks, *args, **kw)

    g = generator(0)
    per_step = []
    linalg.batched_eigh_many = counting
    try:
        for _ in range(12):
            for p in params:
                p.grad = torch.randn(8, 8, generator=g)
            calls.clear()
            opt.step()
            per_step.append(sum(calls))
    finally:
        linalg.batched_eigh_many = real
    # steps 1-3 graft-free identity steps, then one block (two factors) per step
    assert per_step == [0, 0, 0] + [2] * 9


# ------------------------------------------------------------ linalg.syrk


@pytest.mark.parametrize(("d", "k"), [(300, 520), (257, 600), (600, 512), (64, 900)])
def test_syrk_equals_full_product(d, k):
    g = generator(d)
    x = torch.randn(3, d, k, generator=g, dtype=F64)
    f = torch.randn(3, d, d, generator=g, dtype=F64)
    f = f + f.mT
    expected = 0.9 * f + 0.1 * x @ x.mT
    out = linalg.syrk(f.clone(), x, beta=0.9, alpha=0.1)
    torch.testing.assert_close(out, expected)
    if d >= linalg.SYRK_MIN_DIM and k >= linalg.SYRK_MIN_INNER:  # split into blocks
        h = d // 2  # the lower-left block mirrors the upper-right one
        assert torch.equal(out[:, h:, :h], out[:, :h, h:].mT)
    # beta = 0 ignores the old contents, NaNs included
    torch.testing.assert_close(linalg.syrk(torch.full_like(f, float("nan")), x), x @ x.mT)


def test_syrk_of_a_matrix_reads_only_that_matrix():
    """Each matrix of a batched ``syrk`` is its own product, to round-off (bit for bit
    where the library does not round by batch, which nothing relies on: docs/design.md §4)."""
    g = generator(1)
    x = torch.randn(5, 600, 520, generator=g)
    together = linalg.syrk(torch.zeros(5, 600, 600), x)
    for i in range(5):
        alone = linalg.syrk(torch.zeros(1, 600, 600), x[i : i + 1])
        torch.testing.assert_close(alone[0], together[i], rtol=1e-5, atol=1e-4)


def test_inverse_root_large_enough_for_the_blocked_product():
    g = generator(2)
    x = torch.randn(2, 520, 600, generator=g, dtype=F64)
    a = x @ x.mT / 600
    values, vectors = torch.linalg.eigh(a)
    root = linalg.inverse_root_from_eigen(values, vectors, 0.25)
    expected = vectors @ torch.diag_embed(values.pow(-0.25)) @ vectors.mT
    torch.testing.assert_close(root, expected)


# ------------------------------------------------------------ the basis criterion


def test_one_matmul_criterion_agrees_with_explicit_rotation():
    g = generator(3)
    n, d = 12, 40
    x = torch.randn(n, d, 3 * d, generator=g)
    a = x @ x.mT / (3 * d)
    _, exact = torch.linalg.eigh(a)
    # perturb each basis by a rotation of growing angle: ratios from ~0 to large
    direction = torch.randn(d, d, generator=g)
    skew = direction - direction.mT
    bases = torch.stack([exact[i] @ torch.linalg.matrix_exp(0.02 * i * skew) for i in range(n)])
    _, ratio = eigenbasis.off_diagonal_ratio(a, bases)
    for tolerance in (0.0, 0.01, 0.05, float(ratio[5]), 0.3):
        check = eigenbasis.check_basis(a, bases, tolerance)
        expected = ratio > tolerance if tolerance > 0 else torch.ones(n, dtype=torch.bool)
        assert torch.equal(check.stale, expected), tolerance
        torch.testing.assert_close(
            check.diagonal, torch.diagonal(bases.mT @ a @ bases, dim1=-2, dim2=-1),
            rtol=1e-4, atol=1e-4,
        )
        torch.testing.assert_close(check.product, a @ bases)


# ------------------------------------------------------------ mode products with buffers


@pytest.mark.parametrize("shape", [(5,), (4, 3), (3, 4, 2), (2, 3, 2, 2)])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("skip", [None, 0, 1])
def test_multi_mode_product_into_buffers(shape, transpose, skip):
    g = generator(4)
    x = torch.randn(2, *shape, generator=g, dtype=F64)
    mats = [torch.randn(2, d, d, generator=g, dtype=F64) for d in shape]
    if skip is not None and skip < len(shape):
        mats[skip] = None
    expected = x
    for j, m in enumerate(mats):
        if m is not None:
            expected = kronecker.mode_product(expected, m, j, transpose)
    out, scratch = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    result = kronecker.multi_mode_product(x, mats, transpose, out=out, scratch=scratch)
    assert result.data_ptr() == out.data_ptr()
    torch.testing.assert_close(result, expected)


@pytest.mark.parametrize("shape", [(3, 4, 5), (2, 3, 2, 2)])
def test_factor_update_of_middle_dims_uses_scratch(shape):
    g = generator(5)
    x = torch.randn(2, *shape, generator=g, dtype=F64)
    scratch = torch.empty_like(x)
    for j, d in enumerate(shape):
        f = torch.zeros(2, d, d, dtype=F64)
        expected = kronecker.update_factor(f.clone(), x, j, 1.0)
        torch.testing.assert_close(kronecker.update_factor(f, x, j, 1.0, scratch=scratch),
                                   expected)


# ------------------------------------------------------------ LAPACK on several threads


@cpu_batch_invariance
def test_lapack_results_do_not_depend_on_batch_with_several_threads():
    """With several threads each matrix is decomposed single-threaded, in any batch."""
    g = generator(6)
    x = torch.randn(5, 40, 80, generator=g)
    a = x @ x.mT
    with torch_threads(2):
        together = linalg.batched_eigh(a)
        basis = eigenbasis.orthonormal_basis(a)
        for i in range(5):
            alone = linalg.batched_eigh(a[i : i + 1])
            assert torch.equal(alone.eigenvalues[0], together.eigenvalues[i])
            assert torch.equal(alone.eigenvectors[0], together.eigenvectors[i])
            assert torch.equal(eigenbasis.orthonormal_basis(a[i : i + 1])[0], basis[i])
        assert torch.get_num_threads() == 2
    torch.testing.assert_close(basis, torch.linalg.qr(a)[0])


@pytest.mark.parametrize("config", [
    pytest.param({}, id="eigh"),
    pytest.param({"eigendecomposition": "qr", "eigenbasis_tolerance": 0.1}, id="qr-tolerance"),
    pytest.param({"preconditioner": "eigenvalue_corrected", "eigendecomposition": "qr"},
                 id="soap-qr"),
    pytest.param({"refresh_schedule": "staggered"}, id="staggered"),
])
def test_two_threads_match_one_thread_semantics(config):
    """The multi-threaded paths (LAPACK pool) run and agree with one thread to round-off."""
    shapes = [(40, 30), (40, 30), (30,), (6, 5, 4)]
    results = []
    previous = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            g = generator(7)
            params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
            opt = DistributedShampoo(params, lr=0.01, precondition_frequency=2,
                                     max_preconditioner_dim=64, **config)
            for _ in range(6):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=g)
                opt.step()
            results.append([p.detach().clone() for p in params])
        finally:
            torch.set_num_threads(previous)
    for one, two in zip(*results):
        torch.testing.assert_close(one, two, rtol=1e-4, atol=1e-5)
