"""Deprecated import path of the sharded checkpoint helpers, kept for one minor version.

``hf_shampoo.distributed_checkpoint`` held ``save_sharded``, ``load_sharded`` and
``consolidate_checkpoint`` until the package was split into layers; they now live in
``hf_shampoo.checkpoint`` (docs/checkpoints.md). Importing this module still gives them,
with a ``DeprecationWarning`` that names the new path.
"""

from __future__ import annotations

import warnings

from .checkpoint import dcp as _dcp

warnings.warn(
    "hf_shampoo.distributed_checkpoint is deprecated and will be removed in 0.3; import "
    "save_sharded, load_sharded and consolidate_checkpoint from hf_shampoo.checkpoint",
    DeprecationWarning, stacklevel=2)

save_sharded = _dcp.save_sharded
load_sharded = _dcp.load_sharded
consolidate_checkpoint = _dcp.consolidate_checkpoint

__all__ = ["consolidate_checkpoint", "load_sharded", "save_sharded"]
