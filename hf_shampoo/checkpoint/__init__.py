"""Checkpoints: the optimizer's state layout and the ways it is saved.

``layout`` defines the state dict (``pack`` / ``unpack``, block identities that do not
depend on the world size); ``consolidate`` gathers every rank's blocks onto the rank that
saves (the Trainer and Accelerate); ``dcp`` writes and reads the same layout sharded with
``torch.distributed.checkpoint``, resumable at any world size. ``save_sharded``,
``load_sharded`` and ``consolidate_checkpoint`` are importable from here; ``dcp`` (and
torch's DCP with it) is imported on first use, not by ``import hf_shampoo``. ``integrity``
tells a whole checkpoint from one cut short and raises ``CheckpointError`` (also
``hf_shampoo.CheckpointError``) for one that cannot be loaded.
"""

from __future__ import annotations

from typing import Any

from .integrity import CheckpointError

_DCP = ("consolidate_checkpoint", "load_sharded", "save_sharded")
__all__ = ["CheckpointError", *_DCP]


def __getattr__(name: str) -> Any:
    if name in _DCP:
        from . import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
