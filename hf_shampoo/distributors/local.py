"""``fsdp_mode="local"`` (Meta's FSDP2 default): one process per shard.

Each rank blocks its own row shard of every FSDP2 / HSDP parameter as if it were the whole
parameter, owns all of those blocks and communicates nothing beyond FSDP's own (and one
flag when a gradient is not finite): the single-process distributor over local shards.
Cheaper than the lossless ``sharded.ShardedDistributor``, but the numbers depend on the world
size; it takes FSDP2's ``(Shard(0),)`` and HSDP's ``(Replicate(), Shard(0))`` only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor

from .base import OTHER_RANK
from .collectives import any_rank, collective_device
from .groups import RankGroup
from .placements import is_dtensor, local_tensor
from .single import SingleProcessDistributor

__all__ = ["LocalShardDistributor", "local_mode_grid"]


def local_mode_grid(params: Sequence[Tensor]) -> list[list[int]] | None:
    """``fsdp_mode="local"``'s mesh as ``grid[replica][shard]`` (a 1-D mesh is one replica),
    or None when no parameter is a DTensor; only FSDP2's ``(Shard(0),)`` and HSDP's
    ``(Replicate(), Shard(0))`` on one mesh, the layouts it can block shard by shard."""
    from torch.distributed.tensor import Replicate, Shard

    grid = None
    for index, param in enumerate(params):
        if not is_dtensor(param):
            continue
        mesh, placements = param.device_mesh, tuple(param.placements)
        ranks = mesh.mesh.reshape(-1, mesh.mesh.shape[-1]).tolist()
        if not ((mesh.ndim == 1 and placements == (Shard(0),))
                or (mesh.ndim == 2 and placements == (Replicate(), Shard(0)))):
            raise ValueError(
                f"DistributedShampoo: fsdp_mode='local' blocks each rank's row shard and "
                f"takes FSDP2's (Shard(0),) or HSDP's (Replicate(), Shard(0)); parameter "
                f"{index} (shape {tuple(param.shape)}) is placed {placements} on a "
                f"{mesh.ndim}-D mesh. Use fsdp_mode='lossless' (the default) for tensor "
                "parallel layouts")
        if grid is not None and ranks != grid:
            raise ValueError(
                "DistributedShampoo: fsdp_mode='local' needs every parameter on one mesh; "
                f"found {grid} and {ranks}. Use fsdp_mode='lossless' (the default)")
        grid = ranks
    return grid


class LocalShardDistributor(SingleProcessDistributor):
    """``fsdp_mode="local"``: each rank's local shard is blocked as if it were the whole
    parameter; no communication beyond FSDP's own (numbers depend on the world size)."""

    is_sharded_state = True

    def __init__(self, grid: list[list[int]], group: RankGroup | None = None) -> None:
        self.grid = grid
        self.group = group or RankGroup.world()  # the meshes' ranks: the flag's all_reduce
        self.global_rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.shard_index = next(row.index(self.global_rank) for row in grid
                                if self.global_rank in row)
        self.num_shards = len(grid[0])
        self.state_key_prefix = f"shard{self.shard_index}of{self.num_shards}."

    def global_rank_and_world(self) -> tuple[int, int]:
        return self.global_rank, self.world

    def local(self, tensor: Tensor) -> Tensor:
        return local_tensor(tensor)

    def active_members(self, stacks, check_finite: bool = False
                       ) -> tuple[dict[int, list[int]], list[int]]:
        """As in one process, but a nan or an inf in any rank's shard stops every rank (one
        ``all_reduce`` of one flag, only with ``check_finite``): ranks hold different
        shards, and their blocks differ, so the ranks without it report ``OTHER_RANK``."""
        active, bad = super().active_members(stacks, check_finite)
        device = stacks[0].device if stacks else collective_device((), self.process_group)
        if check_finite and any_rank(bool(bad), device, self.process_group) and not bad:
            bad = [OTHER_RANK]
        return active, bad
