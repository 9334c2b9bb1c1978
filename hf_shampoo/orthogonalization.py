"""Orthogonalization of stacked matrices, for spectral descent (Muon; docs/muon.md).

The orthogonal factor of ``X = U S Vᵀ`` (reduced SVD) is ``U Vᵀ``: every singular value
set to one. ``newton_schulz`` approximates it with the quintic iteration
``X ← aX + b(XXᵀ)X + c(XXᵀ)²X`` from ``X / ‖X‖_F`` (Muon's coefficients by default, which
trade exactness for speed: singular values land in about [0.7, 1.2]); ``svd_orthogonalize``
computes it exactly. Both take a stack ``(n, rows, cols)`` and work on all matrices in
batched calls. ``lr_adjustment`` is torch.optim.Muon's per-shape learning-rate scale.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# The Frobenius norm is clamped to this before the division, as Meta's implementation does.
NORM_FLOOR = 1e-8


def newton_schulz(
    x: Tensor,
    iterations: int,
    coefficients: tuple[float, float, float],
    dtype: torch.dtype | None = None,
) -> Tensor:
    """The quintic Newton–Schulz iteration on every matrix of ``x`` (``(n, rows, cols)``).

    Runs in ``dtype`` (default: ``x``'s) on the Gram matrix of the short side: wide
    matrices as they are (``XXᵀ``), tall ones transposed. Returns a new tensor of that dtype
    shaped like ``x``.
    """
    if x.dim() != 3:
        raise ValueError(f"newton_schulz: expected a stack (n, rows, cols), got {tuple(x.shape)}")
    dtype = x.dtype if dtype is None else dtype
    tall = x.shape[-2] > x.shape[-1]
    y = x.mT if tall else x
    y = y.to(dtype=dtype, copy=True, memory_format=torch.contiguous_format)
    norm = torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True)
    y.div_(norm.clamp_(min=NORM_FLOOR))
    a, b, c = (float(v) for v in coefficients)
    gram = torch.empty((*y.shape[:-1], y.shape[-2]), dtype=dtype, device=y.device)
    other = torch.empty_like(y)
    for _ in range(iterations):
        torch.bmm(y, y.mT, out=gram)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        torch.baddbmm(y, poly, y, beta=a, out=other)
        y, other = other, y
    return y.mT if tall else y


def svd_orthogonalize(x: Tensor) -> Tensor:
    """``U Vᵀ`` of every matrix of ``x`` from its reduced SVD (exact; slower)."""
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    return u @ vh


def lr_adjustment(rule: str | None, rows: int, cols: int) -> float:
    """torch.optim.Muon's ``adjust_lr_fn`` on a ``rows × cols`` matrix: ``"original"``
    ``√max(1, rows/cols)``, ``"match_rms_adamw"`` ``0.2·√max(rows, cols)`` (an update of
    AdamW's RMS), ``"spectral_unclamped"`` ``√(rows/cols)``; None: 1 (Meta's scale)."""
    if rule is None:
        return 1.0
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "spectral_unclamped":
        return math.sqrt(rows / cols)
    raise ValueError(f"unknown spectral_lr_adjustment {rule!r}")
