"""Which distributor a set of parameters gets: ``make_distributor`` for ``distributed``
= "auto" | "none" | "ddp" | "fsdp"."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .base import Distributor
from .ddp import DataParallelDistributor
from .groups import resolve
from .local import LocalShardDistributor, local_mode_grid
from .sharded import ShardedDistributor, is_dtensor, layout_signature, refuse_unsupported
from .single import SingleProcessDistributor


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


def make_distributor(
    mode: str,
    params: Sequence[Tensor],
    num_trainers_per_group: int,
    communication_dtype: torch.dtype,
    assignment_cost: str = "memory",
    fsdp_mode: str = "lossless",
    current: Distributor | None = None,
    final: bool = True,
    process_group=None,
    names: Sequence[str] | None = None,
) -> Distributor:
    """Pick the distributor for ``distributed`` = "auto" | "none" | "ddp" | "fsdp".

    "auto": the sharded distributor (``sharded.py``) when some parameters are DTensors
    (FSDP2, HSDP, tensor parallel and their products), else
    Accelerate's world when its process state has set up distributed training, else
    torch.distributed's default group when initialised with more than one rank, else one
    process. "ddp" and "fsdp" insist on their kind; "none" is always one process.
    ``process_group`` (a ``ProcessGroup`` or a 1-D ``DeviceMesh``: a pipeline stage's
    data-parallel group) narrows the ranks blocks are spread over to its own; DTensor
    parameters are spread over their meshes' ranks without it (``groups.resolve``).
    ``current`` is kept when it is already the right one. ``final=False`` (at
    construction, before Accelerate may swap in sharded parameters) defers the check that
    "fsdp" has DTensors to the first step.
    """
    sharded = any(is_dtensor(p) for p in params)
    if mode in ("none", "ddp") or (mode == "auto" and not sharded):
        refuse_unsupported(params, sharded_ok=False)
    else:
        refuse_unsupported(params, sharded_ok=True)
    if mode == "none":
        if process_group is not None:
            raise ValueError(
                "DistributedShampoo: process_group is given with distributed='none' (one "
                "process, nothing exchanged); leave one of them out")
        return current if type(current) is SingleProcessDistributor else \
            SingleProcessDistributor()
    initialised = dist.is_available() and dist.is_initialized()
    group = resolve(process_group, params, names) if (
        process_group is not None or sharded) else None
    if mode == "fsdp" or sharded:
        if not sharded:
            if final:
                raise ValueError(
                    "DistributedShampoo: distributed='fsdp' needs parameters sharded by "
                    "torch.distributed.fsdp.fully_shard (FSDP2 DTensors); these are plain "
                    "tensors. Shard the model before the first step, or use "
                    "distributed='auto'"
                )
            return current or SingleProcessDistributor()
        if num_trainers_per_group != -1:
            raise ValueError(
                f"DistributedShampoo: num_trainers_per_group={num_trainers_per_group} applies "
                "to data-parallel training; with DTensor parameters blocks are spread over "
                "the ranks of their meshes (use -1)"
            )
        if fsdp_mode == "lossless":
            signature = layout_signature(params)
            if (type(current) is ShardedDistributor and current.signature == signature
                    and current.group == group):
                return current
            return ShardedDistributor(communication_dtype, assignment_cost,
                                      signature=signature, group=group)
        grid = local_mode_grid(params)
        if type(current) is LocalShardDistributor and current.grid == grid:
            return current
        return LocalShardDistributor(grid, group)
    if isinstance(current, DataParallelDistributor) or (
        type(current) is SingleProcessDistributor and mode == "auto"
    ):
        return current
    if group is not None:  # process_group: its ranks, whatever the world
        if group.size == 1 and mode == "auto" and num_trainers_per_group in (-1, 1):
            single = SingleProcessDistributor()
            single.group = group  # checkpoints of a one-rank stage stay within it
            return single
        return DataParallelDistributor(
            communication_dtype, num_trainers_per_group, assignment_cost, group)
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
    return SingleProcessDistributor()
