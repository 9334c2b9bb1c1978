"""Sharded parameters (docs/design.md §8): FSDP2, HSDP, tensor parallel and their products.

Every DTensor layout torch and Accelerate produce (``placements.py``) leaves each rank one
box of each parameter: FSDP2's rows (``Shard(0)``), tensor parallel's columns
(``Shard(1)``), both at once on a ``(dp_shard, tp)`` mesh, replicas on ``dp_replicate``.

``ShardedDistributor`` (the default, lossless) blocks every parameter as the full tensor,
exactly as one process does (docs/design.md §1), and gives each block one owner among the
ranks of its group: the world, or the union of the parameters' meshes where that leaves
ranks out (a pipeline stage's ``(dp_shard, tp)`` sub-mesh), or ``process_group=``
(``groups.py``). Ranks are numbered by their position in the group; nothing is exchanged
with a rank outside it. A step is three collectives, whatever the number of parameters:

1. an ``all_reduce`` of one flag per parameter (which parameters have a gradient);
2. an ``all_to_all`` that sends each owner the parts of its blocks' gradients (and, with
   weight decay, parameters) that other ranks hold, each part from one of its holders;
3. after the owners computed ``-lr * P``, an ``all_to_all`` that sends every rank the
   direction of every part it holds.

A block's part never travels to a rank that already holds it, and owners are chosen among
the ranks that hold most of a block while the load stays balanced. Each block is computed
once in the world (never repeated per tensor-parallel rank); with float32 communication
the parameters are bit-identical to one process.

``fsdp_mode="local"`` (Meta's FSDP2 default, each rank's shard blocked as if it were the
parameter) is ``local.LocalShardDistributor``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .base import (
    Distributor,
    block_cost,
    confirmed_nonfinite,
    maybe_nonfinite,
    owners_of_blocks,
    params_with_gradients,
    single_units,
    stack_buffer,
)
from .collectives import any_rank, any_rank_each, collective_device
from .groups import RankGroup
from .placements import (
    Box,
    HeldBy,
    holdings,
    is_dtensor,
    local_tensor,
    merged_box,
    on_sub_mesh,
    refuse_unsupported,
)

__all__ = ["ShardedDistributor", "is_dtensor", "layout_signature", "refuse_unsupported"]


def layout_signature(params: Sequence[Tensor]) -> tuple:
    """What the lossless plan depends on beyond the blocks: every DTensor's mesh and
    placements (a distributor is kept while this stays the same)."""
    return tuple((tuple(p.device_mesh.mesh.flatten().tolist()), tuple(p.placements))
                 if is_dtensor(p) else None for p in params)


@dataclass(frozen=True, eq=False)
class Cut:
    """The part of one block that one group of replicas (``ranks``) holds.

    A *box cut* is a box of the parameter's merged view: ``in_block`` slices the block,
    ``in_local`` slices the holders' box, elements ``[local_offset, + prod(local_shape))``
    of their flat local buffer viewed as ``local_shape``. An *index cut* (a shard that is
    not a box of the merged view, as a column shard of a small matrix merged into one dim)
    holds flat indices into the block and the local buffer.
    """

    ranks: tuple[int, ...]
    numel: int
    shape: tuple[int, ...]  # of the part, as the slices give it ((numel,) for an index cut)
    in_block: tuple[slice, ...] | Tensor
    in_local: tuple[slice, ...] | Tensor
    local_shape: tuple[int, ...] | None  # None for an index cut
    local_offset: int = 0

    def local_box(self, local: Tensor, view: bool = False) -> Tensor:
        """The holders' box of their local buffer (``view``: a view, to write into)."""
        flat = local.view(-1) if view else local.reshape(-1)
        size = math.prod(self.local_shape)
        return flat[self.local_offset:self.local_offset + size].view(self.local_shape)

    @property
    def is_box(self) -> bool:
        return self.local_shape is not None


