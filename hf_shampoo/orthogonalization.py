"""Orthogonalization of stacked matrices, for spectral descent (Muon; docs/muon.md).

The orthogonal factor of ``X = U S Vᵀ`` (reduced SVD) is ``U Vᵀ``: every singular value
set to one. ``newton_schulz`` approximates it with the quintic iteration
``X ← aX + b(XXᵀ)X + c(XXᵀ)²X`` from ``X / ‖X‖_F`` (Muon's coefficients by default, which
trade exactness for speed: singular values land in about [0.7, 1.2]; or Polar Express's,
one polynomial per iteration, arXiv 2505.16932); ``svd_orthogonalize``
computes it exactly. Both take a stack ``(n, rows, cols)`` and work on all matrices in
batched calls. ``lr_adjustment`` is torch.optim.Muon's per-shape learning-rate scale.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# The Frobenius norm is clamped to this before the division, as Meta's implementation does.
NORM_FLOOR = 1e-8

#: Muon's quintic coefficients (Keller Jordan's; torch.optim.Muon's and Meta's default)
MUON = (3.4445, -4.7750, 2.0315)
#: Polar Express (Amsel, Persson, Musco, Gower, arXiv 2505.16932): one quintic per
#: iteration, each the minimax-optimal odd polynomial for the interval the previous ones
#: leave, as published for 5 iterations (with its safety margin) in modded-nanogpt, the
#: paper's GPT-2 experiments; further iterations repeat the last
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
#: Polar Express starts from ``X / (1.02 ‖X‖_F)``: its polynomials assume every singular
#: value at most 1, which bfloat16 rounding of the norm could break
POLAR_EXPRESS_NORM_SCALE = 1.02
#: the named schedules of ``newton_schulz_coefficients``
NAMED = {"muon": (MUON,), "polar_express": POLAR_EXPRESS}


def schedule(coefficients, iterations: int) -> tuple[list[tuple[float, float, float]], float]:
    """The ``(a, b, c)`` of each of ``iterations`` iterations and the factor the starting
    norm is multiplied by, from ``newton_schulz_coefficients``: one triple (every
    iteration), a sequence of triples (one per iteration, the last repeated) or a name of
    ``NAMED``."""
    scale = 1.0
    if isinstance(coefficients, str):
        scale = POLAR_EXPRESS_NORM_SCALE if coefficients == "polar_express" else 1.0
        coefficients = NAMED[coefficients]
    elif len(coefficients) == 3 and not isinstance(coefficients[0], (tuple, list)):
        coefficients = (coefficients,)
    triples = [tuple(float(v) for v in c) for c in coefficients]
    return [triples[min(i, len(triples) - 1)] for i in range(iterations)], scale


def newton_schulz(
    x: Tensor,
    iterations: int,
    coefficients=MUON,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """The quintic Newton–Schulz iteration on every matrix of ``x`` (``(n, rows, cols)``).

    ``coefficients``: one ``(a, b, c)`` for every iteration, one per iteration, or a name
    (``"muon"``, ``"polar_express"``; ``schedule``). Runs in ``dtype`` (default: ``x``'s)
    on the Gram matrix of the short side: wide matrices as they are (``XXᵀ``), tall ones
    transposed. Returns a new tensor of that dtype shaped like ``x``.
    """
    steps, scale = schedule(coefficients, iterations)
    if x.dim() != 3:
        raise ValueError(f"newton_schulz: expected a stack (n, rows, cols), got {tuple(x.shape)}")
    dtype = x.dtype if dtype is None else dtype
    tall = x.shape[-2] > x.shape[-1]
    y = x.mT if tall else x
    y = y.to(dtype=dtype, copy=True, memory_format=torch.contiguous_format)
    norm = torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True)
    if scale != 1.0:
        norm.mul_(scale)
    y.div_(norm.clamp_(min=NORM_FLOOR))
    gram = torch.empty((*y.shape[:-1], y.shape[-2]), dtype=dtype, device=y.device)
    other = torch.empty_like(y)
    for a, b, c in steps:
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
