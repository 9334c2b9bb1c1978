"""Where blocks live (SPEC §4): ranks, block assignment and the direction buffers.

This module knows ranks, assignment and buffers, and nothing of the algorithm. Every
block is assigned to one rank of its trainer group by greedy longest-processing-time
first; the owner computes the block's ``-lr * P`` into its slice of one flat buffer, and one
all-gather fills the buffer on every rank of the group. In one process there is one rank,
each stack gets its own direction tensor and nothing is communicated.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def block_cost(shape: Sequence[int], cost: str = "memory") -> float:
    """Cost of a block for assignment.

    ``"memory"``: elements of its state, one ``d×d`` factor per dim plus the block itself
    (grafting / momentum state). ``"compute"``: its eigendecompositions, ``Σ d³``, plus the
    block for the steady-state work.
    """
    numel = math.prod(shape)
    power = 2 if cost == "memory" else 3
    return float(sum(d**power for d in shape) + numel)


def greedy_assignment(costs: Sequence[float], num_ranks: int) -> list[int]:
    """Longest processing time first: blocks by decreasing cost (ties: block order) each
    go to the least-loaded rank (ties: lowest rank). Deterministic, identical everywhere."""
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    loads = [(0.0, rank) for rank in range(num_ranks)]
    owners = [0] * len(costs)
    for i in order:
        load, rank = heapq.heappop(loads)
        owners[i] = rank
        heapq.heappush(loads, (load + costs[i], rank))
    return owners


def _accelerate_world() -> bool:
    """True when Accelerate's process state has set up distributed training."""
    try:
        from accelerate.state import PartialState
    except ImportError:  # pragma: no cover - accelerate is a dependency
        return False
    if not PartialState._shared_state:  # not initialised: do not initialise it here
        return False
    state = PartialState()
    return bool(state.use_distributed) and state.num_processes > 1


class Distributor:
    """One process: every block is owned by rank 0 and nothing is communicated."""

    rank = 0
    world_size = 1

    def __init__(self, communication_dtype: torch.dtype = torch.float32) -> None:
        self.communication_dtype = communication_dtype

    def assign(self, block_shapes: Sequence[tuple[int, ...]]) -> list[int]:
        return [0] * len(block_shapes)

    def allocate_directions(self, stacks) -> None:
        for stack in stacks:
            stack.directions = torch.zeros(
                (len(stack.members), *stack.shape), dtype=stack.work_dtype, device=stack.device
            )

    def needs_reallocation(self, stacks) -> bool:
        return any(s.directions is None or s.directions.device != s.device for s in stacks)

    def all_gather(self) -> None:
        pass


class DataParallelDistributor(Distributor):
    """Blocks spread over the ranks of each trainer group; one all-gather per step."""

    def __init__(
        self,
        communication_dtype: torch.dtype,
        num_trainers_per_group: int,
        assignment_cost: str = "memory",
    ) -> None:
        super().__init__(communication_dtype)
        world, global_rank = dist.get_world_size(), dist.get_rank()
        size = world if num_trainers_per_group == -1 else num_trainers_per_group
        if world % size != 0:
            raise ValueError(
                f"DistributedShampoo: num_trainers_per_group={num_trainers_per_group} must "
                f"divide the world size {world} (or be -1 for the whole world)"
            )
        self.process_group = None
        if size != world:
            # every rank must create every subgroup, in the same order
            for start in range(0, world, size):
                group = dist.new_group(list(range(start, start + size)))
                if start <= global_rank < start + size:
                    self.process_group = group
        self.world_size = size
        self.rank = global_rank % size
        self.assignment_cost = assignment_cost
        self.buffer: Tensor | None = None
        self.segment = 0

    def assign(self, block_shapes: Sequence[tuple[int, ...]]) -> list[int]:
        costs = [block_cost(shape, self.assignment_cost) for shape in block_shapes]
        return greedy_assignment(costs, self.world_size)

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

    def all_gather(self) -> None:
        if self.buffer is None or self.segment == 0:
            return
        # In place: this rank's input is its own slice of the output buffer.
        local = self.buffer[self.rank * self.segment : (self.rank + 1) * self.segment]
        dist.all_gather_into_tensor(self.buffer, local, group=self.process_group)


def make_distributor(
    mode: str,
    num_trainers_per_group: int,
    communication_dtype: torch.dtype,
    assignment_cost: str = "memory",
) -> Distributor:
    """Pick the distributor for ``distributed`` = "auto" | "none" | "ddp" (SPEC §4).

    "auto": Accelerate's world when its process state has set up distributed training,
    else torch.distributed's default group when initialised with more than one rank, else
    one process. "ddp" insists on a process group; "none" is always one process.
    """
    if mode == "none":
        return Distributor()
    initialised = dist.is_available() and dist.is_initialized()
    if mode == "ddp":
        if not initialised:
            raise ValueError(
                "DistributedShampoo: distributed='ddp' needs an initialised process group "
                "(torch.distributed.init_process_group, torchrun or accelerate launch); use "
                "distributed='auto' or 'none' for one process"
            )
        return DataParallelDistributor(
            communication_dtype, num_trainers_per_group, assignment_cost
        )
    if (_accelerate_world() or initialised) and dist.is_initialized() and dist.get_world_size() > 1:
        return DataParallelDistributor(
            communication_dtype, num_trainers_per_group, assignment_cost
        )
    return Distributor()
