"""Spectral descent (Muon; Meta's ``SpectralDescentPreconditionerConfig``; docs/muon.md).

Every block is a matrix (parameters are blocked as ``(dim 0, the rest)``, then cut at
``max_preconditioner_dim`` like every kind), and its search direction is the orthogonalized
filtered gradient ``s · orth(Ĝ)``: ``orth`` by Newton–Schulz (``newton_schulz_iterations``,
``newton_schulz_coefficients``, run in ``newton_schulz_dtype``, default the factor dtype) or
exactly by SVD (``spectral_orthogonalization="svd"``, in the factor dtype), ``s`` the block's
``spectral_lr_adjustment`` (torch.optim.Muon's rules; 1 by default, as Meta). A stack's
blocks share one shape, so all of them are orthogonalized by one batched iteration. No
state of its own; momentum is the filtered gradient (``betas[0]``, ``beta3`` for Nesterov).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..keywords import Keyword, choice, fail, integer, is_real, working_dtype
from ..orthogonalization import MUON, NAMED, lr_adjustment, newton_schulz, svd_orthogonalize
from .base import Preconditioner


def _is_triple(value: Any) -> bool:
    return (isinstance(value, (tuple, list)) and len(value) == 3
            and all(is_real(c) for c in value))


def _check_coefficients(key: str, value: Any) -> None:
    if isinstance(value, str) and value in NAMED:
        return
    if _is_triple(value):
        return
    if isinstance(value, (tuple, list)) and value and all(_is_triple(c) for c in value):
        return
    fail(key, value, f"expected three finite real numbers (a, b, c) of the quintic iteration "
         f"X <- aX + b(XX^T)X + c(XX^T)^2 X, a sequence of such triples (one per iteration, "
         f"the last repeated), or one of {', '.join(map(repr, NAMED))}")


# torch.optim.Muon's adjust_lr_fn rules on a block of (rows, cols); None: scale 1 (Meta)
SPECTRAL_KEYWORDS = (
    Keyword("spectral_orthogonalization", "newton_schulz", str, choice("newton_schulz", "svd"),
            doc=(
            "spectral descent: `\"newton_schulz\"` or `\"svd\"` (exact `U Vᵀ`)")),
    Keyword("newton_schulz_iterations", 5, int, integer(1), doc=(
            "spectral descent: Newton–Schulz iterations")),
    Keyword("newton_schulz_coefficients", MUON, tuple | str, _check_coefficients,
            annotation="tuple | str", doc=(
            "spectral descent: `(a, b, c)` of `X ← aX + b(XXᵀ)X + c(XXᵀ)²X` for every "
            "iteration (default Muon's), one triple per iteration (the last repeated), "
            "`\"muon\"` or `\"polar_express\"` (arXiv 2505.16932: a minimax-optimal "
            "polynomial per iteration, from `X / (1.02 ‖X‖_F)`; its accuracy: "
            "[Muon](muon.md#polar-express))")),
    working_dtype("newton_schulz_dtype", doc=(
            "spectral descent: dtype of the iteration (`None` = `factor_matrix_dtype`; "
            "`torch.bfloat16` as torch.optim.Muon)")),
    Keyword("spectral_lr_adjustment", None, str,
            choice(None, "original", "match_rms_adamw", "spectral_unclamped"),
            doc=(
            "spectral descent: per-block scale, torch.optim.Muon's `adjust_lr_fn` rules on "
            "`(rows, cols)`: `None` (1, Meta's), `\"original\"`, `\"match_rms_adamw\"`, "
            "`\"spectral_unclamped\"`")),
)


class SpectralDescent(Preconditioner):
    name = "spectral_descent"
    matrix_blocks = True
    refreshes = False
    keywords = SPECTRAL_KEYWORDS

    def preconditioned_dims(self, group: dict, order: int) -> list[int]:
        return []

    def step_flops(self, shape: tuple[int, ...], group: dict) -> float:
        """Newton–Schulz: per iteration ``X Xᵀ`` (``2 s² n``), its square (``2 s³``) and the
        product with ``X`` (``2 s² n``), ``s = min(m, n)``; an SVD about ``10 m n s``."""
        rows, cols = shape
        small = min(rows, cols)
        if group["spectral_orthogonalization"] == "svd":
            return 10.0 * rows * cols * small
        per_iteration = 4.0 * small * small * max(rows, cols) + 2.0 * small**3
        return group["newton_schulz_iterations"] * per_iteration + 10.0 * rows * cols

    def precondition(self, stack, job, filtered: Tensor, out: Tensor, scratch) -> Tensor:
        group = job.group
        if group["spectral_orthogonalization"] == "svd":  # in the factor dtype
            orthogonal = svd_orthogonalize(filtered.to(group["factor_matrix_dtype"]))
        else:
            orthogonal = newton_schulz(
                filtered, group["newton_schulz_iterations"], group["newton_schulz_coefficients"],
                group["newton_schulz_dtype"] or group["factor_matrix_dtype"])
        rows, cols = stack.shape
        scale = lr_adjustment(group["spectral_lr_adjustment"], rows, cols)
        if scale == 1.0:
            return out.copy_(orthogonal)
        if orthogonal.dtype == out.dtype:
            return torch.mul(orthogonal, scale, out=out)
        return out.copy_(orthogonal).mul_(scale)  # scaled in out's (wider) dtype
