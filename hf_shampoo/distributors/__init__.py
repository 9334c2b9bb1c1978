"""Distributors: where blocks live and how directions travel between ranks.

``base`` holds the interface and the shared helpers; ``single``, ``ddp`` and ``fsdp`` are
the three ways of exchanging directions (none, one all-gather, FSDP2 / HSDP row exchange)
and import only ``base``; ``factory.make_distributor`` picks one for the parameters.
"""

from .base import OTHER_RANK, Distributor, block_cost, greedy_assignment
from .ddp import DataParallelDistributor
from .factory import make_distributor
from .fsdp import LocalShardDistributor, ShardedDistributor
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
    "make_distributor",
]
