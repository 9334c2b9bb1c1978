"""Deprecated import path, kept for one minor version: ``hf_shampoo.distributors.fsdp``
moved to ``hf_shampoo.distributors.sharded``, the distributor for every DTensor layout
(FSDP2, HSDP, tensor parallel, sub-meshes, pipeline stages; docs/design.md §8), not for
FSDP alone.

Importing this module issues a ``DeprecationWarning`` that names the new path and gives
every name of ``hf_shampoo.distributors.sharded``: the same objects, those outside its
``__all__`` too (on attribute access). The old path is removed in 0.3.0 (CHANGELOG.md,
"Deprecated"); the package itself never imports it.
"""

import warnings as _warnings
from typing import Any as _Any

from . import sharded as _moved
from .sharded import *  # noqa: F403

_warnings.warn("hf_shampoo.distributors.fsdp moved to hf_shampoo.distributors.sharded; "
               "the old path is removed in 0.3.0", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> _Any:
    """Any other name of ``hf_shampoo.distributors.sharded`` (``__all__``, ``Cut``,
    ``Piece``, private helpers), as before the move."""
    try:
        return getattr(_moved, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
