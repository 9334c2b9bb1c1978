"""Keeping an eigenbasis (docs/design.md §3): the off-diagonal criterion that decides whether
a kept basis still diagonalises a factor, and the warm-started QR refreshes (our QR
iteration and Meta's QR algorithm, with Householder or Cholesky-QR orthogonalisation). On
stacks of same-size symmetric matrices ``(n, d, d)``, as ``linalg.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .linalg import finite_rows, per_matrix_threads, syrk


def rayleigh_quotients(basis: Tensor, product: Tensor) -> Tensor:
    """``diag(Qᵀ A Q)`` from ``product = A Q``: column-wise dot products, no second matmul."""
    return (basis * product).sum(dim=-2)


def off_diagonal_ratio(matrices: Tensor, basis: Tensor) -> tuple[Tensor, Tensor]:
    """``B = Qᵀ A Q`` and ``‖B - diag(B)‖_F / ‖B‖_F`` per matrix (docs/design.md §3 criterion)."""
    rotated = basis.mT @ (matrices @ basis)
    return rotated, _ratio_of(rotated)


def _ratio_of(rotated: Tensor) -> Tensor:
    diagonal = torch.diagonal(rotated, dim1=-2, dim2=-1)
    total = torch.linalg.matrix_norm(rotated)
    off = torch.linalg.matrix_norm(rotated - torch.diag_embed(diagonal))
    return off / total.clamp_min(torch.finfo(total.dtype).tiny)


@dataclass
class BasisCheck:
    """docs/design.md §3 criterion for a stack of matrices ``A`` and kept bases ``Q``.

    ``stale``: which matrices need a new basis; ``diagonal``: ``diag(Qᵀ A Q)``;
    ``product``: ``A Q``, which the first QR step ``qr(A Q)`` reuses.
    """

    stale: Tensor
    diagonal: Tensor
    product: Tensor


def check_basis(
    matrices: Tensor, basis: Tensor, tolerance: float, product: Tensor | None = None,
    zero_means_all: bool = True,
) -> BasisCheck:
    """``stale = ‖B - diag B‖_F > τ ‖B‖_F`` with ``B = Qᵀ A Q``; with ``τ = 0`` every matrix
    is stale (docs/design.md §3), unless ``zero_means_all=False``: then, as in Meta's QR algorithm,
    only matrices whose ``B`` is not exactly diagonal. ``product``: ``A Q`` if known.

    One matmul instead of two: ``‖B‖_F = ‖A‖_F`` for an orthogonal ``Q``, and the diagonal
    of ``B`` is ``Σ_k Q_ki (A Q)_ki``, so ``‖B - diag B‖² = ‖A‖² - ‖diag B‖²`` (the
    difference taken in float64). It loses absolute precision of about ``√d`` units of
    round-off of ``‖A‖²`` (and ``Q`` is orthogonal only to round-off), so matrices whose
    squared ratio lies within ``16 √d ε_dtype`` of ``τ²`` are decided with the explicit
    ``B`` instead.
    """
    product = matrices @ basis if product is None else product
    diagonal = rayleigh_quotients(basis, product)
    if tolerance == 0 and zero_means_all:
        return BasisCheck(torch.ones(matrices.shape[0], dtype=torch.bool,
                                     device=matrices.device), diagonal, product)
    total = torch.linalg.vector_norm(matrices, dim=(-2, -1)).double().square()
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

    With ``τ = 0`` every matrix is refreshed (docs/design.md §3).
    """
    check = check_basis(matrices, basis, tolerance)
    return check.stale, check.diagonal


def orthonormal_basis(matrices: Tensor, method: str = "householder") -> Tensor:
    """``Q`` of ``qr(matrices)`` without forming ``R``, row-major like every other stack here.

    ``"householder"``: LAPACK's Householder QR (as ``torch.linalg.qr``). ``"cholesky_qr"``:
    shifted Cholesky-QR (``cholesky_qr_basis``: matrix products, a Cholesky factorization
    and a triangular solve per pass), with Householder for the matrices it cannot do. Both
    give the same ``Q`` up to column signs and round-off.
    """
    if method == "cholesky_qr":
        basis, ok = cholesky_qr_basis(matrices)
        if not bool(ok.all()):
            bad = (~ok).nonzero().flatten()
            basis[bad] = orthonormal_basis(matrices[bad])
        return basis
    basis = torch.empty_like(matrices, memory_format=torch.contiguous_format)
    per_matrix_threads(_householder_q_into, [((matrices,), (basis,))])
    return basis


