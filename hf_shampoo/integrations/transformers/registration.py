"""Registration by name: ``optim="distributed_shampoo"`` / ``"distributed_muon"`` in
transformers' ``OptimizerNames``, its optimizer handlers (5.x) or
``Trainer.get_optimizer_cls_and_kwargs`` (4.x), ``ShampooCheckpointCallback`` among the
Trainer's default callbacks, ``Trainer.log`` wrapped so that the training log entries of
those names carry ``optimizer.metrics()`` (docs/metrics.md); and ``get_last_checkpoint``
(what ``resume_from_checkpoint=True`` and the example scripts use) passes over a
``checkpoint-N`` whose save was cut short, with a warning, for the newest one the Trainer
can resume. The only module that touches
transformers' internals, so it is guarded by version; ``register_on_import()`` (what
``import hf_shampoo`` calls) patches transformers' modules right after they load, never
importing transformers itself.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

from ...checkpoint.integrity import newest_complete, trainer_checkpoint_problem
from ...optional import require
from ..after_import import on_import
from .arguments import MUON_NAME, OPTIMIZER_NAME, OPTIMIZER_NAMES, optimizer_cls_and_kwargs
from .trainer import add_optimizer_metrics, classes, uses_shampoo

# the members added to transformers' OptimizerNames enum
_MEMBERS = {OPTIMIZER_NAME: "DISTRIBUTED_SHAMPOO", MUON_NAME: "DISTRIBUTED_MUON"}
# Registration by name patches transformers internals; it is tested on 5.24 and on 4.47 (the
# floor, `make floors`) and written for 4.47 <= version < 6 (4.x through a wrapper of
# Trainer.get_optimizer_cls_and_kwargs).
MIN_TRANSFORMERS_VERSION = "4.47.0"
MAX_TRANSFORMERS_VERSION = "6.0.0"  # exclusive
_version_ok: list[bool] = []


def _version_supported() -> bool:
    """Whether registration by name supports the installed transformers (warns once if not)."""
    if _version_ok:
        return _version_ok[0]
    transformers = require("transformers", "optim='distributed_shampoo' in TrainingArguments")
    from packaging.version import Version  # a dependency of transformers

    version = Version(transformers.__version__)
    ok = Version(MIN_TRANSFORMERS_VERSION) <= version < Version(MAX_TRANSFORMERS_VERSION)
    _version_ok.append(ok)
    if not ok:
        warnings.warn(
            f"hf_shampoo: transformers {transformers.__version__} is outside the versions "
            f"optim={OPTIMIZER_NAME!r} supports ({MIN_TRANSFORMERS_VERSION} <= v < "
            f"{MAX_TRANSFORMERS_VERSION}); not registering it. Use "
            "hf_shampoo.integrations.transformers.ShampooTrainer instead.",
            stacklevel=3,
        )
    return ok


def _add_enum_member(enum_cls: type, name: str, value: str) -> Any:
    """Add ``name = value`` to a ``(str, Enum)`` class (idempotent)."""
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = str.__new__(enum_cls, value)
    member._name_ = name
    member._value_ = value
    member._sort_order_ = len(enum_cls._member_names_)
    member.__objclass__ = enum_cls
    setattr(enum_cls, name, member)
    enum_cls._member_names_.append(name)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    return member


def _handler(ctx: Any) -> tuple[type, dict[str, Any]]:
    """transformers 5.x optimizer handler: ``OptimizerContext`` → (class, kwargs)."""
    return optimizer_cls_and_kwargs(ctx.args, ctx.model)


def _patch_training_args(module: Any) -> None:
    for name, member in _MEMBERS.items():
        _add_enum_member(module.OptimizerNames, member, name)


def _patch_trainer_optimizer(module: Any) -> None:
    handlers = getattr(module, "_OPTIMIZER_HANDLERS", None)
    if handlers is None:
        return  # transformers 4.x: _patch_trainer wraps get_optimizer_cls_and_kwargs instead
    names = importlib.import_module("transformers.training_args").OptimizerNames
    for name, member_name in _MEMBERS.items():
        handlers.setdefault(_add_enum_member(names, member_name, name), _handler)


def _resumable(original: Callable[[str], str | None], pattern: Any) -> Callable:
    """``get_last_checkpoint`` that passes over checkpoints the Trainer cannot resume."""
    if getattr(original, "_hf_shampoo", False):
        return original

    def get_last_checkpoint(folder):
        newest = original(folder)
        if newest is None or trainer_checkpoint_problem(newest) is None:
            return newest
        found, skipped = newest_complete(folder, pattern.pattern, trainer_checkpoint_problem)
        for path, problem in skipped:
            warnings.warn(f"hf_shampoo: not resuming from {os.path.join(folder, path.name)}: "
                          f"{problem}; the newest complete checkpoint before it is used "
                          "instead", stacklevel=2)
        return None if found is None else os.path.join(folder, found.name)

    get_last_checkpoint._hf_shampoo = True
    get_last_checkpoint.__doc__ = original.__doc__
    return get_last_checkpoint


def _patch_trainer_utils(module: Any) -> None:
    module.get_last_checkpoint = _resumable(module.get_last_checkpoint, module._re_checkpoint)


def _patch_trainer(module: Any) -> None:
    if hasattr(module, "get_last_checkpoint"):  # bound by name when trainer.py was imported
        utils = importlib.import_module("transformers.trainer_utils")
        _apply("transformers.trainer_utils", utils)
        module.get_last_checkpoint = utils.get_last_checkpoint
    callback = classes()["ShampooCheckpointCallback"]
    if callback not in module.DEFAULT_CALLBACKS:
        module.DEFAULT_CALLBACKS.append(callback)
    _wrap_log(module.Trainer)
    trainer_optimizer = sys.modules.get("transformers.trainer_optimizer")
    if getattr(trainer_optimizer, "_OPTIMIZER_HANDLERS", None) is not None:
        return
    # 4.x: no handler registry; wrap the static method that maps args.optim to a class.
    trainer_cls = module.Trainer
    original = trainer_cls.__dict__["get_optimizer_cls_and_kwargs"]
    if getattr(original, "_hf_shampoo", False):
        return

    def get_optimizer_cls_and_kwargs(args, model=None):
        if uses_shampoo(args):
            return optimizer_cls_and_kwargs(args, model)
        return original.__func__(args, model)

    wrapped = staticmethod(get_optimizer_cls_and_kwargs)
    get_optimizer_cls_and_kwargs._hf_shampoo = True
    wrapped._hf_shampoo = True
    trainer_cls.get_optimizer_cls_and_kwargs = wrapped


def _wrap_log(trainer_cls: type) -> None:
    """``Trainer.log`` that first adds ``optimizer.metrics()`` to a training log entry of
    ``optim="distributed_shampoo"`` / ``"distributed_muon"`` (``add_optimizer_metrics``):
    before ``log_history`` keeps a copy of it and the callbacks (``report_to``) see it,
    which a callback's ``on_log`` comes too late for."""
    original = trainer_cls.__dict__.get("log")
    if original is None or getattr(original, "_hf_shampoo", False):
        return

    def log(self, logs, *args, **kwargs):
        if uses_shampoo(self.args):
            add_optimizer_metrics(self.args, self.optimizer, logs)
        return original(self, logs, *args, **kwargs)

    log._hf_shampoo = True
    log.__doc__, log.__name__, log.__qualname__ = (original.__doc__, original.__name__,
                                                   original.__qualname__)
    trainer_cls.log = log


