"""Deprecated import path, kept for one minor version: ``hf_shampoo.stages`` moved to
``hf_shampoo.update_rules``, the update rules every preconditioner kind shares: grafting,
the filtered gradient, weight decay, momentum (docs/design.md §2).

Importing this module issues a ``DeprecationWarning`` that names the new path and gives
every name of ``hf_shampoo.update_rules``: the same objects, its private names too (on
attribute access). The old path is removed in 0.3.0 (CHANGELOG.md, "Deprecated"); the
package itself never imports it.
"""

import warnings as _warnings
from typing import Any as _Any

from . import update_rules as _moved
from .update_rules import *  # noqa: F403

_warnings.warn("hf_shampoo.stages moved to hf_shampoo.update_rules; "
               "the old path is removed in 0.3.0", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> _Any:
    """Any other name of ``hf_shampoo.update_rules`` (its private helpers), as before the
    move."""
    try:
        return getattr(_moved, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
