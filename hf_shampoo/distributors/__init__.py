"""Distributors: where blocks live and how directions travel between ranks.

``base`` holds the interface (``Distributor``: what the step calls, nothing more) and the
shared helpers, ``placements`` which part of every parameter each rank holds (DTensor
layouts, DeepSpeed's flat ranges); ``single``, ``ddp`` and ``sharded`` are the ways of
exchanging directions (none, one all-gather, the lossless exchange of block parts for every
DTensor layout: FSDP2 / HSDP / tensor parallel) and import only those two; ``local`` is
``fsdp_mode="local"`` (one process per shard, on ``single``); ``zero`` is the lossless
exchange over DeepSpeed ZeRO 1/2's flat partitions (on ``sharded``);
``factory.make_distributor`` picks one for the parameters; ``agreement`` checks, once per
layout, that the ranks which share blocks hold the same parameters with the same settings.
"""

from .base import (
    OTHER_RANK,
    Distributor,
    block_cost,
    greedy_assignment,
    refresh_work,
    staggered_assignment,
    staggered_units,
)
from .ddp import DataParallelDistributor
from .factory import make_distributor
from .local import LocalShardDistributor
from .sharded import ShardedDistributor
from .single import SingleProcessDistributor

__all__ = [
    "OTHER_RANK",
    "DataParallelDistributor",
    "Distributor",
    "LocalShardDistributor",
    "ShardedDistributor",
    "SingleProcessDistributor",
    "block_cost",
    "greedy_assignment",
    "refresh_work",
    "staggered_assignment",
    "staggered_units",
    "make_distributor",
]
