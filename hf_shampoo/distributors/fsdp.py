"""Sharded parameters (docs/design.md §8): FSDP2 ``fully_shard`` and HSDP meshes.

``fully_shard`` turns every parameter into a DTensor whose rows (dim 0, ``torch.chunk``
semantics) are spread over the shard dim of a device mesh: ``(Shard(0),)`` on a 1-D mesh,
``(Replicate(), Shard(0))`` on a 2-D HSDP mesh whose first dim holds identical replicas.

``ShardedDistributor`` (the default, lossless) blocks every parameter as the full tensor,
exactly as one process does (docs/design.md §1), and gives each block one owner among all ranks of
the mesh. A step is three collectives, whatever the number of parameters:

1. an ``all_reduce`` of one flag per parameter (which parameters have a gradient);
2. an ``all_to_all`` that sends each owner the rows of its blocks' gradients (and, with
   weight decay, parameters) that other ranks of its replica hold;
3. after the owners computed ``-lr * P``, an ``all_to_all`` that sends every rank of every
   replica the direction rows of its own shard.

A block's rows never travel to a rank that already holds them, and owners are chosen
among the ranks that hold most of a block's rows while the load stays balanced. With
float32 communication the parameters are bit-identical to one process.

``LocalShardDistributor`` (``fsdp_mode="local"``) blocks each rank's local shard as if it
were the parameter and communicates nothing (Meta's FSDP2 default): cheaper, but the
numbers depend on the world size.

``refuse_unsupported`` rejects what neither handles (tensor-parallel placements, FSDP1
flat parameters, DeepSpeed ZeRO) before any state exists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .base import (
    OTHER_RANK,
    Distributor,
    allocate_per_stack,
    block_cost,
    nonfinite_flags,
    params_with_gradients,
    stack_buffer,
    world_any,
)

_SUPPORTED = (
    "DistributedShampoo supports plain parameters (one process, DDP) and FSDP2 "
    "fully_shard parameters: DTensors placed (Shard(0),) on a 1-D mesh or "
    "(Replicate(), Shard(0)) on a 2-D HSDP mesh"
)


def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DTensor


def is_dtensor(tensor: Tensor) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(tensor, cls)


def _describe(index: int, param: Tensor, names: Sequence[str] | None) -> str:
    if names is not None and index < len(names):
        return repr(names[index])
    return f"{index} (shape {tuple(param.shape)})"


def refuse_unsupported(
    params: Sequence[Tensor], sharded_ok: bool = True, names: Sequence[str] | None = None
) -> None:
    """Raise ``ValueError`` for parameters no distributor here handles; with
    ``sharded_ok=False`` also for FSDP2 DTensors (``distributed="none"`` / ``"ddp"``)."""
    from torch.distributed.tensor import Replicate, Shard

    meshes = set()
    for index, param in enumerate(params):
        where = _describe(index, param, names)
        if getattr(param, "_is_flat_param", False) or getattr(param, "_fsdp_flattened", False):
            raise ValueError(
                f"DistributedShampoo: parameter {where} is an FSDP1 FlatParameter. "
                f"{_SUPPORTED}. Shard the model with torch.distributed.fsdp.fully_shard "
                "(FSDP2; Accelerate: fsdp_version: 2; Trainer: fsdp_config={'fsdp_version': 2})"
            )
        if any(hasattr(param, a) for a in ("ds_id", "ds_numel", "ds_tensor")):
            raise ValueError(
                f"DistributedShampoo: parameter {where} is partitioned by DeepSpeed ZeRO. "
                f"{_SUPPORTED}. Use FSDP2 (fully_shard) for sharded training, or ZeRO "
                "stage 0 (data parallel)"
            )
        if not is_dtensor(param):
            continue
        if not sharded_ok:
            raise ValueError(
                f"DistributedShampoo: parameter {where} is an FSDP2 DTensor, which "
                "distributed='none' and 'ddp' do not handle; use distributed='auto' or 'fsdp'"
            )
        mesh, placements = param.device_mesh, tuple(param.placements)
        if not (
            (mesh.ndim == 1 and placements == (Shard(0),))
            or (mesh.ndim == 2 and placements == (Replicate(), Shard(0)))
        ):
            raise ValueError(
                f"DistributedShampoo: parameter {where} is a DTensor placed {placements} on a "
                f"{mesh.ndim}-D mesh. {_SUPPORTED}. Tensor-parallel placements (Shard(1), "
                "mixed meshes) are not supported: train those parameters with another "
                "optimizer in a separate parameter set"
            )
        meshes.add((tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist())))
    if len(meshes) > 1:
        raise ValueError(
            f"DistributedShampoo: the parameters live on {len(meshes)} different device meshes "
            f"({sorted(meshes)}); {_SUPPORTED}, all on one mesh"
        )


def sharding_mesh(params: Sequence[Tensor]) -> list[list[int]] | None:
    """The ranks of the parameters' mesh as ``grid[replica][shard]`` (a 1-D mesh is one
    replica), or None when no parameter is a DTensor."""
    for param in params:
        if is_dtensor(param):
            ranks = param.device_mesh.mesh
            return ranks.reshape(-1, ranks.shape[-1]).tolist()
    return None


@dataclass(frozen=True)
class RowSharding:
    """Which rows of a parameter's merged view (docs/design.md §1) each shard index holds.

    ``fully_shard`` splits dim 0 with ``torch.chunk``; a range of dim-0 rows is a range
    of merged rows, because merging keeps dim 0 in the first merged dim. A plain
    (replicated) parameter has one "shard" holding every row, on every rank.
    """

    ranges: tuple[tuple[int, int], ...]  # per shard index: [lo, hi) in merged rows
    replicated: bool  # a plain parameter: every rank holds every row

    @classmethod
    def of(cls, param: Tensor, merged: tuple[int, ...], num_shards: int) -> RowSharding:
        if not is_dtensor(param):
            return cls(((0, merged[0]),), True)
        return cls.for_shape(tuple(param.shape), merged, num_shards)

    @classmethod
    def for_shape(cls, shape: tuple[int, ...], merged: tuple[int, ...],
                  num_shards: int) -> RowSharding:
        """Rows of each shard of a parameter of this (full) shape, dim 0 chunked."""
        numel, rows = math.prod(shape), merged[0]
        dim0 = shape[0] if len(shape) > 0 else 1
        chunk = -(-dim0 // num_shards)
        row_numel = numel // rows if rows else 0  # elements of one merged row
        per_row = numel // dim0 if dim0 else 0  # elements of one dim-0 row
        ranges = []
        for s in range(num_shards):
            lo, hi = min(s * chunk, dim0), min((s + 1) * chunk, dim0)
            if row_numel == 0:
                ranges.append((0, 0))
                continue
            ranges.append((lo * per_row // row_numel, hi * per_row // row_numel))
        return cls(tuple(ranges), False)


@dataclass(frozen=True)
class Piece:
    """Rows ``[lo, hi)`` (merged rows of the parameter) of one block, moving between ranks."""

    block: object  # BlockRef
    stack: object  # BlockStack
    member: int  # position in the stack
    lo: int
    hi: int
    shard_lo: int  # first merged row of the shard that holds the piece on the other side

    @property
    def numel(self) -> int:
        return (self.hi - self.lo) * math.prod(self.stack.shape[1:])

    def block_rows(self, tensor: Tensor) -> Tensor:
        """The piece's rows of a ``(*block shape)`` tensor (a direction or a gradient)."""
        start = self.block.slices[0].start if self.block.slices is not None else 0
        return tensor[self.lo - start : self.hi - start]

    def shard_rows(self, local: Tensor, merged: tuple[int, ...]) -> Tensor:
        """The piece within a rank's local shard (shaped like the parameter's local tensor)."""
        rows = local.reshape(-1, *merged[1:]) if len(merged) > 1 else local.reshape(-1)
        view = rows[self.lo - self.shard_lo : self.hi - self.shard_lo]
        if self.block.slices is not None:
            view = view[(slice(None), *self.block.slices[1:])]
        return view