@dataclass(frozen=True, eq=False)
class Piece:
    """A cut of a block of a stack, moving between ranks."""

    cut: Cut
    stack: object  # BlockStack
    member: int  # position in the stack

    @property
    def block(self):
        return self.stack.members[self.member]

    @property
    def numel(self) -> int:
        return self.cut.numel

    def block_part(self, tensor: Tensor) -> Tensor:
        """The piece of a block-shaped tensor (a direction), a view for a box cut."""
        cut = self.cut
        return tensor[cut.in_block] if cut.is_box else tensor.reshape(-1)[cut.in_block]

    def write_block(self, tensor: Tensor, values: Tensor) -> None:
        """Write ``values`` (any shape, the piece's elements in order) into a block-shaped
        contiguous tensor (a row of the owner's gathered buffers)."""
        cut = self.cut
        if cut.is_box:
            tensor[cut.in_block].copy_(values.view(cut.shape))
        else:
            tensor.view(-1)[cut.in_block] = values.reshape(-1).to(tensor.dtype)

    def local_part(self, local: Tensor) -> Tensor:
        """The piece of a holder's local tensor (a gradient shard), for reading."""
        cut = self.cut
        if cut.is_box:
            return cut.local_box(local)[cut.in_local]
        return local.reshape(-1)[cut.in_local]


