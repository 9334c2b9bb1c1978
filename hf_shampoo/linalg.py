"""Batched linear algebra of the amortized computation (SPEC §2–§3).

Everything here works on stacks of same-size symmetric matrices ``(n, d, d)``: symmetric
eigendecomposition with a float64 retry and a per-matrix fallback, the regularised inverse
root, the off-diagonal criterion that decides whether an eigenbasis is still good, and the
warm-started QR refresh. Nothing else in the package calls ``torch.linalg``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def finite_rows(tensor: Tensor) -> Tensor:
    """Per leading index: whether every element is finite.

    Fast path: a row whose sum is finite has no inf or NaN (they propagate through a
    sum); only rows whose sum is not finite (a non-finite value, or an overflow) are
    checked element by element. The answer never depends on the fast path.
    """
    rows = tensor.reshape(tensor.shape[0], -1)
    ok = torch.isfinite(rows.sum(dim=1))
    if not bool(ok.all()):
        ok = torch.isfinite(rows).all(dim=1)
    return ok


def all_finite(tensor: Tensor) -> bool:
    """Whether every element is finite (fast path as in ``finite_rows``)."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


@dataclass
class Eigh:
    """Eigenvalues ``(n, d)`` ascending, eigenvectors ``(n, d, d)`` and which succeeded."""

    eigenvalues: Tensor
    eigenvectors: Tensor
    ok: list[bool]


def _eigh_one(matrix: Tensor) -> tuple[Tensor, Tensor] | None:
    """One matrix: try its own dtype, then float64 (SPEC: float64 retry); None if both fail."""
    for dtype in dict.fromkeys((matrix.dtype, torch.float64)):
        try:
            values, vectors = torch.linalg.eigh(matrix.to(dtype))
        except RuntimeError:  # torch.linalg.LinAlgError derives from RuntimeError
            continue
        if all_finite(values) and all_finite(vectors):
            return values.to(matrix.dtype), vectors.to(matrix.dtype)
    return None


def batched_eigh(matrices: Tensor) -> Eigh:
    """Symmetric eigendecomposition of a stack; a failed matrix falls back alone.

    The batched call is tried first. If it raises or returns non-finite values, each
    matrix is decomposed on its own (own dtype, then float64), and matrices that still fail
    are reported in ``ok`` with identity placeholders so the caller can keep its previous
    result for them.
    """
    try:
        # The transposed view is column-major, as LAPACK wants it: torch's working copy is
        # then a plain copy instead of a transposing one. For a symmetric matrix it is the
        # same matrix (LAPACK reads its lower triangle, i.e. the upper one of ``matrices``).
        values, vectors = torch.linalg.eigh(matrices.mT)
        if all_finite(values) and all_finite(vectors):
            return Eigh(values, vectors, [True] * matrices.shape[0])
    except RuntimeError:
        pass
    n, d = matrices.shape[0], matrices.shape[-1]
    values = matrices.new_ones(n, d)
    vectors = torch.eye(d, dtype=matrices.dtype, device=matrices.device).repeat(n, 1, 1)
    ok = []
    for i in range(n):
        result = _eigh_one(matrices[i])
        ok.append(result is not None)
        if result is not None:
            values[i], vectors[i] = result
    return Eigh(values, vectors, ok)


def regularized_eigenvalues(eigenvalues: Tensor, epsilon: float) -> Tensor:
    """Eigenvalues of ``A + εI`` shifted by ``ε - λ_min`` where ``λ_min < ε`` (SPEC §2)."""
    smallest = eigenvalues.amin(dim=-1, keepdim=True)
    return torch.where(smallest < epsilon, eigenvalues + (epsilon - smallest), eigenvalues)


def power(values: Tensor, exponent: float, in_place: bool = False) -> Tensor:
    """``values ** exponent``, computed the same way wherever an element sits in the tensor.

    On CPU, ``pow`` takes a vectorised path for most elements and a scalar one for the
    tail, and the two can differ in the last bit; so a block's result would depend on how
    many blocks share its batch, breaking bit-equality between a distributed run and one
    process. Exponents ``±1/2^k`` (the defaults 1/2 and 1/4 among them) use chains of
    correctly rounded square roots and one division instead; other exponents are computed
    in float64 and rounded to ``values.dtype``. ``in_place=True`` overwrites ``values``
    (a scratch tensor) where it can.
    """
    magnitude, steps = abs(exponent), 0
    while magnitude < 1 and steps < 6:
        magnitude, steps = magnitude * 2, steps + 1
    if magnitude == 1:
        out = values
        for _ in range(steps):
            out = out.sqrt_() if in_place else out.sqrt()
            in_place = True  # later steps work on our own tensor
        if exponent < 0:
            return out.reciprocal_() if in_place else out.reciprocal()
        return out
    result = values.double().pow(exponent).to(values.dtype)
    return values.copy_(result) if in_place else result


