"""Tensor contractions of Kronecker-factored preconditioning over stacks of blocks.

A stack is a tensor ``(n, d_1, ..., d_k)`` holding ``n`` same-shape blocks. These functions
compute every block's factor statistics and apply per-dim matrices to every block in
batched ``bmm`` calls; 1-D and 2-D blocks, by far the most common, take direct paths.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def unfold(stack: Tensor, dim: int) -> Tensor:
    """``(n, d_dim, rest)``: block dim ``dim`` (0-based, within the block) to the front."""
    if stack.dim() == 2:  # 1-D blocks
        return stack.unsqueeze(-1)
    if dim == 0:
        return stack.reshape(stack.shape[0], stack.shape[1], -1)
    return stack.movedim(dim + 1, 1).reshape(stack.shape[0], stack.shape[dim + 1], -1)


def update_factor(
    factor: Tensor, stack: Tensor, dim: int, beta2: float, out_of_place: bool = False
) -> Tensor:
    """``F = beta2 F + w G_(dim) G_(dim)ᵀ`` with ``w = 1`` if ``beta2 == 1`` else ``1 - beta2``.

    For a 2-D stack this is ``G Gᵀ`` for dim 0 and ``Gᵀ G`` for dim 1 (SPEC §2 line 2).
    """
    weight = 1.0 if beta2 == 1.0 else 1.0 - beta2
    if stack.dim() == 3 and dim == 1:
        left, right = stack.mT, stack
    else:
        left = unfold(stack, dim)
        right = left.mT
    if out_of_place:
        return torch.baddbmm(factor, left, right, beta=beta2, alpha=weight)
    return factor.baddbmm_(left, right, beta=beta2, alpha=weight)


def mode_product(stack: Tensor, matrix: Tensor, dim: int, transpose: bool = False) -> Tensor:
    """Multiply every block along ``dim`` by its matrix: ``Y = X ×_dim M`` (``Mᵀ`` if asked).

    ``Y[.., i, ..] = Σ_l M[i, l] X[.., l, ..]`` for each block of the stack.
    """
    m = matrix.mT if transpose else matrix
    if stack.dim() == 2:
        return torch.bmm(m, stack.unsqueeze(-1)).squeeze(-1)
    if stack.dim() == 3:
        return torch.bmm(m, stack) if dim == 0 else torch.bmm(stack, m.mT)
    moved = stack.movedim(dim + 1, 1)
    product = torch.bmm(m, moved.reshape(moved.shape[0], moved.shape[1], -1))
    return product.reshape(moved.shape).movedim(1, dim + 1)


def multi_mode_product(
    stack: Tensor, matrices: Sequence[Tensor | None], transpose: bool = False
) -> Tensor:
    """``X ×_1 M_1 ... ×_k M_k``, skipping dims whose matrix is None (identity)."""
    if stack.dim() == 3 and not transpose and all(m is not None for m in matrices):
        return torch.bmm(torch.bmm(matrices[0], stack), matrices[1].mT)
    for dim, matrix in enumerate(matrices):
        if matrix is not None:
            stack = mode_product(stack, matrix, dim, transpose)
    return stack
