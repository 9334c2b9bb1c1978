"""Blocking (docs/design.md §1): which Kronecker-factored blocks a parameter is cut into.

A parameter is reshaped to its *merged shape* (size-1 dims dropped, adjacent small dims
merged from the last dim to the first) and then split into blocks of at most
``max_preconditioner_dim`` along every dim. Blocks are identified by ``(param, index)``
with indices in row-major order; that identity does not depend on the world size. A
parameter of fused experts ``(E, *rest)`` (``experts=True``) is blocked as ``E`` independent
copies of the blocking of ``rest``, laid out in one merged view ``(E * m0, *m_rest)``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def merged_shape(shape: Sequence[int], max_preconditioner_dim: int) -> tuple[int, ...]:
    """Drop size-1 dims, then merge adjacent dims from the last to the first while the
    product stays ``<= max_preconditioner_dim``. A 0-d (or all-ones) shape becomes ``(1,)``.
    """
    dims = [int(d) for d in shape if d != 1]
    if not dims:
        return (1,)
    merged = [dims[-1]]
    for d in reversed(dims[:-1]):
        if merged[0] * d <= max_preconditioner_dim:
            merged[0] *= d
        else:
            merged.insert(0, d)
    return tuple(merged)


def matrix_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """A parameter as a matrix, for kinds that need one (spectral descent): ``(dim 0, the
    product of the rest)``; 2-D parameters as they are. Needs at least 2 dims."""
    if len(shape) < 2:
        raise ValueError(f"a matrix needs at least 2 dims, got shape {tuple(shape)}")
    return (int(shape[0]), math.prod(int(d) for d in shape[1:]))


def _chunks(size: int, max_dim: int) -> list[tuple[int, int]]:
    return [(start, min(start + max_dim, size)) for start in range(0, size, max_dim)]


def block_slices(
    shape: Sequence[int], max_preconditioner_dim: int, matrix: bool = False,
    experts: bool = False,
) -> tuple[tuple[int, ...], list[tuple[slice, ...]]]:
    """The merged shape (``matrix``: ``matrix_shape``) and, in row-major order, the slices
    of each block within it.

    ``experts``: dim 0 indexes independent matrices (a mixture of experts' fused weight
    ``(E, *rest)``). Each is blocked as ``rest`` alone; the merged shape is
    ``(E * m0, *m_rest)`` for ``rest``'s merged shape ``m``, whose dim-0 block boundaries
    restart at every expert, so no block spans two experts and every block is still a box
    of one merged view. Blocks are numbered expert by expert.
    """
    if experts:
        if len(shape) < 1:
            raise ValueError("experts=True needs a dim 0 of experts, got a 0-d shape")
        count = int(shape[0])
        unit, unit_slices = block_slices(shape[1:], max_preconditioner_dim, matrix)
        rows = unit[0]
        slices = [
            (slice(e * rows + block[0].start, e * rows + block[0].stop), *block[1:])
            for e in range(count) for block in unit_slices
        ]
        return (count * rows, *unit[1:]), slices
    merged = matrix_shape(shape) if matrix else merged_shape(shape, max_preconditioner_dim)
    per_dim = [_chunks(d, max_preconditioner_dim) for d in merged]
    slices = [
        tuple(slice(a, b) for a, b in combo) for combo in itertools.product(*per_dim)
    ]
    return merged, slices


def block_shapes(shape: Sequence[int], max_preconditioner_dim: int) -> list[tuple[int, ...]]:
    """Shapes of the blocks of a parameter of this shape, in row-major order."""
    _, slices = block_slices(shape, max_preconditioner_dim)
    return [tuple(s.stop - s.start for s in block) for block in slices]


@dataclass(frozen=True)
class ParamBlocking:
    """How one parameter is blocked: merged shape and the slices of its blocks."""

    shape: tuple[int, ...]
    merged: tuple[int, ...]
    slices: tuple[tuple[slice, ...], ...]

    @classmethod
    def of(cls, shape: Sequence[int], max_preconditioner_dim: int,
           matrix: bool = False, experts: bool = False) -> ParamBlocking:
        merged, slices = block_slices(shape, max_preconditioner_dim, matrix, experts)
        return cls(tuple(int(d) for d in shape), merged, tuple(slices))

    @property
    def block_shapes(self) -> list[tuple[int, ...]]:
        return [tuple(s.stop - s.start for s in block) for block in self.slices]

    def views(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``tensor`` (shaped like the parameter) for each block.

        A single-block parameter gets the tensor reshaped (a view when possible). A
        multi-block parameter needs a tensor whose merged reshape is a view; callers fall
        back to ``assemble``/copies otherwise.
        """
        if len(self.slices) == 1:
            return [tensor.reshape(self.merged)]
        return [tensor.view(self.merged)[block] for block in self.slices]

    def can_view(self, tensor: torch.Tensor) -> bool:
        if len(self.slices) == 1:
            return True
        try:
            tensor.view(self.merged)
        except RuntimeError:
            return False
        return True


def expert_shape(shape: Sequence[int], experts: bool) -> tuple[int, ...]:
    """The shape of one expert of a fused-experts parameter (``experts``: ``shape[1:]``),
    else the shape itself: what the per-matrix rules (vector-like, elongated) look at."""
    return tuple(int(d) for d in (shape[1:] if experts else shape))


def is_vector_like(shape: Sequence[int]) -> bool:
    """At most one dim larger than 1: biases, norm weights, (1, 1, C) layer scales, tokens
    (what ``vector_preconditioner`` applies to)."""
    return sum(size > 1 for size in shape) <= 1