# Below these sizes a symmetric product is one plain bmm (halving it does not pay).
SYRK_MIN_DIM = 256
SYRK_MIN_INNER = 64


def syrk(out: Tensor, left: Tensor, beta: float = 0.0, alpha: float = 1.0) -> Tensor:
    """``out = beta·out + alpha·X Xᵀ`` (``X = left``) for a stack, in place.

    BLAS's ``syrk`` computes one triangle of a symmetric product; torch has none, so the
    product is cut into 2×2 blocks and only the upper three are multiplied (3/4 of the
    flops of a full ``bmm``); the lower-left block is the transpose of the upper-right.
    With ``beta = 0`` the old contents of ``out`` are ignored (also NaNs).
    """
    d, k = left.shape[-2], left.shape[-1]
    if d < SYRK_MIN_DIM or k < SYRK_MIN_INNER:
        return out.baddbmm_(left, left.mT, beta=beta, alpha=alpha)
    h = d // 2
    top, bottom = left[:, :h], left[:, h:]
    out[:, :h, :h].baddbmm_(top, top.mT, beta=beta, alpha=alpha)
    out[:, :h, h:].baddbmm_(top, bottom.mT, beta=beta, alpha=alpha)
    out[:, h:, h:].baddbmm_(bottom, bottom.mT, beta=beta, alpha=alpha)
    out[:, h:, :h].copy_(out[:, :h, h:].mT)
    return out


def inverse_root_from_eigen(
    eigenvalues: Tensor, eigenvectors: Tensor, exponent: float, out: Tensor | None = None
) -> Tensor:
    """``Q diag(λ^-e) Qᵀ = C Cᵀ`` with ``C = Q diag(λ^(-e/2))`` for a stack (eigenvalues
    already regularised), as a symmetric product."""
    scaled = eigenvectors * power(eigenvalues, -exponent / 2).unsqueeze(-2)
    if out is None:
        out = torch.empty_like(scaled)
    return syrk(out, scaled)


def rayleigh_quotients(basis: Tensor, product: Tensor) -> Tensor:
    """``diag(Qᵀ A Q)`` from ``product = A Q``: column-wise dot products, no second matmul."""
    return (basis * product).sum(dim=-2)


def off_diagonal_ratio(matrices: Tensor, basis: Tensor) -> tuple[Tensor, Tensor]:
    """``B = Qᵀ A Q`` and ``‖B - diag(B)‖_F / ‖B‖_F`` per matrix (SPEC §3 criterion)."""
    rotated = basis.mT @ (matrices @ basis)
    return rotated, _ratio_of(rotated)


def _ratio_of(rotated: Tensor) -> Tensor:
    diagonal = torch.diagonal(rotated, dim1=-2, dim2=-1)
    total = torch.linalg.matrix_norm(rotated)
    off = torch.linalg.matrix_norm(rotated - torch.diag_embed(diagonal))
    return off / total.clamp_min(torch.finfo(total.dtype).tiny)


@dataclass
class BasisCheck:
    """SPEC §3 criterion for a stack of matrices ``A`` and kept bases ``Q``.

    ``stale``: which matrices need a new basis; ``diagonal``: ``diag(Qᵀ A Q)``;
    ``product``: ``A Q``, which the first QR step ``qr(A Q)`` reuses.
    """

    stale: Tensor
    diagonal: Tensor
    product: Tensor


