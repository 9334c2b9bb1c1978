"""The small collectives by which the ranks of a group agree before they go on, and the
device they run on (docs/design.md §4 and §8): every other module asks here.

Each is called by every rank of ``group`` (a torch process group; None: the default group,
the world) at the same point, with tensors of the same size, so that no rank is left
waiting in a collective the others skipped and every rank raises, or goes on, alike:

``collective_device`` where their tensors live: the parameters' device (the one the
distributors' own collectives use), else the current GPU under NCCL, else the CPU;
``any_rank_each`` ORs a tensor of flags over the ranks, element by element, and ``any_rank``
one flag (one tiny ``all_reduce`` each); ``problems_on_any_rank`` gives every rank every
rank's reasons to refuse, so that all raise the same error (an ``all_reduce`` of one count,
then an ``all_gather_object`` only where some rank has a reason); ``gather_padded`` gives
every rank every rank's 1-D tensor of its own length (one ``all_gather`` of the lengths,
unless the caller knows them, then one of the tensors padded to the longest).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "any_rank",
    "any_rank_each",
    "collective_device",
    "gather_padded",
    "problems_on_any_rank",
]


def collective_device(tensors: Iterable[Tensor], group=None) -> torch.device:
    """The device of the first of ``tensors`` that is not on the meta device (a DTensor's
    local part's), else the current GPU where ``group``'s backend is NCCL, else the CPU."""
    for tensor in tensors:
        if tensor.device.type != "meta":
            return tensor.device
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank_each(flags: Tensor, group=None) -> Tensor:
    """``flags`` (integers, 0 or 1) OR-ed over every rank of ``group``, in place and
    returned: one ``all_reduce``."""
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return flags


def any_rank(flag: bool, device: torch.device, group=None) -> bool:
    """``flag`` OR-ed over every rank of ``group``: one tiny ``all_reduce``."""
    return bool(
        any_rank_each(torch.tensor([int(flag)], dtype=torch.int32, device=device), group).item()
    )


def problems_on_any_rank(problems: Sequence[str], device: torch.device, group=None) -> list[str]:
    """Every rank's ``problems`` in rank order (empty on every rank where no rank has one),
    for every rank to raise the same error: one ``all_reduce`` of their count, and one
    ``all_gather_object`` of the lists only where some rank has one. This rank's own where
    torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(problems)
    count = torch.tensor([len(problems)], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    if int(count.item()) == 0:
        return []
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, list(problems), group=group)
    return [p for seen in everyone for p in (seen or [])]


def gather_padded(values: Tensor, group=None, lengths: Sequence[int] | None = None) -> list[Tensor]:
    """Every rank's 1-D ``values`` (same dtype on every rank, any length), in rank order,
    each cut to its own length: one ``all_gather`` of the lengths (none where ``lengths``,
    every rank's, are known already), one of the tensors padded with zeros to the
    longest."""
    size = dist.get_world_size(group)
    if lengths is None:
        mine = torch.tensor([values.numel()], dtype=torch.int64, device=values.device)
        rows = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(rows, mine, group=group)
        lengths = [int(row.item()) for row in rows]
    padded = torch.zeros(max(lengths), dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    return [g[:length] for g, length in zip(gathered, lengths)]