def cholesky_qr_basis(matrices: Tensor, passes: int = 3) -> tuple[Tensor, Tensor]:
    """``Q`` of ``X = Q R`` for a stack of square ``X`` by shifted Cholesky-QR3 (Fukaya et
    al., SIAM J. Sci. Comput. 2020): a first pass on ``XᵀX + sI`` with
    ``s = 11 (m n + n (n + 1)) u ‖X‖_F²`` (``u``: unit round-off), which keeps the
    Cholesky factorization defined for ``κ(X)`` up to about ``1/u``, then plain passes
    ``Q ← Q chol(QᵀQ)⁻ᵀ`` that restore orthogonality. ``R`` has a positive diagonal, so
    ``Q`` is Householder's up to column signs. Returns ``(Q, ok)``: ``ok`` is False for a
    matrix whose factorization failed or whose last Gram matrix was far from ``I`` (a
    rank-deficient ``X``): callers use Householder for those.
    """
    n, d = matrices.shape[0], matrices.shape[-1]
    unit = torch.finfo(matrices.dtype).eps / 2
    basis = matrices.contiguous()
    ok = torch.ones(n, dtype=torch.bool, device=matrices.device)
    eye = torch.eye(d, dtype=matrices.dtype, device=matrices.device)
    for index in range(passes):
        gram = syrk(matrices.new_empty(n, d, d), basis.mT)
        if index == 0:
            norm_sq = gram.diagonal(dim1=-2, dim2=-1).sum(dim=-1)  # ‖X‖_F²
            shift = 11 * (d * d + d * (d + 1)) * unit * norm_sq
            gram.diagonal(dim1=-2, dim2=-1).add_(shift.unsqueeze(-1))
        elif index == passes - 1:
            # the last pass starts from a nearly orthogonal Q, or the result is not trusted
            distance = torch.linalg.matrix_norm(gram - eye)
            ok &= distance <= 0.5
        lower, info = torch.linalg.cholesky_ex(gram)
        ok &= info == 0
        basis = torch.linalg.solve_triangular(lower.mT, basis, upper=True, left=False)
    ok &= finite_rows(basis)
    return basis, ok


def _householder_q_into(matrices: Tensor, basis: Tensor) -> None:
    reflectors, scales = torch.geqrf(matrices)
    basis.copy_(torch.linalg.householder_product(reflectors, scales))


def qr_iteration(
    matrices: Tensor,
    basis: Tensor,
    iterations: int,
    tolerance: float = 0.0,
    product: Tensor | None = None,
    method: str = "householder",
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
            basis = orthonormal_basis(product, method)
        else:  # only after the first iteration: ``basis`` is already our own tensor
            basis[active] = orthonormal_basis(product, method)
    estimates = rayleigh_quotients(basis, matrices @ basis)
    order = estimates.argsort(dim=-1, descending=True, stable=True)
    if bool((order == torch.arange(order.shape[-1], device=order.device)).all()):
        return basis, estimates, order  # already sorted: no need to copy
    estimates = estimates.gather(-1, order)
    basis = basis.gather(-1, order.unsqueeze(-2).expand_as(basis))
    return basis, estimates, order


def qr_algorithm_direct(
    matrices: Tensor, basis: Tensor, iterations: int, tolerance: float = 0.0,
    method: str = "householder", first_stale: list | None = None,
) -> tuple[Tensor, Tensor]:
    """Meta's QR algorithm (``matrix_functions.qr_algorithm``) without the rotated frame.

    With ``Q`` orthogonal, ``qr(QᵀAQ) = Qᵀ qr(AQ)`` (the QR factorization with a positive
    ``R`` diagonal is unique), so Meta's ``Q Q'`` is ``qr(AQ)``'s ``Q`` and its ``R Q'`` is
    ``Q₁ᵀ A Q₁``: one matmul ``A Q`` per iteration and one for the estimates, instead of
    four, and the factorization by ``method`` (``orthonormal_basis``). The criterion is
    Meta's, via ``check_basis`` (``τ = 0``: iterate unless ``B`` is exactly diagonal).
    Column signs may differ from Meta's, which nothing downstream sees. Returns
    ``(basis, estimates)`` sorted ascending (stable); ``first_stale`` receives the first
    check's ``stale`` mask (which matrices it iterated at all), for ``metrics()``.
    """
    n = matrices.shape[0]
    basis = basis.clone(memory_format=torch.contiguous_format)
    product = matrices @ basis
    active = torch.arange(n, device=matrices.device)
    for _ in range(iterations):
        every = len(active) == n
        sub_a = matrices if every else matrices[active]
        sub_q = basis if every else basis[active]
        sub_p = product if every else product[active]
        check = check_basis(sub_a, sub_q, tolerance, sub_p, zero_means_all=False)
        if first_stale is not None and not first_stale:
            first_stale.append(check.stale)
        going = check.stale.nonzero().flatten()
        if len(going) == 0:
            break
        if len(going) < len(active):
            active, sub_a, sub_p = active[going], sub_a[going], sub_p[going]
            every = False
        new_q = orthonormal_basis(sub_p, method)
        new_p = sub_a @ new_q
        if every:
            basis, product = new_q, new_p
        else:
            basis[active], product[active] = new_q, new_p
    values, order = rayleigh_quotients(basis, product).sort(dim=-1, stable=True)
    basis = basis.gather(-1, order.unsqueeze(-2).expand_as(basis))
    return basis, values