def check_basis(matrices: Tensor, basis: Tensor, tolerance: float) -> BasisCheck:
    """``stale = ‖B - diag B‖_F > τ ‖B‖_F`` with ``B = Qᵀ A Q``; with ``τ = 0`` every matrix
    is stale (SPEC §3).

    One matmul instead of two: ``‖B‖_F = ‖A‖_F`` for an orthogonal ``Q``, and the diagonal
    of ``B`` is ``Σ_k Q_ki (A Q)_ki``, so ``‖B - diag B‖² = ‖A‖² - ‖diag B‖²`` (summed in
    float64). That difference loses absolute precision of about ``√d`` units of round-off
    of ``‖A‖²`` (and ``Q`` is orthogonal only to round-off), so matrices whose ratio lies
    within that band around ``τ`` are decided with the explicit ``B`` instead.
    """
    product = matrices @ basis
    diagonal = rayleigh_quotients(basis, product)
    if tolerance == 0:
        return BasisCheck(torch.ones(matrices.shape[0], dtype=torch.bool,
                                     device=matrices.device), diagonal, product)
    total = matrices.double().square().sum(dim=(-2, -1))
    off = (total - diagonal.double().square().sum(dim=-1)).clamp_min(0)
    ratio_sq = off / total.clamp_min(torch.finfo(torch.float64).tiny)
    band = 16 * math.sqrt(matrices.shape[-1]) * torch.finfo(matrices.dtype).eps
    stale = ratio_sq > tolerance**2
    unsure = (ratio_sq - tolerance**2).abs() <= band
    if bool(unsure.any()):
        index = unsure.nonzero().flatten()
        exact = _ratio_of(basis[index].mT @ product[index])
        stale[index] = exact > tolerance
    return BasisCheck(stale, diagonal, product)


def stale_mask(matrices: Tensor, basis: Tensor, tolerance: float) -> tuple[Tensor, Tensor]:
    """Which matrices need a new basis (``‖B - diag B‖ > τ‖B‖``), and ``diag(B)``.

    With ``τ = 0`` every matrix is refreshed (SPEC §3).
    """
    check = check_basis(matrices, basis, tolerance)
    return check.stale, check.diagonal


def orthonormal_basis(matrices: Tensor) -> Tensor:
    """``Q`` of ``qr(matrices)`` (Householder, as ``torch.linalg.qr``) without forming ``R``,
    returned row-major like every other stack here."""
    reflectors, scales = torch.geqrf(matrices)
    return torch.linalg.householder_product(reflectors, scales).contiguous()


def qr_iteration(
    matrices: Tensor,
    basis: Tensor,
    iterations: int,
    tolerance: float = 0.0,
    product: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Warm-started orthogonal iteration ``Q, _ = qr(A Q)``, up to ``iterations`` times.

    With ``tolerance > 0`` a matrix stops iterating as soon as its basis passes the
    criterion of ``check_basis`` (checked before every further iteration; callers check
    before the first, and may pass that check's ``product = A Q`` to save a matmul).
    Columns are kept sorted by *descending* eigenvalue estimate ``diag(Qᵀ A Q)``: the QR
    step hands the dominant direction to the first column, so a basis sorted that way
    stays in place under it. Returns the basis, the estimates and the permutation applied
    (``(n, d)`` indices into the unsorted columns) so that callers can permute state kept
    in the old column order.
    """
    n = matrices.shape[0]
    active = torch.arange(n, device=matrices.device)
    for iteration in range(iterations):
        every = len(active) == n
        if iteration > 0:
            subset = matrices if every else matrices[active]
            sub_basis = basis if every else basis[active]
            if tolerance > 0:
                check = check_basis(subset, sub_basis, tolerance)
                keep = check.stale.nonzero().flatten()
                if len(keep) == 0:
                    break
                if len(keep) < len(active):
                    active, product = active[keep], check.product[keep]
                    every = False
                else:
                    product = check.product
            else:
                product = subset @ sub_basis
        elif product is None:
            product = matrices @ basis
        if every:
            basis = orthonormal_basis(product)
        else:  # only after the first iteration: ``basis`` is already our own tensor
            basis[active] = orthonormal_basis(product)
    estimates = rayleigh_quotients(basis, matrices @ basis)
    order = estimates.argsort(dim=-1, descending=True, stable=True)
    if bool((order == torch.arange(order.shape[-1], device=order.device)).all()):
        return basis, estimates, order  # already sorted: no need to copy
    estimates = estimates.gather(-1, order)
    basis = basis.gather(-1, order.unsqueeze(-2).expand_as(basis))
    return basis, estimates, order
