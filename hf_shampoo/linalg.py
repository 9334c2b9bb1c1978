"""Batched linear algebra of the amortized computation (SPEC §2–§3).

Everything here works on stacks of same-size symmetric matrices ``(n, d, d)``: symmetric
eigendecomposition with a float64 retry and a per-matrix fallback, the regularised inverse
root, the off-diagonal criterion that decides whether an eigenbasis is still good, and the
warm-started QR refresh. Nothing else in the package calls ``torch.linalg``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


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
        if torch.isfinite(values).all() and torch.isfinite(vectors).all():
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
        values, vectors = torch.linalg.eigh(matrices)
        if bool(torch.isfinite(values).all()) and bool(torch.isfinite(vectors).all()):
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


def power(values: Tensor, exponent: float) -> Tensor:
    """``values ** exponent``, computed the same way wherever an element sits in the tensor.

    On CPU, ``pow`` takes a vectorised path for most elements and a scalar one for the
    tail, and the two can differ in the last bit; so a block's result would depend on how
    many blocks share its batch, breaking bit-equality between a distributed run and one
    process. Exponents ``±1/2^k`` (the defaults 1/2 and 1/4 among them) use chains of
    correctly rounded square roots and one division instead; other exponents are computed
    in float64 and rounded to ``values.dtype``.
    """
    magnitude, steps = abs(exponent), 0
    while magnitude < 1 and steps < 6:
        magnitude, steps = magnitude * 2, steps + 1
    if magnitude == 1:
        out = values
        for _ in range(steps):
            out = out.sqrt()
        return out.reciprocal() if exponent < 0 else out
    return values.double().pow(exponent).to(values.dtype)


def inverse_root_from_eigen(eigenvalues: Tensor, eigenvectors: Tensor, exponent: float) -> Tensor:
    """``Q diag(λ^-e) Qᵀ`` for a stack (eigenvalues already regularised)."""
    return (eigenvectors * power(eigenvalues, -exponent).unsqueeze(-2)) @ eigenvectors.mT


def off_diagonal_ratio(matrices: Tensor, basis: Tensor) -> tuple[Tensor, Tensor]:
    """``B = Qᵀ A Q`` and ``‖B - diag(B)‖_F / ‖B‖_F`` per matrix (SPEC §3 criterion)."""
    rotated = basis.mT @ matrices @ basis
    diagonal = torch.diagonal(rotated, dim1=-2, dim2=-1)
    total = torch.linalg.matrix_norm(rotated)
    off = torch.linalg.matrix_norm(rotated - torch.diag_embed(diagonal))
    return rotated, off / total.clamp_min(torch.finfo(total.dtype).tiny)


def stale_mask(matrices: Tensor, basis: Tensor, tolerance: float) -> tuple[Tensor, Tensor]:
    """Which matrices need a new basis (``‖B - diag B‖ > τ‖B‖``), and ``diag(B)``.

    With ``τ = 0`` every matrix is refreshed (SPEC §3).
    """
    rotated, ratio = off_diagonal_ratio(matrices, basis)
    diagonal = torch.diagonal(rotated, dim1=-2, dim2=-1)
    if tolerance == 0:
        return torch.ones_like(ratio, dtype=torch.bool), diagonal
    return ratio > tolerance, diagonal


def qr_iteration(
    matrices: Tensor, basis: Tensor, iterations: int, tolerance: float = 0.0
) -> tuple[Tensor, Tensor, Tensor]:
    """Warm-started orthogonal iteration ``Q, _ = qr(A Q)``, up to ``iterations`` times.

    With ``tolerance > 0`` a matrix stops iterating as soon as its basis passes the
    criterion of ``stale_mask`` (checked before every further iteration; callers check
    before the first). Columns are kept sorted by *descending* eigenvalue estimate
    ``diag(Qᵀ A Q)``: the QR step hands the dominant direction to the first column, so a
    basis sorted that way stays in place under it. Returns the basis, the estimates and
    the permutation applied (``(n, d)`` indices into the unsorted columns) so that callers
    can permute state kept in the old column order.
    """
    basis = basis.clone()
    active = torch.arange(matrices.shape[0], device=matrices.device)
    for iteration in range(iterations):
        if iteration > 0 and tolerance > 0:
            stale, _ = stale_mask(matrices[active], basis[active], tolerance)
            active = active[stale]
            if len(active) == 0:
                break
        if len(active) == matrices.shape[0]:
            basis, _ = torch.linalg.qr(matrices @ basis)
        else:
            basis[active] = torch.linalg.qr(matrices[active] @ basis[active])[0]
    estimates = torch.diagonal(basis.mT @ matrices @ basis, dim1=-2, dim2=-1)
    order = estimates.argsort(dim=-1, descending=True, stable=True)
    estimates = estimates.gather(-1, order)
    basis = basis.gather(-1, order.unsqueeze(-2).expand_as(basis))
    return basis, estimates, order
