"""The Trainer side: ``ShampooCheckpointCallback`` (consolidates the sharded state before
the Trainer saves on one rank; validates ``optim_args`` against the model when the Trainer
is built; says when a run ends before the first preconditioner refresh),
``ShampooTrainer`` (the stable route: it overrides only the public
``Trainer.create_optimizer`` and ``Trainer.log``) and ``add_optimizer_metrics`` (what
``Trainer.log`` adds to a training log entry: ``optimizer.metrics()``, docs/metrics.md).
The classes subclass transformers' classes, so they are defined on first use
(``classes()``), never by ``import hf_shampoo``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from ... import averaging
from ...config import start_step
from ...model_rules import check_preset
from ...optional import require
from ...preconditioners import KINDS
from ..accelerate import consolidate, find_shampoo
from .arguments import (
    OPTIMIZER_NAMES,
    chosen_preset,
    create_optimizer,
    logs_metrics,
    optim_name,
    parse_optim_args,
    resolve_kwargs,
    validate_args,
)

logger = logging.getLogger(__name__)


def uses_shampoo(args: Any) -> bool:
    """Whether ``args.optim`` is one of this package's names."""
    return optim_name(args) in OPTIMIZER_NAMES


def _will_save_optimizer(args: Any, control: Any) -> bool:
    if getattr(args, "save_only_model", False):
        return False
    best = str(getattr(args.save_strategy, "value", args.save_strategy)) == "best"
    return bool(control.should_save or (best and control.should_evaluate))


def save_ranks(args: Any) -> list[int]:
    """Global ranks that write ``optimizer.pt``: rank 0, or with ``save_on_each_node`` the
    first rank of every node (each receives the consolidated state)."""
    world = int(getattr(args, "world_size", 1) or 1)
    if getattr(args, "save_on_each_node", False):
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return list(range(0, world, max(local, 1)))
    return [0]


def averaged_weights_after_training(optimizer: Any, args: Any, state: Any) -> None:
    """With ``iterate_averaging``, leave the model holding the averaged weights ``x`` when
    training ends, so that ``trainer.save_model()`` and later evaluation use them (the
    Trainer itself switches only around evaluations and training steps; the next training
    step switches back). After ``load_best_model_at_end`` the model already holds a saved
    evaluation's averaged weights: the optimizer is only marked as in eval mode."""
    shampoo = find_shampoo(optimizer) if optimizer is not None else None
    if shampoo is None:
        return
    best_loaded = bool(getattr(args, "load_best_model_at_end", False)
                       and getattr(state, "best_model_checkpoint", None))
    if best_loaded:
        averaging.mark_mode(shampoo.param_groups, to_train=False)
    else:
        shampoo.eval()


def first_refresh_note(optimizer: Any, max_steps: int) -> str | None:
    """A line saying that a run of ``max_steps`` steps ends before the first preconditioner
    refresh (so every step is the grafting method's alone), naming that step and the keyword
    that moves it; None when some group preconditions within the run, or none ever does
    (spectral descent and Adam only)."""
    shampoo = find_shampoo(optimizer) if optimizer is not None else None
    if shampoo is None or max_steps is None or max_steps <= 0:
        return None
    firsts = [(start_step(g), g) for g in shampoo.param_groups
              if KINDS[g["preconditioner"]].statistics and g["params"]]
    if not firsts:
        return None
    first, group = min(firsts, key=lambda item: item[0])
    if first <= max_steps:
        return None
    key = ("start_preconditioning_step" if group["start_preconditioning_step"] is not None
           else "precondition_frequency")
    return (f"hf_shampoo: this run ends at step {max_steps}, before the first preconditioner "
            f"refresh at step {first}: every step is the grafting method's "
            f"({group['grafting'] or 'none'}) alone. Set {key} (optim_args \"{key}=N\") "
            f"to {max_steps} or less to precondition in this run.")


def add_optimizer_metrics(args: Any, optimizer: Any, logs: dict[str, Any]) -> None:
    """Add ``optimizer.metrics()`` (``optimizer/...``, docs/metrics.md) to a training log
    entry, before the Trainer appends it to ``log_history`` and hands it to the reporters
    (``report_to``: TensorBoard, W&B, ...). Only entries with a training ``loss`` (those of
    ``logging_steps``, which every rank logs: ``metrics()`` is a collective), not
    evaluations or the final summary; nothing with ``optim_args`` ``log_metrics=false``,
    for another optimizer, or where the entry has the metrics already."""
    if "loss" not in logs or any(str(key).startswith("optimizer/") for key in logs):
        return
    shampoo = find_shampoo(optimizer) if optimizer is not None else None
    if shampoo is None or not logs_metrics(args):
        return
    logs.update(shampoo.metrics())


