"""Data-parallel training (DDP, Accelerate, the Trainer): blocks spread over the ranks
of each trainer group, one all-gather of the directions per step (docs/design.md §4).

The ranks are the world's, or those of ``process_group=`` (a pipeline stage's data-parallel
group: ``groups.RankGroup``); trainer groups (``num_trainers_per_group``) cut them into
consecutive runs.

Every block is assigned to one rank of its trainer group by greedy longest-processing-time
first; the owner computes the block's ``-lr * P`` into its slice of one flat buffer, and one
all-gather fills the buffer on every rank of the group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .base import (
    Distributor,
    apply_directions,
    block_cost,
    greedy_assignment,
    owners_of_blocks,
    refresh_work,
    single_units,
    staggered_units,
)
from .collectives import any_rank, collective_device
from .groups import RankGroup


class DataParallelDistributor(Distributor):
    """Blocks spread over the ranks of each trainer group; one all-gather per step."""

    def __init__(
        self,
        communication_dtype: torch.dtype,
        num_trainers_per_group: int,
        assignment_cost: str = "memory",
        group: RankGroup | None = None,
    ) -> None:
        self.communication_dtype = communication_dtype
        self.group = group = group or RankGroup.world()
        world, position = group.size, group.rank
        size = world if num_trainers_per_group == -1 else num_trainers_per_group
        if world % size != 0:
            where = ("world size" if group.is_world
                     else f"process_group's size ({group.describe()})")
            raise ValueError(
                f"DistributedShampoo: num_trainers_per_group={num_trainers_per_group} must "
                f"divide the {where} {world} (or be -1 for the whole group)"
            )
        self.trainer_group = None  # the trainer group's process group (None: the world's)
        if size != world:
            if group.is_world:
                # every rank must create every subgroup, in the same order
                for start in range(0, world, size):
                    subgroup = dist.new_group(list(range(start, start + size)))
                    if start <= position < start + size:
                        self.trainer_group = subgroup
            else:
                raise ValueError(
                    f"DistributedShampoo: num_trainers_per_group={num_trainers_per_group} with "
                    f"a process_group of {group.describe()} is not supported: pass the trainer "
                    "group itself as process_group (the same numbers: blocks are spread over "
                    "its ranks). Creating groups of some ranks only would shift torch's "
                    "numbering of the groups created later by every rank (a hang)")
        elif not group.is_world:
            self.trainer_group = group.process_group
        self.rank = position % size
        self.world_size = size
        self.is_sharded_state = size > 1
        self.assignment_cost = assignment_cost
        self.buffer: Tensor | None = None
        self.segment = 0

    def global_rank_and_world(self) -> tuple[int, int]:
        return dist.get_rank(), dist.get_world_size()

    def needs_agreement(self) -> bool:
        """The all-gather's size comes from the layout, and whether a step asks
        ``any_rank`` (of the group) from its refreshes: every rank of the group must hold
        the same parameters. Trainer groups of one rank exchange nothing."""
        return self.world_size > 1

    def assign(self, blocks: Sequence, block_shapes: Sequence[tuple[int, ...]],
               costs: Sequence[float] | None = None,
               slots: Sequence[int | None] | None = None,
               units: Sequence[Sequence[int]] | None = None) -> list[int]:
        units = single_units(units, len(block_shapes))
        if costs is None:
            costs = [block_cost(shape, self.assignment_cost) for shape in block_shapes]
        unit_costs = [sum(costs[i] for i in unit) for unit in units]
        if slots is not None and any(s is not None for s in slots):
            work_at: list[dict[int, float]] = []
            for unit in units:
                at: dict[int, float] = {}
                for i in unit:
                    if slots[i] is not None:
                        at[slots[i]] = at.get(slots[i], 0.0) + refresh_work(block_shapes[i])
                work_at.append(at)
            owners = staggered_units(unit_costs, work_at, self.world_size)
        else:
            owners = greedy_assignment(unit_costs, self.world_size)
        return owners_of_blocks(owners, units, len(block_shapes))

    def allocate_directions(self, stacks) -> None:
        devices = {s.device for s in stacks}
        if len(devices) > 1:
            raise ValueError(
                f"DistributedShampoo: distributed mode needs every parameter on one device, "
                f"found {sorted(map(str, devices))}"
            )
        sizes = [0] * self.world_size
        offsets = []
        for stack in stacks:
            offsets.append(sizes[stack.rank])
            sizes[stack.rank] += len(stack.members) * math.prod(stack.shape)
        self.segment = max(sizes) if sizes else 0
        device = devices.pop() if devices else torch.device("cpu")
        self.buffer = torch.zeros(
            self.world_size * self.segment, dtype=self.communication_dtype, device=device
        )
        for stack, offset in zip(stacks, offsets):
            start = stack.rank * self.segment + offset
            numel = len(stack.members) * math.prod(stack.shape)
            stack.directions = self.buffer[start : start + numel].view(
                len(stack.members), *stack.shape
            )

    def any_rank(self, flag: bool) -> bool:
        buffers = [self.buffer] if self.buffer is not None else []
        return any_rank(flag, collective_device(buffers, self.process_group), self.process_group)

    def finish_step(self, layout, active: dict[int, list[int]]) -> None:
        """One all-gather of the flat direction buffer (every owner's slice to every rank
        of the group), then every active block's direction added to its parameter."""
        if self.buffer is not None and self.segment:
            # In place: this rank's input is its own slice of the output buffer.
            local = self.buffer[self.rank * self.segment : (self.rank + 1) * self.segment]
            # all_gather_single replaces the deprecated all_gather_into_tensor (torch >= 2.14)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather(self.buffer, local, group=self.trainer_group)
        apply_directions(layout, active, self.local)
