"""One process: every block is owned by rank 0 and nothing is communicated."""

from __future__ import annotations

from collections.abc import Sequence

from .base import Distributor, allocate_per_stack


class SingleProcessDistributor(Distributor):
    """Every block on rank 0, one direction tensor per stack, no collective."""

    def assign(self, blocks: Sequence, block_shapes: Sequence[tuple[int, ...]],
               costs: Sequence[float] | None = None) -> list[int]:
        return [0] * len(block_shapes)

    def allocate_directions(self, stacks) -> None:
        allocate_per_stack(stacks)

    def all_gather(self) -> None:
        pass

    def any_rank(self, flag: bool) -> bool:
        return flag
