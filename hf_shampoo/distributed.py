"""Where blocks live (SPEC §4): ranks, block assignment and the direction buffers.

This module knows ranks, assignment and buffers, and nothing of the algorithm. Every
block is assigned to one rank of its trainer group by greedy longest-processing-time
first; the owner computes the block's ``-lr * P`` into its slice of one flat buffer, and one
all-gather fills the buffer on every rank of the group. In one process there is one rank,
each stack gets its own direction tensor and nothing is communicated. ``Distributor``
defines the interface the optimizer's step drives; ``sharded.py`` holds the FSDP2 / HSDP
distributors, and ``make_distributor`` picks one from ``distributed`` and the parameters.
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
    """One process: every block is owned by rank 0 and nothing is communicated.

    The optimizer drives a step through these methods, in this order: ``active_members``
    (which blocks have a gradient), ``prepare_step`` (bring owned blocks' inputs to their
    owner), ``stacked_grads`` / ``stacked_params`` (an owned stack's inputs), then
    ``finish_step`` (share the directions and add every block's to its parameter).
    Subclasses change where blocks live; none of them knows the algorithm.
    """

    rank = 0
    world_size = 1
    #: whether a rank's ``state_dict()`` holds only its own blocks
    is_sharded_state = False

    def __init__(self, communication_dtype: torch.dtype = torch.float32) -> None:
        self.communication_dtype = communication_dtype

    def global_rank_and_world(self) -> tuple[int, int]:
        """This process's global rank and world size (0 and 1 in one process)."""
        return 0, 1

    def local(self, tensor: Tensor) -> Tensor:
        """The part of a parameter (or gradient) this rank blocks, stacks and updates: all
        of it here; a rank's shard with ``fsdp_mode="local"``."""
        return tensor

    def blocking_shape(self, param: Tensor) -> tuple[int, ...]:
        """The shape a parameter is blocked as (SPEC §1: the full parameter's)."""
        return tuple(self.local(param).shape)

    def assign(self, blocks: Sequence, block_shapes: Sequence[tuple[int, ...]]) -> list[int]:
        return [0] * len(block_shapes)

    def allocate_directions(self, stacks) -> None:
        for stack in stacks:
            stack.directions = torch.zeros(
                (len(stack.members), *stack.shape), dtype=stack.work_dtype, device=stack.device
            )

    def needs_reallocation(self, stacks) -> bool:
        return any(s.directions is None or s.directions.device != s.device for s in stacks)

    # ------------------------------------------------------------- one step
    def active_members(self, stacks) -> dict[int, list[int]]:
        """``id(stack)`` → positions of its blocks whose parameter has a gradient."""
        return {id(stack): _active_members(stack) for stack in stacks}

    def prepare_step(self, layout, active: dict[int, list[int]], needs_params) -> None:
        """Bring the inputs of owned blocks to their owner (nothing to do here)."""

    def stacked_grads(self, stack, active: list[int]) -> Tensor:
        """The gradients of ``active`` members, ``(m, *shape)`` in the work dtype."""
        full = len(active) == len(stack.members)
        return _stacked(stack, active, lambda p: self.local(p.grad),
                        stack_buffer(stack, "gathered_grad") if full else None)

    def stacked_params(self, stack, active: list[int], out: Tensor) -> Tensor:
        """The parameter blocks of ``active`` members, into ``out``."""
        return _stacked(stack, active, self.local, out)

    def finish_step(self, layout, active: dict[int, list[int]]) -> None:
        """Share the owners' directions (``all_gather``) and add every block's to its
        parameter."""
        self.all_gather()
        apply_directions(layout, active, self.local)

    def all_gather(self) -> None:
        pass

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (a collective where there are several)."""
        return flag


def world_any(flag: bool, device: torch.device) -> bool:
    """``flag`` OR-ed over every rank of the default group (one tiny ``all_reduce``)."""
    value = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _active_members(stack) -> list[int]:
    """Positions of the stack's blocks whose parameter has a gradient this step."""
    active = []
    for i, block in enumerate(stack.members):
        grad = block.param.grad
        if grad is None:
            continue
        if grad.is_sparse:
            raise RuntimeError(
                f"DistributedShampoo does not support sparse gradients (parameter "
                f"{block.name!r}); use a dense embedding (sparse=False)"
            )
        active.append(i)
    return active


def stack_buffer(stack, name: str) -> Tensor:
    """The stack's persistent ``(n, *shape)`` buffer ``stack.<name>`` in the working dtype
    (``gathered_grad``, ``gathered_param``), allocated once."""
    shape = (len(stack.members), *stack.shape)
    buffer = getattr(stack, name)
    if buffer is None or buffer.shape != shape or buffer.device != stack.device:
        buffer = torch.empty(shape, dtype=stack.work_dtype, device=stack.device)
        setattr(stack, name, buffer)
    return buffer


def _stacked(stack, active: list[int], tensor_of, out: Tensor | None = None) -> Tensor:
    """Copy the given members' blocks of ``tensor_of(param)`` into one ``(m, *shape)``
    tensor of the stack's working dtype (``out`` when given)."""
    pieces = []
    for i in active:
        block = stack.members[i]
        piece = tensor_of(block.param).reshape(block.merged)
        if block.slices is not None:
            piece = piece[block.slices]
        pieces.append(piece)
    if out is None:
        return torch.stack(pieces).to(stack.work_dtype)
    if all(piece.dtype == out.dtype for piece in pieces):
        return torch.stack(pieces, out=out)
    for row, piece in zip(out, pieces):
        row.copy_(piece)
    return out


def apply_directions(layout, active: dict[int, list[int]], tensor_of) -> None:
    """Add every block's direction (this rank's and the all-gathered ones) to its
    parameter (``tensor_of(param)``); ``active`` holds the blocks with a gradient."""
    targets: list[Tensor] = []
    updates: list[Tensor] = []
    assembled: dict[int, tuple[Tensor, Tensor]] = {}
    for stack in layout.stacks:
        for i in active[id(stack)]:
            block = stack.members[i]
            param, update = tensor_of(block.param), stack.directions[i]
            blocking = layout.blockings[block.param_index]
            if len(blocking.slices) == 1:
                targets.append(param)
                updates.append(update.view(param.shape))
            elif blocking.can_view(param):
                targets.append(param.view(blocking.merged)[blocking.slices[block.block_index]])
                updates.append(update)
            else:  # e.g. a channels_last weight cut into several blocks
                full = assembled.get(block.param_index)
                if full is None:
                    full = (param, torch.zeros(blocking.merged, dtype=update.dtype,
                                               device=update.device))
                    assembled[block.param_index] = full
                full[1][blocking.slices[block.block_index]] = update
    for param, full in assembled.values():
        targets.append(param)
        updates.append(full.view(param.shape))
    if targets:
        torch._foreach_add_(targets, updates)


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

    @property
    def is_sharded_state(self) -> bool:  # type: ignore[override]
        return self.world_size > 1

    def global_rank_and_world(self) -> tuple[int, int]:
        return dist.get_rank(), dist.get_world_size()

    def assign(self, blocks: Sequence, block_shapes: Sequence[tuple[int, ...]]) -> list[int]:
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

    def any_rank(self, flag: bool) -> bool:
        device = self.buffer.device if self.buffer is not None else torch.device("cpu")
        return world_any(flag, device)

    def all_gather(self) -> None:
        if self.buffer is None or self.segment == 0:
            return
        # In place: this rank's input is its own slice of the output buffer.
        local = self.buffer[self.rank * self.segment : (self.rank + 1) * self.segment]
        # all_gather_single replaces the deprecated all_gather_into_tensor (torch >= 2.14)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(self.buffer, local, group=self.process_group)


def make_distributor(
    mode: str,
    params: Sequence[Tensor],
    num_trainers_per_group: int,
    communication_dtype: torch.dtype,
    assignment_cost: str = "memory",
    fsdp_mode: str = "lossless",
    current: Distributor | None = None,
    final: bool = True,
) -> Distributor:
    """Pick the distributor for ``distributed`` = "auto" | "none" | "ddp" | "fsdp".

    "auto": FSDP2 (``sharded.py``) when the parameters are ``fully_shard`` DTensors, else
    Accelerate's world when its process state has set up distributed training, else
    torch.distributed's default group when initialised with more than one rank, else one
    process. "ddp" and "fsdp" insist on their kind; "none" is always one process.
    ``current`` is kept when it is already the right one. ``final=False`` (at
    construction, before Accelerate may swap in sharded parameters) defers the check that
    "fsdp" has DTensors to the first step.
    """
    from .sharded import (
        LocalShardDistributor,
        ShardedDistributor,
        refuse_unsupported,
        sharding_mesh,
    )

    grid = sharding_mesh(params)
    if mode in ("none", "ddp") or (mode == "auto" and grid is None):
        refuse_unsupported(params, sharded_ok=False)
    else:
        refuse_unsupported(params, sharded_ok=True)
    if mode == "none":  # (a subclass set by hand, as the benchmarks' simulated ranks, stays)
        return current if current is not None else Distributor()
    initialised = dist.is_available() and dist.is_initialized()
    if mode == "fsdp" or grid is not None:
        if grid is None:
            if final:
                raise ValueError(
                    "DistributedShampoo: distributed='fsdp' needs parameters sharded by "
                    "torch.distributed.fsdp.fully_shard (FSDP2 DTensors); these are plain "
                    "tensors. Shard the model before the first step, or use "
                    "distributed='auto'"
                )
            return current or Distributor()
        if num_trainers_per_group != -1:
            raise ValueError(
                f"DistributedShampoo: num_trainers_per_group={num_trainers_per_group} applies "
                "to data-parallel training; with FSDP2 parameters blocks are spread over the "
                "whole mesh (use -1)"
            )
        kind = ShardedDistributor if fsdp_mode == "lossless" else LocalShardDistributor
        if type(current) is kind and current.grid == grid:
            return current
        if kind is ShardedDistributor:
            return ShardedDistributor(grid, communication_dtype, assignment_cost)
        return LocalShardDistributor(grid, communication_dtype)
    if isinstance(current, DataParallelDistributor) or (
        type(current) is Distributor and mode == "auto"
    ):
        return current
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
