"""Consolidation: every rank's blocks gathered onto the ranks that save (docs/design.md §6).

Under data parallelism and FSDP2 each rank's ``state_dict()`` holds the blocks it owns.
Tools that write the optimizer from one process (the Trainer, ``accelerator.save_state``)
need the full state there, so ``DistributedShampoo.consolidate_state_dict`` calls
``gather_state`` on every rank first (as torch's ``ZeroRedundancyOptimizer`` does); the
result is an ordinary state dict that loads at any world size. ``accelerator.save_state``
calls ``state_dict()`` on every rank without consolidating first:
``ranks_accelerate_saves_on`` tells ``state_dict()`` it is called from there, and which
ranks write the file, so that it gathers the blocks onto them itself.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

from .layout import merge_shards, to_cpu


def gather_state(local: dict[str, Any], to: int | Iterable[int] | None = 0,
                 group=None) -> dict | None:
    """Gather every rank's ``local`` state dict onto rank(s) ``to`` of ``group`` (a
    ``distributors.groups.RankGroup``, None: the world; ranks by their position in it, as
    torch's ``ZeroRedundancyOptimizer.consolidate_state_dict`` counts them), a collective
    that every rank of the group calls; ``None``: every rank. Returns the complete state
    dict on a destination rank, None elsewhere."""
    if group is None:
        ranks, process_group = list(range(dist.get_world_size())), None
    else:
        ranks, process_group = list(group.ranks), group.process_group
    size, me = len(ranks), dist.get_rank()
    destinations = range(size) if to is None else [to] if isinstance(to, int) else list(to)
    for destination in destinations:
        if not 0 <= destination < size:
            where = "the world" if group is None or group.is_world else \
                f"this optimizer's group (ranks {ranks})"
            raise ValueError(
                f"DistributedShampoo.consolidate_state_dict: to={destination} is not a rank "
                f"of {where}: expected 0 to {size - 1} (a position in the group)")
    shard = to_cpu(local["state"])
    complete = None
    for destination in destinations:  # one gather per destination, same order everywhere
        target = ranks[destination]
        gathered: list | None = [None] * size if me == target else None
        dist.gather_object(shard, gathered, dst=target, group=process_group)
        if gathered is not None:
            complete = {
                "state": merge_shards(gathered),
                "param_groups": local["param_groups"],
                "shard": {**local["shard"], "complete": True},
            }
    return complete


def ranks_accelerate_saves_on() -> list[int] | None | bool:
    """Inside Accelerate's ``save_accelerator_state`` (which every rank runs during
    ``accelerator.save_state``), the ranks that write its files: ``[0]``, or ``None`` (every
    rank) with ``save_on_each_node``. ``False`` anywhere else. Looks only at the calling
    frames, and only when Accelerate's checkpointing module is loaded."""
    module = sys.modules.get("accelerate.checkpointing")
    code = getattr(getattr(module, "save_accelerator_state", None), "__code__", None)
    if code is None:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return None if frame.f_locals.get("save_on_each_node") else [0]
        frame = frame.f_back
    return False