class ShardedDistributor(Distributor):
    """Lossless training of DTensor parameters: full-parameter blocks, one owner each in
    the world (see top). ``boxes_of`` (``placements.holdings`` by default) says which box
    of each parameter every rank holds; a planner without a process group passes its own,
    with ``rank`` and ``world_size``."""

    is_sharded_state = True

    def __init__(
        self, communication_dtype: torch.dtype = torch.float32,
        assignment_cost: str = "memory", balance_slack: float = 0.1, *,
        rank: int | None = None, world_size: int | None = None,
        boxes_of: Callable[[dict[int, Tensor], dict[int, str]], dict[int, list]] | None = None,
        signature: tuple = (), group: RankGroup | None = None,
    ) -> None:
        self.communication_dtype = communication_dtype
        # a planner (rank and world given) has no process group and exchanges nothing
        self.grouped = rank is None and world_size is None
        if self.grouped:
            self.group = group or RankGroup.world()
            self.world_size, self.rank = self.group.size, self.group.rank
        else:
            self.world_size = dist.get_world_size() if world_size is None else world_size
            self.rank = dist.get_rank() if rank is None else rank
        self.own_boxes = boxes_of is None  # placements.holdings: sub-meshes gather
        self.boxes_of = boxes_of or (lambda params, names: holdings(
            params, self.group.ranks, names, self.process_group))
        self.signature = signature
        self.assignment_cost = assignment_cost
        self.balance_slack = balance_slack
        self.held: dict[int, tuple[HeldBy, tuple[Box, ...] | None]] = {}
        self._boxes: dict[int, list] = {}
        self._cuts: dict[tuple[int, int], list[Cut]] = {}
        self.pieces_in: list[tuple[int, Piece]] = []  # (source rank, piece) for my blocks
        self.pieces_out: list[tuple[int, Piece]] = []  # (owner rank, piece) that I send
        self.directions_out: list[tuple[int, Piece]] = []  # (holder rank, piece), my blocks
        self.directions_in: list[tuple[int, Piece]] = []  # (owner rank, piece) I hold
        self.local_pieces: list[Piece] = []  # parts of my blocks that I hold myself
        self.bytes_last_step = 0  # sent + received by this rank in the last step
        # this step's gradients placed as their parameters, where ``p.grad`` is not (a
        # ``Partial`` sum): read instead of ``p.grad``, which a step never replaces
        self.placed_grads: dict[int, Tensor] = {}
        self._device = torch.device("cpu")

    def global_rank_and_world(self) -> tuple[int, int]:
        if self.grouped and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return self.rank, self.world_size

    def needs_agreement(self) -> bool:
        """Every collective of a step is sized by the layout (flags per parameter, parts
        per block): the group's ranks must hold the same parameters on the same meshes."""
        return self.grouped and self.world_size > 1

    def collective_layout(self, params: Sequence[Tensor]) -> bool:
        """``holdings`` gathers every rank's view of parameters on a sub-mesh."""
        return self.needs_agreement() and self.own_boxes and any(
            on_sub_mesh(p, self.group.ranks) for p in params)

    def values_of(self, param: Tensor) -> Tensor:
        """The local buffer holding this rank's values of ``param`` (its DTensor shard)."""
        return local_tensor(param)

    def grad_of(self, param: Tensor) -> Tensor | None:
        """The local buffer holding this rank's gradient of ``param``, None without one."""
        grad = self.placed_grads.get(id(param), param.grad)
        return None if grad is None else local_tensor(grad)

    def has_grad(self, param: Tensor) -> bool:
        return param.grad is not None

    def grad_elements(self, param: Tensor) -> Tensor:
        """This rank's gradient elements of ``param`` (for the non-finite check)."""
        return self.grad_of(param)

    # ------------------------------------------------------------- layout
    def learn_boxes(self, blocks: Sequence) -> None:
        """Every rank's box of the blocks' parameters (a collective when a parameter lives
        on a sub-mesh: every rank lays out the same blocks at the same time)."""
        params = {b.param_index: b.param for b in blocks}
        names = {b.param_index: b.name for b in blocks}
        self._boxes.update(self.boxes_of(params, names))
        for index in params:
            self.held.pop(index, None)
        self._cuts = {k: v for k, v in self._cuts.items() if k[0] not in params}

    def holding(self, block) -> tuple[HeldBy, tuple[Box, ...] | None]:
        """Who holds what of the block's parameter, with the boxes in merged dims (None
        when some box is not a box of the merged view: index cuts)."""
        found = self.held.get(block.param_index)
        if found is None:
            shape = tuple(block.param.shape)
            held = HeldBy.of(shape, self._boxes[block.param_index], repr(block.name))
            merged = [merged_box(box, shape, block.merged) for box in held.boxes]
            found = (held, None if any(m is None for m in merged) else tuple(merged))
            self.held[block.param_index] = found
        return found

    def cuts(self, block) -> list[Cut]:
        """The parts of ``block`` each group of replicas holds (none empty)."""
        key = (block.param_index, block.block_index)
        found = self._cuts.get(key)
        if found is None:
            found = self._cuts[key] = self._make_cuts(block)
        return found

    def _make_cuts(self, block) -> list[Cut]:
        held, merged_boxes = self.holding(block)
        lo = [0] * len(block.merged) if block.slices is None else [s.start for s in
                                                                   block.slices]
        hi = list(block.merged) if block.slices is None else [s.stop for s in block.slices]
        cuts = []
        if merged_boxes is not None:
            for ranks, box, offset in zip(held.ranks, merged_boxes, held.offsets):
                inter = [(max(a, x), min(b, y)) for (a, b), x, y in zip(box, lo, hi)]
                if any(x >= y for x, y in inter):
                    continue
                cuts.append(Cut(
                    ranks, math.prod(y - x for x, y in inter), tuple(y - x for x, y in inter),
                    tuple(slice(x - s, y - s) for (x, y), s in zip(inter, lo)),
                    tuple(slice(x - a, y - a) for (x, y), (a, _) in zip(inter, box)),
                    tuple(b - a for a, b in box), offset))
            return cuts
        device = block.param.device
        numel = math.prod(held.shape)
        positions = torch.arange(numel, device="cpu")
        in_block = positions.view(block.merged)[tuple(slice(x, y) for x, y in
                                                      zip(lo, hi))].reshape(-1)
        where = torch.full((numel,), -1, dtype=torch.long, device="cpu")
        where[in_block] = torch.arange(in_block.numel(), device="cpu")
        for ranks, box, offset in zip(held.ranks, held.boxes, held.offsets):
            flat = positions.view(held.shape)[tuple(slice(a, b) for a, b in box)].reshape(-1)
            at = where[flat]
            mask = at >= 0
            count = int(mask.sum())
            if count:
                cuts.append(Cut(ranks, count, (count,), at[mask].to(device),
                                (mask.nonzero().squeeze(1) + offset).to(device), None))
        return cuts

    @staticmethod
    def source_of(cut: Cut, cuts: list[Cut], owner: int) -> int:
        """Which holder of ``cut`` sends its gradient to ``owner``: the owner itself, else
        the holder in the owner's position among its own replicas (HSDP: the owner's
        replica), so that the sending is spread."""
        if owner in cut.ranks:
            return owner
        own = next((c.ranks for c in cuts if owner in c.ranks), None)
        position = own.index(owner) if own is not None else owner
        return cut.ranks[position % len(cut.ranks)]

    def assign(self, blocks: Sequence, block_shapes: Sequence[tuple[int, ...]],
               costs: Sequence[float] | None = None,
               slots: Sequence[int | None] | None = None,
               units: Sequence[Sequence[int]] | None = None) -> list[int]:
        """Greedy, heaviest unit (stack) first: the least-loaded rank among those holding
        most of the unit's elements, unless that would load it beyond ``(1 +
        balance_slack)`` times the average; then the least-loaded rank of all.
        Deterministic everywhere."""
        self.learn_boxes(blocks)
        units = single_units(units, len(blocks))
        if costs is None:
            costs = [block_cost(shape, self.assignment_cost) for shape in block_shapes]
        unit_costs = [sum(costs[i] for i in unit) for unit in units]
        capacity = (1.0 + self.balance_slack) * sum(unit_costs) / self.world_size
        load = dict.fromkeys(range(self.world_size), 0.0)
        owners = [0] * len(units)
        for u in sorted(range(len(units)), key=lambda u: (-unit_costs[u], u)):
            held = dict.fromkeys(range(self.world_size), 0)
            for i in units[u]:
                for cut in self.cuts(blocks[i]):
                    for r in cut.ranks:
                        held[r] += cut.numel
            best = max(held.values())
            preferred = [r for r in range(self.world_size) if held[r] == best]
            owner = min(preferred, key=lambda r: (load[r], r))
            if load[owner] + unit_costs[u] > capacity:
                owner = min(load, key=lambda r: (load[r], r))
            owners[u] = owner
            load[owner] += unit_costs[u]
        return owners_of_blocks(owners, units, len(blocks))

    def allocate_directions(self, stacks) -> None:
        """Direction tensors of owned stacks, and the step's communication plan."""
        self.pieces_in, self.pieces_out = [], []
        self.directions_in, self.directions_out, self.local_pieces = [], [], []
        self._device = stacks[0].device if stacks else torch.device("cpu")
        for stack in stacks:
            owner = stack.rank
            mine = owner == self.rank
            if mine:
                stack.directions = torch.zeros((len(stack.members), *stack.shape),
                                               dtype=stack.work_dtype, device=stack.device)
            for member, block in enumerate(stack.members):
                cuts = self.cuts(block)
                for cut in cuts:
                    piece = Piece(cut, stack, member)
                    source = self.source_of(cut, cuts, owner)
                    if mine:
                        if source == self.rank:
                            self.local_pieces.append(piece)
                        else:
                            self.pieces_in.append((source, piece))
                        self.directions_out += [(r, piece) for r in cut.ranks
                                                if r != self.rank]
                    else:
                        if source == self.rank:
                            self.pieces_out.append((owner, piece))
                        if self.rank in cut.ranks:
                            self.directions_in.append((owner, piece))

    def needs_reallocation(self, stacks) -> bool:
        return any(s.rank == self.rank and (s.directions is None or s.directions.device
                                            != s.device) for s in stacks)

    def planned_bytes(self, dtype: torch.dtype = torch.float32, with_params: bool = False
                      ) -> int:
        """Bytes this rank sends plus receives in a step where every block has a
        gradient: gradient parts (and parameter parts) in, directions out."""
        factor = 2 if with_params else 1
        grads = sum(p.numel for _, p in self.pieces_in) + sum(p.numel for _, p in
                                                              self.pieces_out)
        directions = sum(p.numel for _, p in self.directions_in) + sum(
            p.numel for _, p in self.directions_out)
        return (factor * grads + directions) * dtype.itemsize

    # ------------------------------------------------------------- one step
    def active_members(self, stacks, check_finite: bool = False
                       ) -> tuple[dict[int, list[int]], list[int]]:
        """Blocks of parameters that have a gradient on any rank and, with
        ``check_finite``, the parameters whose gradient shard holds a nan or an inf on any
        rank: both in one ``all_reduce``, so that every rank agrees on what moves. A
        gradient placed otherwise than its parameter is redistributed to the parameter's
        placements first (torch's DTensor collectives, in parameter order everywhere), into
        ``placed_grads``: ``p.grad`` itself is left as it is."""
        self.bytes_last_step = 0
        params = params_with_gradients(stacks)
        self.placed_grads = {}
        for param in params.values():
            placed = _placed_gradient(param)
            if placed is not None:
                self.placed_grads[id(param)] = placed
        has_grad, bad = _flags_on_every_rank(params, check_finite, self.has_grad,
                                             self.grad_elements, self.process_group)
        return ({id(stack): [m for m, b in enumerate(stack.members) if b.param_index in has_grad]
                 for stack in stacks}, bad)

    def prepare_step(self, layout, active: dict[int, list[int]],
                     needs_params: Callable[[object], bool]) -> None:
        """Gradient (and parameter, where ``needs_params(stack)``) parts → owners."""
        is_active = _membership(layout, active)
        dtype = _exchange_dtype(layout.stacks)
        params_of = {id(s): needs_params(s) for s in layout.stacks}
        for stack in layout.stacks:
            if stack.rank == self.rank and active[id(stack)]:
                stack_buffer(stack, "gathered_grad")
                if params_of[id(stack)]:
                    stack_buffer(stack, "gathered_param")

        def grad_of(piece: Piece) -> Tensor:
            grad = self.grad_of(piece.block.param)
            if grad is None:  # no gradient here, but elsewhere: zeros (FSDP keeps none)
                return torch.zeros(piece.cut.shape, dtype=dtype, device=piece.block.param.device)
            return piece.local_part(grad)

        def param_of(piece: Piece) -> Tensor:
            return piece.local_part(self.values_of(piece.block.param))

        def with_params(piece: Piece) -> bool:
            return params_of[id(piece.stack)]

        # 1. my parts of other ranks' blocks
        send: list[list[Tensor]] = [[] for _ in range(self.world_size)]
        for owner, piece in self.pieces_out:
            if is_active(piece):
                send[owner].append(grad_of(piece))
                if with_params(piece):
                    send[owner].append(param_of(piece))
        recv_sizes = [0] * self.world_size
        for source, piece in self.pieces_in:
            if is_active(piece):
                recv_sizes[source] += piece.numel * (2 if with_params(piece) else 1)
        received = self._all_to_all(send, recv_sizes, dtype)
        # 2. my own parts of my blocks, then the received ones, into the owners' buffers
        for piece in self.local_pieces:
            if is_active(piece):
                piece.write_block(piece.stack.gathered_grad[piece.member], grad_of(piece))
                if with_params(piece):
                    piece.write_block(piece.stack.gathered_param[piece.member],
                                      param_of(piece))
        offsets = [0] * self.world_size
        for source, piece in self.pieces_in:
            if not is_active(piece):
                continue
            targets = [piece.stack.gathered_grad]
            if with_params(piece):
                targets.append(piece.stack.gathered_param)
            for target in targets:
                start = offsets[source]
                piece.write_block(target[piece.member],
                                  received[source][start : start + piece.numel])
                offsets[source] += piece.numel
        self.placed_grads = {}  # read into the owners' buffers: not kept past the step

    def any_rank(self, flag: bool) -> bool:
        return any_rank(flag, self._device, self.process_group)

    def stacked_grads(self, stack, active: list[int]) -> Tensor:
        buffer = stack.gathered_grad
        return buffer if len(active) == len(stack.members) else buffer[active]

    def param_rows(self, stack, active: list[int]) -> list[Tensor]:
        buffer = stack.gathered_param
        return [buffer[i] for i in active]

    def finish_step(self, layout, active: dict[int, list[int]]) -> None:
        """Direction parts of the ``active`` members → every rank holding them; add them
        to the local shards."""
        is_active = _membership(layout, active)
        comm = self.communication_dtype
        send: list[list[Tensor]] = [[] for _ in range(self.world_size)]
        for holder, piece in self.directions_out:
            if is_active(piece):
                send[holder].append(piece.block_part(piece.stack.directions[piece.member]))
        recv_sizes = [0] * self.world_size
        for owner, piece in self.directions_in:
            if is_active(piece):
                recv_sizes[owner] += piece.numel
        received = self._all_to_all(send, recv_sizes, comm)
        adds: list[tuple[Piece, Tensor]] = []
        for piece in self.local_pieces:
            if is_active(piece):
                update = piece.block_part(piece.stack.directions[piece.member])
                # through the communication dtype, as every other holder gets it
                adds.append((piece, update if update.dtype == comm else update.to(comm)))
        offsets = [0] * self.world_size
        for owner, piece in self.directions_in:
            if is_active(piece):
                start = offsets[owner]
                adds.append((piece, received[owner][start : start + piece.numel]))
                offsets[owner] += piece.numel
        targets: list[Tensor] = []
        updates: list[Tensor] = []
        for piece, update in adds:
            local = self.values_of(piece.block.param)
            if piece.cut.is_box:
                target = piece.cut.local_box(local, view=True)[piece.cut.in_local]
                targets.append(target)
                updates.append(update.view(target.shape))
            else:
                local.view(-1).index_add_(0, piece.cut.in_local,
                                          update.reshape(-1).to(local.dtype))
        if targets:
            torch._foreach_add_(targets, updates)

    def _all_to_all(self, send: list[list[Tensor]], recv_sizes: list[int],
                    dtype: torch.dtype) -> list[Tensor]:
        """One ``all_to_all_single``: ``send[r]`` (pieces, concatenated) to rank ``r``;
        returns what each rank sent here, as flat tensors."""
        device = self._device
        send_sizes = [sum(t.numel() for t in pieces) for pieces in send]
        flat = [t.reshape(-1) for pieces in send for t in pieces]
        buffer = (torch.cat([t.to(dtype) for t in flat]) if flat
                  else torch.empty(0, dtype=dtype, device=device))
        buffer = buffer.to(device)
        out = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
        self.bytes_last_step += (buffer.numel() + out.numel()) * dtype.itemsize
        dist.all_to_all_single(out, buffer, recv_sizes, send_sizes,
                               group=self.process_group)
        return list(out.split(recv_sizes))