_classes: dict[str, type] = {}


def classes() -> dict[str, type]:
    """Define the classes that subclass transformers' (imported on first use)."""
    if _classes:
        return _classes
    transformers = require("transformers", "ShampooTrainer / ShampooCheckpointCallback")
    Trainer, TrainerCallback = transformers.Trainer, transformers.TrainerCallback

    if _classes:  # importing the Trainer ran the import hook, which defined them
        return _classes

    class ShampooCheckpointCallback(TrainerCallback):
        """Consolidates ``DistributedShampoo``'s sharded state on rank 0 before a save.

        The Trainer writes ``optimizer.pt`` from rank 0 only; this callback runs on every
        rank at ``on_step_end`` / ``on_epoch_end``, after ``DefaultFlowCallback`` has set
        ``control.should_save`` (and before the save itself), and calls the collective
        ``consolidate_state_dict()`` onto every rank that writes the checkpoint (rank 0, or
        each node's first rank with ``save_on_each_node``). With ``save_strategy="best"``
        it consolidates at every
        evaluation, since whether to save is decided after it. It also validates
        ``optim_args`` when the Trainer is built, and with ``iterate_averaging`` leaves the
        averaged weights in the model when training ends
        (``averaged_weights_after_training``). Other optimizers are left alone.
        """

        def on_init_end(self, args, state, control, model=None, **kwargs):
            if uses_shampoo(args):
                validate_args(args, model)

        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            note = first_refresh_note(optimizer, state.max_steps)
            if note and state.is_world_process_zero:
                logger.warning(note)

        def _consolidate_if_saving(self, args, control, optimizer):
            if optimizer is not None and _will_save_optimizer(args, control):
                consolidate(optimizer, to=save_ranks(args))

        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            self._consolidate_if_saving(args, control, optimizer)

        def on_epoch_end(self, args, state, control, optimizer=None, **kwargs):
            self._consolidate_if_saving(args, control, optimizer)

        def on_train_end(self, args, state, control, optimizer=None, **kwargs):
            averaged_weights_after_training(optimizer, args, state)

    class ShampooTrainer(Trainer):
        """A ``Trainer`` that always trains with ``DistributedShampoo``.

        Uses only public Trainer API (``create_optimizer``, ``log``: training log entries
        carry ``optimizer.metrics()``, ``get_decay_parameter_names``, ``pop_callback`` /
        ``add_callback``: the checkpoint callback goes last).
        ``args.optim_args`` is read as Shampoo keywords whatever
        ``args.optim`` says; ``shampoo_kwargs`` (docs/design.md §7 keywords), ``module_overrides``
        ({pattern: keywords}) and ``preset`` ("transformer", "cnn", "muon", "none") win over it.
        """

        def __init__(
            self,
            *args,
            shampoo_kwargs: Mapping[str, Any] | None = None,
            module_overrides: Mapping[str, Mapping[str, Any]] | None = None,
            preset: str | None = None,
            **kwargs,
        ):
            self.shampoo_kwargs = dict(shampoo_kwargs or {})
            self.module_overrides = dict(module_overrides or {})
            self.shampoo_preset = preset
            if preset is not None:
                check_preset(preset)
            super().__init__(*args, **kwargs)
            validate_args(self.args, self.model, self.module_overrides, preset)  # fail early
            resolve_kwargs(self.args, parse_optim_args(self.args.optim_args).kwargs,
                           self.shampoo_kwargs, preset=chosen_preset(self.args, None, preset))
            # last, so that it sees should_save as every other callback left it
            callback = self.pop_callback(ShampooCheckpointCallback) or ShampooCheckpointCallback
            self.add_callback(callback)

        def create_optimizer(self, model=None):
            opt_model = self.model if model is None else model
            if self.optimizer is None:
                self.optimizer = create_optimizer(
                    opt_model,
                    self.args,
                    decay_parameter_names=self.get_decay_parameter_names(opt_model),
                    shampoo_kwargs=self.shampoo_kwargs,
                    overrides=self.module_overrides,
                    preset=self.shampoo_preset,
                )
            return self.optimizer

        def log(self, logs, *args, **kwargs):
            add_optimizer_metrics(self.args, self.optimizer, logs)
            return super().log(logs, *args, **kwargs)

    _classes.update(
        ShampooCheckpointCallback=ShampooCheckpointCallback, ShampooTrainer=ShampooTrainer
    )
    return _classes