_PATCHES: dict[str, Callable[[Any], None]] = {
    "transformers.trainer_utils": _patch_trainer_utils,
    "transformers.training_args": _patch_training_args,
    "transformers.trainer_optimizer": _patch_trainer_optimizer,
    "transformers.trainer": _patch_trainer,
}
_patched: set[str] = set()
_lock = threading.RLock()


def _apply(fullname: str, module: Any) -> None:
    with _lock:
        if fullname in _patched:
            return
        _patched.add(fullname)
        if not _version_supported():
            return
        _PATCHES[fullname](module)


def register() -> bool:
    """Register ``optim="distributed_shampoo"`` with transformers now (imports the Trainer).

    Idempotent. Returns False (with a warning) for transformers versions outside
    ``MIN_TRANSFORMERS_VERSION <= v < MAX_TRANSFORMERS_VERSION``.
    """
    if not _version_supported():
        return False
    for fullname in _PATCHES:
        try:
            module = importlib.import_module(fullname)
        except ModuleNotFoundError:  # transformers.trainer_optimizer is 5.x only
            continue
        _apply(fullname, module)
    return True


def is_registered() -> bool:
    """Whether ``TrainingArguments(optim="distributed_shampoo")`` and ``"distributed_muon"``
    are accepted (so far)."""
    module = sys.modules.get("transformers.training_args")
    return module is not None and all(
        name in module.OptimizerNames._value2member_map_ for name in OPTIMIZER_NAMES)


def register_on_import() -> None:
    """Register with transformers lazily: patch its modules already loaded now, the others
    right after they load. Costs nothing when transformers is never imported; this is what
    ``import hf_shampoo`` calls."""
    on_import("transformers", tuple(_PATCHES), _apply, lambda fullname: fullname in _patched)
