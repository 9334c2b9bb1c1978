"""Deprecated import path, kept for one minor version: ``hf_shampoo.integrations.modules``
moved to three modules at the package's top level: ``hf_shampoo.model_rules`` (the model
walk, roles, presets, rules → parameter groups), ``hf_shampoo.factory`` (``make_optimizer``
and the sketch conversion) and ``hf_shampoo.describe_table`` (the describe table). They need
only torch, and ``integrations/`` holds the adapters to other libraries.

Importing this module issues a ``DeprecationWarning`` that names the new paths and gives
every name of the three: the same objects, their private names too (on attribute access).
The old path is removed in 0.3.0 (CHANGELOG.md, "Deprecated"); the package itself never
imports it.
"""

import warnings as _warnings
from typing import Any as _Any

from .. import describe_table as _describe_table
from .. import factory as _factory
from .. import model_rules as _model_rules
from ..describe_table import *  # noqa: F403
from ..factory import *  # noqa: F403
from ..model_rules import *  # noqa: F403

_MOVED = (_model_rules, _factory, _describe_table)

_warnings.warn("hf_shampoo.integrations.modules moved to hf_shampoo.model_rules, "
               "hf_shampoo.factory and hf_shampoo.describe_table; the old path is removed in "
               "0.3.0", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> _Any:
    """Any other name of the three modules (their private helpers), as before the move."""
    for module in _MOVED:
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
