"""One process: every block is owned by rank 0 and nothing is communicated."""

from __future__ import annotations

from collections.abc import Sequence

from .base import Distributor, allocate_per_stack, apply_directions


class SingleProcessDistributor(Distributor):
    """Every block on rank 0, one direction tensor per stack, no collective."""

    def assign(self, blocks: Sequence, block_shapes: Sequence[tuple[int, ...]],
               costs: Sequence[float] | None = None,
               slots: Sequence[int | None] | None = None,
               units: Sequence[Sequence[int]] | None = None) -> list[int]:
        return [0] * len(block_shapes)

    def allocate_directions(self, stacks) -> None:
        allocate_per_stack(stacks)

    def finish_step(self, layout, active: dict[int, list[int]]) -> None:
        """Add every active block's direction to (this rank's part of) its parameter."""
        apply_directions(layout, active, self.local)