class ShardedDistributor(Distributor):
    """Lossless FSDP2 / HSDP training: full-parameter blocks, one owner each (see top)."""

    is_sharded_state = True

    def __init__(
        self, grid: list[list[int]], communication_dtype: torch.dtype,
        assignment_cost: str = "memory", balance_slack: float = 0.1,
    ) -> None:
        super().__init__(communication_dtype)
        world = dist.get_world_size()
        ranks = sorted(r for row in grid for r in row)
        if ranks != list(range(world)):
            raise ValueError(
                f"DistributedShampoo: the FSDP mesh holds ranks {ranks}, the process group "
                f"{world} ranks; a mesh must span the whole world"
            )
        self.grid = grid
        self.num_replicas, self.num_shards = len(grid), len(grid[0])
        self.world_size = world
        self.rank = dist.get_rank()
        self.coordinate = next((i, row.index(self.rank)) for i, row in enumerate(grid)
                               if self.rank in row)
        self.assignment_cost = assignment_cost
        self.balance_slack = balance_slack
        self.shardings: dict[int, RowSharding] = {}  # param_index → rows per shard
        self.pieces_in: list[tuple[int, Piece]] = []  # (source rank, piece) for my blocks
        self.pieces_out: list[tuple[int, Piece]] = []  # (owner rank, piece) of my shard
        self.directions_out: list[tuple[int, Piece]] = []  # (holder rank, piece), my blocks
        self.directions_in: list[tuple[int, Piece]] = []  # (owner rank, piece) of my shard
        self.local_pieces: list[Piece] = []  # rows of my blocks that I hold myself
        self.bytes_last_step = 0  # sent + received by this rank in the last step

    def global_rank_and_world(self) -> tuple[int, int]:
        return self.rank, self.world_size

    # ------------------------------------------------------------- layout
    def holders(self, sharding: RowSharding, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """``(shard, lo, hi)`` of each shard index holding rows of ``[lo, hi)``."""
        out = []
        for s, (a, b) in enumerate(sharding.ranges):
            x, y = max(lo, a), min(hi, b)
            if x < y:
                out.append((s, x, y))
        return out

    def assign(self, blocks: Sequence, block_shapes: Sequence[tuple[int, ...]]) -> list[int]:
        """Greedy, heaviest block first: the least-loaded rank among those holding most of
        the block's rows, unless that would load it beyond ``(1 + balance_slack)`` times
        the average; then the least-loaded rank of all. Deterministic everywhere."""
        costs = [block_cost(shape, self.assignment_cost) for shape in block_shapes]
        capacity = (1.0 + self.balance_slack) * sum(costs) / self.world_size
        load = dict.fromkeys(range(self.world_size), 0.0)
        owners = [0] * len(blocks)
        for i in sorted(range(len(blocks)), key=lambda i: (-costs[i], i)):
            block = blocks[i]
            sharding = self._sharding(block)
            lo, hi = self._rows(block)
            preferred = list(range(self.world_size))
            if not sharding.replicated:
                held = self.holders(sharding, lo, hi)
                if held:
                    best = max(y - x for _, x, y in held)
                    shards = [s for s, x, y in held if y - x == best]
                    preferred = [row[s] for row in self.grid for s in shards]
            owner = min(preferred, key=lambda r: (load[r], r))
            if load[owner] + costs[i] > capacity:
                owner = min(load, key=lambda r: (load[r], r))
            owners[i] = owner
            load[owner] += costs[i]
        return owners

    def _sharding(self, block) -> RowSharding:
        sharding = self.shardings.get(block.param_index)
        if sharding is None:
            sharding = RowSharding.of(block.param, block.merged, self.num_shards)
            self.shardings[block.param_index] = sharding
        return sharding

    @staticmethod
    def _rows(block) -> tuple[int, int]:
        if block.slices is None:
            return 0, block.merged[0]
        return block.slices[0].start, block.slices[0].stop

    def allocate_directions(self, stacks) -> None:
        """Direction tensors of owned stacks, and the step's communication plan."""
        self.pieces_in, self.pieces_out = [], []
        self.directions_in, self.directions_out, self.local_pieces = [], [], []
        self._device = stacks[0].device if stacks else torch.device("cpu")
        my_shard = self.coordinate[1]
        for stack in stacks:
            mine = stack.rank == self.rank
            if mine:
                stack.directions = torch.zeros((len(stack.members), *stack.shape),
                                               dtype=stack.work_dtype, device=stack.device)
            owner_replica = next(i for i, row in enumerate(self.grid) if stack.rank in row)
            for member, block in enumerate(stack.members):
                sharding = self._sharding(block)
                lo, hi = self._rows(block)
                if sharding.replicated:  # every rank holds every row
                    piece = Piece(block, stack, member, lo, hi, 0)
                    if mine:
                        self.local_pieces.append(piece)
                        self.directions_out += [(r, piece) for r in range(self.world_size)
                                                if r != self.rank]
                    else:
                        self.directions_in.append((stack.rank, piece))
                    continue
                for s, x, y in self.holders(sharding, lo, hi):
                    piece = Piece(block, stack, member, x, y, sharding.ranges[s][0])
                    source = self.grid[owner_replica][s]  # gradient rows from my replica
                    if mine:
                        if source == self.rank:
                            self.local_pieces.append(piece)
                        else:
                            self.pieces_in.append((source, piece))
                        self.directions_out += [(row[s], piece) for row in self.grid
                                                if row[s] != self.rank]
                    else:
                        if source == self.rank:
                            self.pieces_out.append((stack.rank, piece))
                        if s == my_shard:
                            self.directions_in.append((stack.rank, piece))

    def needs_reallocation(self, stacks) -> bool:
        return any(s.rank == self.rank and (s.directions is None or s.directions.device
                                            != s.device) for s in stacks)

    # ------------------------------------------------------------- one step
    def active_members(self, stacks, check_finite: bool = False
                       ) -> tuple[dict[int, list[int]], list[int]]:
        """Blocks of parameters that have a gradient on any rank and, with
        ``check_finite``, the parameters whose gradient shard holds a nan or an inf on any
        rank: both in one ``all_reduce``, so that every rank agrees on what moves."""
        self.bytes_last_step = 0
        params = params_with_gradients(stacks)
        has_grad, bad = _flags_on_every_rank(params, check_finite)
        return ({id(stack): [m for m, b in enumerate(stack.members) if b.param_index in has_grad]
                 for stack in stacks}, bad)

    def prepare_step(self, layout, active: dict[int, list[int]], needs_params) -> None:
        """Gradient (and parameter, where ``needs_params(stack)``) rows → owners."""
        self._active = {(id(s), m) for s in layout.stacks for m in active[id(s)]}
        dtype = _exchange_dtype(layout.stacks)
        self._params_of = {id(s): needs_params(s) for s in layout.stacks}
        for stack in layout.stacks:
            if stack.rank == self.rank and active[id(stack)]:
                stack_buffer(stack, "gathered_grad")
                if self._params_of[id(stack)]:
                    stack_buffer(stack, "gathered_param")

        def pieces_of(tensor_name):
            def take(piece: Piece):
                param = piece.block.param
                source = param.grad if tensor_name == "grad" else param
                if source is None:  # no gradient here, but elsewhere: zeros (FSDP keeps none)
                    return torch.zeros((piece.hi - piece.lo, *piece.stack.shape[1:]),
                                       dtype=dtype, device=param.device)
                return piece.shard_rows(_local(source), piece.block.merged)
            return take

        grad_of, param_of = pieces_of("grad"), pieces_of("param")
        # 1. my shard's rows of other ranks' blocks
        send: list[list[Tensor]] = [[] for _ in range(self.world_size)]
        for owner, piece in self.pieces_out:
            if (id(piece.stack), piece.member) not in self._active:
                continue
            send[owner].append(grad_of(piece))
            if self._params_of[id(piece.stack)]:
                send[owner].append(param_of(piece))
        recv_sizes = [0] * self.world_size
        for source, piece in self.pieces_in:
            if (id(piece.stack), piece.member) in self._active:
                recv_sizes[source] += piece.numel * (2 if self._params_of[id(piece.stack)] else 1)
        received = self._all_to_all(send, recv_sizes, dtype)
        # 2. my own rows of my blocks, then the received ones, into the owners' buffers
        for piece in self.local_pieces:
            if (id(piece.stack), piece.member) not in self._active:
                continue
            piece.block_rows(piece.stack.gathered_grad[piece.member]).copy_(grad_of(piece))
            if self._params_of[id(piece.stack)]:
                piece.block_rows(piece.stack.gathered_param[piece.member]).copy_(param_of(piece))
        offsets = [0] * self.world_size
        for source, piece in self.pieces_in:
            if (id(piece.stack), piece.member) not in self._active:
                continue
            targets = [piece.stack.gathered_grad]
            if self._params_of[id(piece.stack)]:
                targets.append(piece.stack.gathered_param)
            for target in targets:
                rows = piece.block_rows(target[piece.member])
                start = offsets[source]
                rows.copy_(received[source][start : start + piece.numel].view(rows.shape))
                offsets[source] += piece.numel

    def any_rank(self, flag: bool) -> bool:
        return world_any(flag, self._device)

    def all_gather(self) -> None:
        pass  # finish_step sends each rank its shard's directions by all_to_all instead

    def stacked_grads(self, stack, active: list[int]) -> Tensor:
        buffer = stack.gathered_grad
        return buffer if len(active) == len(stack.members) else buffer[active]

    def stacked_params(self, stack, active: list[int], out: Tensor) -> Tensor:
        buffer = stack.gathered_param
        if len(active) == len(stack.members):
            return out.copy_(buffer)
        return torch.index_select(buffer, 0, torch.tensor(active, device=buffer.device), out=out)

    def apply_outside_step(self, layout, moving: dict[int, list[int]]) -> None:
        self._active = {(id(s), m) for s in layout.stacks for m in moving[id(s)]}
        self.finish_step(layout, moving)

    def finish_step(self, layout, active: dict[int, list[int]]) -> None:
        """Direction rows → every rank holding them; add them to the local shards."""
        comm = self.communication_dtype
        send: list[list[Tensor]] = [[] for _ in range(self.world_size)]
        for holder, piece in self.directions_out:
            if (id(piece.stack), piece.member) in self._active:
                send[holder].append(piece.block_rows(piece.stack.directions[piece.member]))
        recv_sizes = [0] * self.world_size
        for owner, piece in self.directions_in:
            if (id(piece.stack), piece.member) in self._active:
                recv_sizes[owner] += piece.numel
        received = self._all_to_all(send, recv_sizes, comm)
        targets: list[Tensor] = []
        updates: list[Tensor] = []
        for piece in self.local_pieces:
            if (id(piece.stack), piece.member) not in self._active:
                continue
            update = piece.block_rows(piece.stack.directions[piece.member])
            targets.append(self._shard_view(piece))
            # through the communication dtype, as every other holder of these rows gets it
            updates.append(update if update.dtype == comm else update.to(comm))
        offsets = [0] * self.world_size
        for owner, piece in self.directions_in:
            if (id(piece.stack), piece.member) not in self._active:
                continue
            target = self._shard_view(piece)
            start = offsets[owner]
            updates.append(received[owner][start : start + piece.numel].view(target.shape))
            targets.append(target)
            offsets[owner] += piece.numel
        if targets:
            torch._foreach_add_(targets, updates)

    def _shard_view(self, piece: Piece) -> Tensor:
        return piece.shard_rows(_local(piece.block.param), piece.block.merged)

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
        dist.all_to_all_single(out, buffer, recv_sizes, send_sizes)
        return list(out.split(recv_sizes))


def _flags_on_every_rank(params: dict[int, Tensor], check_finite: bool
                         ) -> tuple[set[int], list[int]]:
    """Which parameters have a gradient on some rank, and (``check_finite``) which have a
    nan or an inf in some rank's gradient shard: one ``all_reduce`` of two flags per
    parameter, one host synchronisation."""
    order = list(params)
    device = next(iter(params.values())).device if params else torch.device("cpu")
    flags = torch.zeros((2, len(order)), dtype=torch.int32, device=device)
    flags[0] = torch.tensor([params[i].grad is not None for i in order], dtype=torch.int32,
                            device=device)
    with_grad = [k for k, i in enumerate(order) if params[i].grad is not None]
    if check_finite and with_grad:
        bad = nonfinite_flags([_local(params[order[k]].grad) for k in with_grad])
        flags[1, torch.tensor(with_grad, device=device)] = bad.to(torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    has_grad, nonfinite = flags.tolist()
    return ({i for i, f in zip(order, has_grad) if f},
            [i for i, f in zip(order, nonfinite) if f])


def _device_of(stacks) -> torch.device:
    return stacks[0].device if stacks else torch.device("cpu")


def _exchange_dtype(stacks) -> torch.dtype:
    """Gradients travel in the widest working dtype, so that nothing is rounded on the way."""
    return torch.float64 if any(s.work_dtype == torch.float64 for s in stacks) else torch.float32


class LocalShardDistributor(Distributor):
    """``fsdp_mode="local"``: each rank's local shard is blocked as if it were the whole
    parameter; no communication beyond FSDP's own (numbers depend on the world size)."""

    is_sharded_state = True

    def __init__(self, grid: list[list[int]], communication_dtype: torch.dtype) -> None:
        super().__init__(communication_dtype)
        self.grid = grid
        self.global_rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.shard_index = next(row.index(self.global_rank) for row in grid
                                if self.global_rank in row)
        self.num_shards = len(grid[0])

    def global_rank_and_world(self) -> tuple[int, int]:
        return self.global_rank, self.world

    def local(self, tensor: Tensor) -> Tensor:
        return _local(tensor)

    def state_key_prefix(self) -> str:
        return f"shard{self.shard_index}of{self.num_shards}."

    def active_members(self, stacks, check_finite: bool = False
                       ) -> tuple[dict[int, list[int]], list[int]]:
        """As in one process, but a nan or an inf in any rank's shard stops every rank (one
        ``all_reduce`` of one flag, only with ``check_finite``): ranks hold different
        shards, and their blocks differ, so the ranks without it report ``OTHER_RANK``."""
        active, bad = super().active_members(stacks, check_finite)
        if check_finite and world_any(bool(bad), _device_of(stacks)) and not bad:
            bad = [OTHER_RANK]
        return active, bad

    def assign(self, blocks: Sequence, block_shapes: Sequence[tuple[int, ...]]) -> list[int]:
        return [0] * len(block_shapes)  # every rank owns the blocks of its own shards

    def allocate_directions(self, stacks) -> None:
        allocate_per_stack(stacks)

    def all_gather(self) -> None:
        pass  # each rank applies its own directions to its own shard

    def any_rank(self, flag: bool) -> bool:
        return flag  # as in one process: ranks never wait for each other here


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if is_dtensor(tensor) else tensor
