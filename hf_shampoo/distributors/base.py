"""The distributor interface and what every distributor shares (docs/design.md §4).

A distributor knows ranks, block assignment and buffers, and nothing of the algorithm.
``Distributor`` is the interface the optimizer's step drives; ``block_cost`` and
``greedy_assignment`` choose owners (longest processing time first, deterministic on every
rank); the helpers below stack a stack's gradients or parameters into one tensor, keep its
persistent buffers, and add every block's direction to its parameter. The distributors
themselves are siblings that import only this module (and ``placements``, ``groups``):
``single`` (one process), ``ddp`` (blocks spread over data-parallel ranks, one all-gather),
``sharded`` (every DTensor layout: FSDP2 / HSDP / tensor parallel, lossless); ``local``
(``fsdp_mode="local"``) is one process per shard and builds on ``single``, ``zero`` on
``sharded``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence

import torch
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


def refresh_work(shape: Sequence[int]) -> float:
    """What a block's refresh costs, for spreading refreshes over steps and ranks: ``Σ d³``
    (its eigendecompositions)."""
    return float(sum(d**3 for d in shape))


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


#: how far above the mean cost a rank may be loaded to balance each step's refreshes
STAGGERED_SLACK = 0.05


def staggered_assignment(costs: Sequence[float], slots: Sequence[int | None],
                         work: Sequence[float], num_ranks: int) -> list[int]:
    """Owners for staggered refreshes, one block a unit: ``staggered_units`` with block
    ``i``'s ``work[i]`` at its offset ``slots[i]`` (``None``: it never refreshes, or
    refreshes with every block)."""
    return staggered_units(costs, [{} if s is None else {s: w} for s, w in zip(slots, work)],
                           num_ranks)


def staggered_units(costs: Sequence[float], work_at: Sequence[Mapping[int, float]],
                    num_ranks: int) -> list[int]:
    """Owners for staggered refreshes: a step waits for the rank with the most refresh work
    at that step's offset, so the units (stacks) that refresh at some offset (``work_at[i]``:
    offset → the unit's refresh work there; empty for a unit that never refreshes on its
    own schedule) are spread over the ranks by their refresh work, heaviest first, each to
    the rank whose busiest of the unit's offsets would carry the least work, among those it
    leaves within ``STAGGERED_SLACK`` of the mean total ``costs`` (all ranks if none; ties:
    the least total, then the lowest rank); the units without offsets then go, heaviest
    first, to the least-loaded rank by ``costs``. Owners only decide where a stack is
    computed, never its numbers. Deterministic, identical everywhere."""
    owners = [0] * len(costs)
    total = [0.0] * num_ranks
    capacity = (1.0 + STAGGERED_SLACK) * sum(costs) / num_ranks
    at: dict[int, list[float]] = {}
    timed = sorted((i for i, w in enumerate(work_at) if w),
                   key=lambda i: (-sum(work_at[i].values()), -costs[i], i))
    for i in timed:
        loads = [at.setdefault(slot, [0.0] * num_ranks) for slot in work_at[i]]
        fits = [r for r in range(num_ranks) if total[r] + costs[i] <= capacity]
        rank = min(fits or range(num_ranks), key=lambda r: (
            max(load[r] + w for load, w in zip(loads, work_at[i].values())), total[r], r))
        owners[i] = rank
        for load, w in zip(loads, work_at[i].values()):
            load[rank] += w
        total[rank] += costs[i]
    for i in sorted((i for i, w in enumerate(work_at) if not w), key=lambda i: (-costs[i], i)):
        rank = min(range(num_ranks), key=lambda r: (total[r], r))
        owners[i] = rank
        total[rank] += costs[i]
    return owners


def single_units(units: Sequence[Sequence[int]] | None, count: int) -> list[list[int]]:
    """``units`` as given, or every one of ``count`` blocks a unit of its own."""
    return [list(u) for u in units] if units is not None else [[i] for i in range(count)]


def owners_of_blocks(unit_owners: Sequence[int], units: Sequence[Sequence[int]],
                     count: int) -> list[int]:
    """Each of ``count`` blocks' owner: its unit's."""
    owners = [0] * count
    for owner, unit in zip(unit_owners, units):
        for i in unit:
            owners[i] = owner
    return owners


#: in ``active_members``' list of non-finite gradients: another rank found one
OTHER_RANK = -1


class Distributor:
    """Where blocks live: the interface the optimizer's step drives.

    The step calls, in this order: ``active_members`` (which blocks have a gradient, and
    which gradients are not finite), ``prepare_step`` (bring owned blocks' inputs to
    their owner), ``stacked_grads`` / ``param_rows`` (an owned stack's inputs), then
    ``finish_step`` (share the owners' directions of the active blocks and add every
    block's to its parameter; ``train()`` / ``eval()`` call it too, every rank, for the
    blocks that move). At layout time it calls ``blocking_shape``, ``assign`` (an owner
    per block) and ``allocate_directions`` (again when ``needs_reallocation``); before
    a layout's first collective it asks ``needs_agreement`` and ``collective_layout``
    (whether, and when, the ranks must be found to hold the same parameters:
    ``agreement.py``); the refresh check asks ``any_rank``; checkpoints read
    ``is_sharded_state``, ``state_key_prefix`` and ``global_rank_and_world``. Nothing
    else: every per-step fact
    travels as an argument, and a distributor keeps only what its layout planned.
    Subclasses (``single``, ``ddp``, ``sharded``, ``local``, ``zero``) decide where blocks
    live; none of them knows the algorithm. ``assign``, ``allocate_directions`` and
    ``finish_step`` are theirs to define; the rest has the one-process meaning here.
    """

    #: this rank within the distributor's group, and the group's size
    rank: int = 0
    world_size: int = 1
    #: whether a rank's ``state_dict()`` holds only its own blocks
    is_sharded_state: bool = False
    #: prefix of this rank's state keys (``fsdp_mode="local"``: which shard its blocks cut)
    state_key_prefix: str = ""
    #: the ranks blocks are spread over, with their process group (``groups.RankGroup``:
    #: the world, or ``process_group=``'s / the parameters' meshes' ranks); None in one
    #: process. The agreement check and ``any_rank`` run over it
    group = None

    @property
    def process_group(self):
        """The process group of ``group``, which every collective over the ranks blocks are
        spread over names (None: the default group, the world; also in one process)."""
        return None if self.group is None else self.group.process_group

    def needs_agreement(self) -> bool:
        """Whether the ranks run collectives whose sizes, or whose being called at all,
        their layouts decide, so that every rank of the world must hold the same
        parameters (the optimizer checks it once per layout, before the first such
        collective: ``agreement.py``). Not here: one process, or ranks that exchange
        nothing the layout decides."""
        return False

    def collective_layout(self, params: Sequence[Tensor]) -> bool:
        """Whether ``assign`` for these parameters is itself a collective (it learns other
        ranks' parts of them), so that the ranks must be found to agree before it rather
        than at the first step."""
        return False

    def global_rank_and_world(self) -> tuple[int, int]:
        """This process's global rank and world size (0 and 1 in one process)."""
        return 0, 1

    def local(self, tensor: Tensor) -> Tensor:
        """The part of a parameter (or gradient) this rank blocks, stacks and updates: all
        of it here; a rank's shard with ``fsdp_mode="local"``."""
        return tensor

    def blocking_shape(self, param: Tensor) -> tuple[int, ...]:
        """The shape a parameter is blocked as (docs/design.md §1: the full parameter's)."""
        return tuple(self.local(param).shape)

    def assign(self, blocks: Sequence, block_shapes: Sequence[tuple[int, ...]],
               costs: Sequence[float] | None = None,
               slots: Sequence[int | None] | None = None,
               units: Sequence[Sequence[int]] | None = None) -> list[int]:
        """The owning rank (within this distributor's group) of every block; ``costs``
        (what each block costs its owner, ``BlockStack.assignment_cost``) balance the
        ranks, ``block_cost`` of the shape where not given. ``slots``: each block's
        staggered refresh offset (``None``: it never refreshes, or refreshes with every
        block), for a distributor that balances each step's refreshes too. ``units``:
        lists of block indices that must have one owner (a stack: ``stacking.chunks``);
        every block alone where not given."""
        raise NotImplementedError

    def allocate_directions(self, stacks) -> None:
        """Give every stack its ``directions`` tensor ``(members, *shape)`` (the owned
        ones at least) and plan what a step exchanges."""
        raise NotImplementedError

    def needs_reallocation(self, stacks) -> bool:
        """Whether ``allocate_directions`` must run again (parameters moved device)."""
        return any(s.directions is None or s.directions.device != s.device for s in stacks)

    # ------------------------------------------------------------- one step
    def active_members(self, stacks, check_finite: bool = False
                       ) -> tuple[dict[int, list[int]], list[int]]:
        """``id(stack)`` → positions of its blocks whose parameter has a gradient; and, with
        ``check_finite``, the indices of the parameters whose gradient holds a nan or an
        inf (one fused norm pass over the gradients, one host synchronisation; a second
        look, element by element, only at gradients whose norm is not finite). Every rank
        gets the same answer: data-parallel gradients are the same on every rank."""
        active = {id(stack): _active_members(stack) for stack in stacks}
        if not check_finite:
            return active, []
        params = params_with_gradients(stacks, active)
        grads = [self.local(p.grad) for p in params.values()]
        flags = maybe_nonfinite(grads)
        if flags is None or not bool(flags.any()):  # the one host synchronisation
            return active, []
        bad = confirmed_nonfinite(grads, flags.tolist())  # rare: a nan, an inf or an overflow
        return active, [i for i, b in zip(params, bad) if b]

    def prepare_step(self, layout, active: dict[int, list[int]],
                     needs_params: Callable[[object], bool]) -> None:
        """Bring the inputs of the ``active`` members of owned stacks to their owner (and
        the parameters, for the stacks where ``needs_params(stack)``). Every rank holds
        its blocks' inputs already unless a subclass says otherwise: nothing to do."""

    def stacked_grads(self, stack, active: list[int]) -> Tensor:
        """The gradients of ``active`` members, ``(m, *shape)`` in the work dtype: a copy
        (into the stack's persistent buffer when every member is active), which the step
        may write into (L2 decay, ``riemannian_lora``). ``p.grad`` is only read: the step
        never replaces, reassigns or writes a gradient (torch's contract, which
        ``tests/test_torch_contracts.py`` and torch's own suite check)."""
        full = len(active) == len(stack.members)
        return _stacked(stack, active, lambda p: self.local(p.grad),
                        stack_buffer(stack, "gathered_grad") if full else None)

    def param_rows(self, stack, active: list[int]) -> list[Tensor]:
        """The parameter blocks of ``active`` members, one tensor of the stack's block shape
        each: views of the parameters where their layout allows (no copy)."""
        return _pieces(stack, active, self.local)

    def finish_step(self, layout, active: dict[int, list[int]]) -> None:
        """Share the owners' ``directions`` of the ``active`` members (``id(stack)`` →
        positions) and add every one to its parameter. Every rank calls it (in a step, and
        in ``train()`` / ``eval()`` for the blocks that move)."""
        raise NotImplementedError

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (a collective where ranks share blocks; the
        rank's own flag where they never wait for each other)."""
        return flag


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


def params_with_gradients(stacks, active: dict[int, list[int]] | None = None
                          ) -> dict[int, Tensor]:
    """``param_index`` → parameter, in index order, of the blocks in ``active`` (every
    block when None)."""
    params: dict[int, Tensor] = {}
    for stack in stacks:
        members = range(len(stack.members)) if active is None else active[id(stack)]
        for m in members:
            block = stack.members[m]
            params.setdefault(block.param_index, block.param)
    return dict(sorted(params.items()))


def maybe_nonfinite(tensors: Sequence[Tensor]) -> Tensor | None:
    """One bool per tensor, on the first tensor's device, without a host synchronisation:
    True where the tensor may hold a nan or an inf. The test is that its L2 norm is not
    finite (``torch._foreach_norm``, fused per device and dtype, accumulated in float32 at
    least): a nan or an inf always makes it so, since they propagate through a sum of
    squares. A finite tensor whose norm overflows (elements above about 1e19 in float32)
    is flagged too; ``confirmed_nonfinite`` settles the flagged ones exactly. One read of
    every tensor, about a tenth of the cost of a largest-magnitude norm on CPU. None for
    no tensors."""
    if not tensors:
        return None
    device = tensors[0].device
    groups: dict[tuple, list[int]] = {}
    for position, tensor in enumerate(tensors):
        if tensor.numel() > 0:  # an empty shard is finite
            groups.setdefault((tensor.device, tensor.dtype), []).append(position)
    flags = torch.zeros(len(tensors), dtype=torch.bool, device=device)
    for (_, dtype), positions in groups.items():
        wide = torch.float32 if dtype.is_floating_point and dtype.itemsize < 4 else None
        norms = torch._foreach_norm([tensors[p] for p in positions], 2, dtype=wide)
        bad = ~torch.stack(norms).isfinite()
        flags[torch.tensor(positions, device=device)] = bad.to(device)
    return flags


def confirmed_nonfinite(tensors: Sequence[Tensor], flagged: Sequence[bool]) -> list[bool]:
    """Of the tensors ``maybe_nonfinite`` flagged, which really hold a nan or an inf (every
    element looked at: a large finite gradient whose norm overflowed is not refused)."""
    return [bool(flag) and not bool(torch.isfinite(tensor).all())
            for tensor, flag in zip(tensors, flagged)]


def stack_buffer(stack, name: str) -> Tensor:
    """The stack's persistent ``(n, *shape)`` buffer ``stack.<name>`` in the working dtype
    (``gathered_grad``, ``gathered_param``), allocated once."""
    shape = (len(stack.members), *stack.shape)
    buffer = getattr(stack, name)
    if buffer is None or buffer.shape != shape or buffer.device != stack.device:
        buffer = torch.empty(shape, dtype=stack.work_dtype, device=stack.device)
        setattr(stack, name, buffer)
    return buffer


def _pieces(stack, active: list[int], tensor_of) -> list[Tensor]:
    """The given members' blocks of ``tensor_of(param)``, views where the layout allows."""
    pieces = []
    for i in active:
        block = stack.members[i]
        piece = tensor_of(block.param).reshape(block.merged)
        if block.slices is not None:
            piece = piece[block.slices]
        pieces.append(piece)
    return pieces


def _stacked(stack, active: list[int], tensor_of, out: Tensor | None = None) -> Tensor:
    """Copy the given members' blocks of ``tensor_of(param)`` into one ``(m, *shape)``
    tensor of the stack's working dtype (``out`` when given)."""
    pieces = _pieces(stack, active, tensor_of)
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


def allocate_per_stack(stacks) -> None:
    """One zeroed ``(members, *shape)`` direction tensor per stack (nothing is shared)."""
    for stack in stacks:
        stack.directions = torch.zeros(
            (len(stack.members), *stack.shape), dtype=stack.work_dtype, device=stack.device
        )
