"""Tensor contractions of Kronecker-factored preconditioning over stacks of blocks.

A stack is a tensor ``(n, d_1, ..., d_k)`` holding ``n`` same-shape blocks. These functions
compute every block's factor statistics and apply per-dim matrices to every block in
batched ``bmm`` calls; 1-D and 2-D blocks, by far the most common, take direct paths.
Callers on the steady path pass ``out`` / ``scratch`` tensors so that nothing is allocated
per step; without them, results are allocated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .linalg import syrk


def batched_matvec(matrices: Tensor, vectors: Tensor, out: Tensor | None = None) -> Tensor:
    """``(n, d, d) @ (n, d)`` per block, as row vectors times transposed matrices.

    Bit-for-bit the same for a block whatever else is in its stack: ``bmm`` of a matrix
    and a one-column right side is not (on CPU, a stack of one and a stack of several round
    differently from ``d = 31`` on), and the lossless distributors give an owner a stack of
    only its own blocks, where one process stacks all of them (docs/design.md §8). The row
    form ``xᵀ Mᵀ`` is computed alike for any stack size.
    """
    rows = vectors.unsqueeze(-2)
    if out is None:
        return torch.bmm(rows, matrices.mT).squeeze(-2)
    return torch.bmm(rows, matrices.mT, out=out.unsqueeze(-2)).squeeze(-2)


def _bmm(left: Tensor, right: Tensor, out: Tensor | None = None) -> Tensor:
    """``torch.bmm``, through ``batched_matvec`` where the right side has one column."""
    if right.shape[-1] != 1:
        return torch.bmm(left, right, out=out)
    column = batched_matvec(left, right.squeeze(-1), None if out is None else out.squeeze(-1))
    return column.unsqueeze(-1)


def unfold(stack: Tensor, dim: int, scratch: Tensor | None = None) -> Tensor:
    """``(n, d_dim, rest)``: block dim ``dim`` (0-based, within the block) to the front.

    A view for the first dim; other dims are copied (into ``scratch`` when given).
    """
    if stack.dim() == 2:  # 1-D blocks
        return stack.unsqueeze(-1)
    n, d = stack.shape[0], stack.shape[dim + 1]
    if dim == 0:
        return stack.reshape(n, d, -1)
    moved = stack.movedim(dim + 1, 1)
    if scratch is None:
        return moved.reshape(n, d, -1)
    return scratch.view(moved.shape).copy_(moved).view(n, d, -1)


def update_factor(
    factor: Tensor,
    stack: Tensor,
    dim: int,
    beta2: float,
    out_of_place: bool = False,
    scratch: Tensor | None = None,
) -> Tensor:
    """``F = beta2 F + w G_(dim) G_(dim)ᵀ`` with ``w = 1`` if ``beta2 == 1`` else ``1 - beta2``.

    For a 2-D stack this is ``G Gᵀ`` for dim 0 and ``Gᵀ G`` for dim 1 (docs/design.md §2,
    line 2); the first and the last dim of any block need no copy, middle dims are unfolded into
    ``scratch`` (a tensor of the stack's size) when given. The product is computed as a
    symmetric one (``linalg.syrk``). A diagonal factor (``diagonal_aspect``), stacked as
    ``(n, d)``, takes only the diagonal: the sums of squares over the other dims.
    """
    weight = 1.0 if beta2 == 1.0 else 1.0 - beta2
    if factor.dim() == 2:  # a diagonal factor (n, d): the diagonal of G_(dim) G_(dim)ᵀ
        others = [k + 1 for k in range(stack.dim() - 1) if k != dim]
        squares = stack.square().sum(dim=others) if others else stack.square()
        if out_of_place:
            return factor.mul(beta2).add_(squares, alpha=weight)
        return factor.mul_(beta2).add_(squares, alpha=weight)
    if stack.dim() >= 3 and dim == stack.dim() - 2:  # last dim: (n, rest, d), over rest
        left = stack.reshape(stack.shape[0], -1, stack.shape[-1]).mT
    else:
        left = unfold(stack, dim, scratch)
    if out_of_place:
        factor = factor.clone()
    return syrk(factor, left, beta=beta2, alpha=weight)


def mode_product(stack: Tensor, matrix: Tensor, dim: int, transpose: bool = False) -> Tensor:
    """Multiply every block along ``dim`` by its matrix: ``Y = X ×_dim M`` (``Mᵀ`` if asked).

    ``Y[.., i, ..] = Σ_l M[i, l] X[.., l, ..]`` for each block of the stack.
    """
    m = matrix.mT if transpose else matrix
    if stack.dim() == 2:
        return batched_matvec(m, stack)
    if stack.dim() == 3:
        return _bmm(m, stack) if dim == 0 else torch.bmm(stack, m.mT)
    moved = stack.movedim(dim + 1, 1)
    product = _bmm(m, moved.reshape(moved.shape[0], moved.shape[1], -1))
    return product.reshape(moved.shape).movedim(1, dim + 1)


def multi_mode_product(
    stack: Tensor,
    matrices: Sequence[Tensor | None],
    transpose: bool = False,
    out: Tensor | None = None,
    scratch: Tensor | None = None,
) -> Tensor:
    """``X ×_1 M_1 ... ×_k M_k``, skipping dims whose matrix is None (identity).

    With ``out`` (and ``scratch``, both the stack's shape, neither aliasing ``stack``) the
    result is written to ``out`` without allocating. Blocks of order 3 and more cycle their
    dims (``tensordot`` style): each step contracts the leading dim and appends the new
    one at the end, ``Z = X_(1)ᵀ Mᵀ``, so every step is one ``bmm`` of views, no permute.
    """
    if out is None:
        out = torch.empty_like(stack)
    if scratch is None:
        scratch = torch.empty_like(stack)
    if all(m is None for m in matrices):
        return out.copy_(stack)
    mats = [None if m is None else (m.mT if transpose else m) for m in matrices]
    if stack.dim() == 2:  # 1-D blocks: matrix-vector products
        return batched_matvec(mats[0], stack, out=out)
    if stack.dim() == 3:  # 2-D blocks: M_1 X M_2ᵀ
        left, right = mats
        if left is None:
            return torch.bmm(stack, right.mT, out=out)
        if right is None:
            return _bmm(left, stack, out=out)
        _bmm(left, stack, out=scratch)
        return torch.bmm(scratch, right.mT, out=out)
    n, k = stack.shape[0], stack.dim() - 1
    current, shape = stack, tuple(stack.shape[1:])
    for j, m in enumerate(mats):
        # ping-pong between the two buffers so that the last step lands in ``out``
        target = out if (k - 1 - j) % 2 == 0 else scratch
        rows = current.reshape(n, shape[0], -1)  # (n, d_j, rest)
        rotated = target.view(n, -1, shape[0])  # (n, rest, d_j)
        if m is None:
            rotated.copy_(rows.mT)
        else:
            torch.bmm(rows.mT, m.mT, out=rotated)
        current, shape = rotated, shape[1:] + shape[:1]
    return out
