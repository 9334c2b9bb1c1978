"""Transformers adapter: ``TrainingArguments(optim="distributed_shampoo")`` and ``ShampooTrainer``.

Two routes build the same optimizer from a model and ``TrainingArguments``:

- **by name** (``registration.py``): ``"distributed_shampoo"`` and ``"distributed_muon"``
  (the same optimizer with the ``"muon"`` module preset) among transformers' optimizer
  names, so that a plain ``Trainer`` and ``--optim distributed_shampoo`` on the command line
  use it, and ``ShampooCheckpointCallback`` in every Trainer. ``import hf_shampoo`` arranges
  this lazily (``register_on_import``); it touches transformers internals, so it is guarded
  by version.
- **stable** (``trainer.py``): ``ShampooTrainer`` (overrides the public
  ``Trainer.create_optimizer``) or ``Trainer(optimizer_cls_and_kwargs=
  optimizer_cls_and_kwargs(args, model))``; neither relies on private transformers API.

``arguments.py`` turns ``TrainingArguments`` and ``optim_args`` into the optimizer.
"""

from typing import Any

from .arguments import (
    FINE_TUNING_DEFAULTS,
    INTEGRATION_KEYS,
    MUON_NAME,
    OPTIMIZER_NAME,
    OPTIMIZER_NAMES,
    SHAMPOO_EPSILON,
    STATELESS_PRESETS,
    OptimArgs,
    cast_value,
    chosen_preset,
    create_optimizer,
    logs_metrics,
    optimizer_cls_and_kwargs,
    parse_optim_args,
    resolve_kwargs,
    trainer_decay_parameter_names,
    trainer_defaults,
    valid_keys,
    validate_args,
)
from .registration import (
    MAX_TRANSFORMERS_VERSION,
    MIN_TRANSFORMERS_VERSION,
    is_registered,
    register,
    register_on_import,
)
from .trainer import add_optimizer_metrics, first_refresh_note, save_ranks

__all__ = [
    "FINE_TUNING_DEFAULTS",
    "INTEGRATION_KEYS",
    "MAX_TRANSFORMERS_VERSION",
    "MIN_TRANSFORMERS_VERSION",
    "MUON_NAME",
    "OPTIMIZER_NAME",
    "OPTIMIZER_NAMES",
    "SHAMPOO_EPSILON",
    "STATELESS_PRESETS",
    "OptimArgs",
    "ShampooCheckpointCallback",
    "ShampooTrainer",
    "add_optimizer_metrics",
    "cast_value",
    "chosen_preset",
    "create_optimizer",
    "first_refresh_note",
    "is_registered",
    "logs_metrics",
    "optimizer_cls_and_kwargs",
    "parse_optim_args",
    "register",
    "register_on_import",
    "resolve_kwargs",
    "save_ranks",
    "trainer_decay_parameter_names",
    "trainer_defaults",
    "valid_keys",
    "validate_args",
]


def __getattr__(name: str) -> Any:
    # ShampooTrainer / ShampooCheckpointCallback subclass transformers' classes: defined on
    # first access, so that importing this package does not import transformers.
    if name in ("ShampooTrainer", "ShampooCheckpointCallback"):
        from .trainer import classes

        return classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
