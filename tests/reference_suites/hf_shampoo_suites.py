"""A pytest plugin that puts hf_shampoo into torch's and timm's own optimizer tests.

Those test files are others' code and are not part of this repository: ``run.sh`` runs them
from copies outside it with ``-p hf_shampoo_suites`` (this directory on ``PYTHONPATH``; the
module's name must not clash with the suites' own ``tests`` packages). Loaded before the
test modules are collected, the plugin

- registers ``"shampoo"``, ``"soap"`` and ``"klshampoo"`` with timm (``import hf_shampoo``
  and timm's optimizer factory), so that timm's ``list_optimizers()`` parametrizations
  include them;
- appends ``SHAMPOO_INFO`` (tests/test_torch_optim_info.py: DistributedShampoo as a torch
  ``OptimizerInfo``) to torch's ``optim_db``, which torch's ``TestOptimRenewed`` is
  parametrized over.
"""

from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.append(ROOT)  # hf_shampoo itself, after the suite's own directories

import hf_shampoo  # noqa: E402,F401  (timm registration on import of timm's factory)

try:
    import timm.optim  # noqa: F401
except ImportError:  # timm is optional here
    pass

try:
    from torch.testing._internal import common_optimizers
except ImportError:  # expecttest missing: torch's machinery cannot load
    common_optimizers = None

if common_optimizers is not None:
    # loaded by path: the suites bring their own ``tests`` packages
    spec = importlib.util.spec_from_file_location(
        "hf_shampoo_torch_optim_info", os.path.join(ROOT, "tests", "test_torch_optim_info.py"))
    info = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(info)
    if all(i.optim_cls is not info.SHAMPOO_INFO.optim_cls for i in common_optimizers.optim_db):
        common_optimizers.optim_db.append(info.SHAMPOO_INFO)