def _placed_gradient(param: Tensor) -> Tensor | None:
    """A DTensor gradient placed otherwise than its parameter (a ``Partial`` sum left by a
    tensor-parallel backward), redistributed to the parameter's placements (a new tensor:
    ``param.grad`` is not touched); None where the gradient is placed as its parameter."""
    grad = param.grad
    if grad is None or not is_dtensor(param) or not is_dtensor(grad):
        return None
    if tuple(grad.placements) != tuple(param.placements) or grad.device_mesh != \
            param.device_mesh:
        return grad.redistribute(param.device_mesh, param.placements)
    return None


def _flags_on_every_rank(params: dict[int, Tensor], check_finite: bool,
                         has: Callable[[Tensor], bool], elements: Callable[[Tensor], Tensor],
                         group=None) -> tuple[set[int], list[int]]:
    """Which parameters have a gradient on some rank, and (``check_finite``) which have a
    nan or an inf in some rank's gradient shard: one ``all_reduce`` of two flags per
    parameter, one host synchronisation (and a second exact look, only where a shard's
    norm was not finite)."""
    order = list(params)
    device = collective_device(params.values(), group)
    flags = torch.zeros((2, len(order)), dtype=torch.int32, device=device)
    present = [has(params[i]) for i in order]
    flags[0] = torch.tensor(present, dtype=torch.int32, device=device)
    with_grad = [k for k, here in enumerate(present) if here]
    shards = [elements(params[order[k]]) for k in with_grad] if check_finite else []
    if shards:
        bad = maybe_nonfinite(shards)
        flags[1, torch.tensor(with_grad, device=device)] = bad.to(torch.int32)
    has_grad, nonfinite = any_rank_each(flags, group).tolist()
    if any(nonfinite):
        # rare (a nan, an inf, or a norm that overflowed): every rank got the same flags,
        # so all look again, element by element, and agree in a second all_reduce
        suspects = [nonfinite[k] for k in with_grad]
        exact = torch.zeros(len(order), dtype=torch.int32, device=device)
        if with_grad:
            exact[torch.tensor(with_grad, device=device)] = torch.tensor(
                confirmed_nonfinite(shards, suspects), dtype=torch.int32, device=device)
        nonfinite = any_rank_each(exact, group).tolist()
    return ({i for i, f in zip(order, has_grad) if f},
            [i for i, f in zip(order, nonfinite) if f])


def _membership(layout, active: dict[int, list[int]]) -> Callable[[Piece], bool]:
    """Whether a piece belongs to one of the ``active`` members (``id(stack)`` → positions)
    of the layout's stacks."""
    members = {(id(s), m) for s in layout.stacks for m in active[id(s)]}
    return lambda piece: (id(piece.stack), piece.member) in members


def _exchange_dtype(stacks) -> torch.dtype:
    """Gradients travel in the widest working dtype, so that nothing is rounded on the way."""
    return torch.float64 if any(s.work_dtype == torch.float64 for s in stacks) else torch.float32
