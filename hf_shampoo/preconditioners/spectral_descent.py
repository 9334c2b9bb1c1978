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

import torch
from torch import Tensor

from ..orthogonalization import lr_adjustment, newton_schulz, svd_orthogonalize
from .base import Preconditioner


class SpectralDescent(Preconditioner):
    name = "spectral_descent"
    matrix_blocks = True
    refreshes = False

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
                filtered, group["newton_schulz_iterations"],
                tuple(group["newton_schulz_coefficients"]),
                group["newton_schulz_dtype"] or group["factor_matrix_dtype"])
        rows, cols = stack.shape
        scale = lr_adjustment(group["spectral_lr_adjustment"], rows, cols)
        if scale == 1.0:
            return out.copy_(orthogonal)
        if orthogonal.dtype == out.dtype:
            return torch.mul(orthogonal, scale, out=out)
        return out.copy_(orthogonal).mul_(scale)  # scaled in out's (wider) dtype
