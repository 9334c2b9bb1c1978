"""Deprecated import path, kept for one minor version: ``hf_shampoo.pipeline`` moved to
``hf_shampoo.step``, the optimizer step's stages over a layout (docs/design.md §2), which the
old name made read as pipeline parallelism.

Importing this module issues a ``DeprecationWarning`` that names the new path and gives
every name of ``hf_shampoo.step``: the same objects, its private names too (on attribute
access). The old path is removed in 0.3.0 (CHANGELOG.md, "Deprecated"); the package itself
never imports it.
"""

import warnings as _warnings
from typing import Any as _Any

from . import step as _moved
from .step import *  # noqa: F403

_warnings.warn("hf_shampoo.pipeline moved to hf_shampoo.step; "
               "the old path is removed in 0.3.0", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> _Any:
    """Any other name of ``hf_shampoo.step`` (its private helpers), as before the move."""
    try:
        return getattr(_moved, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
