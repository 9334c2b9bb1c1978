"""Accelerate adapter: checkpoints of a sharded ``DistributedShampoo`` under ``Accelerator``.

Under data parallelism every rank holds the state of its own blocks only, and
``accelerator.save_state`` writes the optimizer from the main process (DDP, and FSDP2 with
a full state dict). So before it saves, every rank must call ``consolidate_state_dict()``
(a collective); then the main process's ``state_dict()`` holds every block. (FSDP2 with a
sharded state dict needs nothing: every rank writes its own blocks.) Either call
``save_state(accelerator, output_dir)`` instead of ``accelerator.save_state(output_dir)``,
or register the consolidation once with ``register_checkpoint_hook(accelerator,
optimizer)``. ``accelerator.load_state`` needs nothing: every rank loads the full file
(``weights_only=True``) and keeps the blocks it owns, at any world size.

Everything else works as is: rank and world size come from Accelerate's process state,
``accelerator.accumulate`` steps the optimizer once per accumulated batch, and a step the
fp16 ``GradScaler`` skips never reaches the optimizer. Accelerate is imported only here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..optimizer import DistributedShampoo

_MAX_WRAPPERS = 8  # AcceleratedOptimizer, smp / deepspeed wrappers, user wrappers


def find_shampoo(optimizer: Any) -> DistributedShampoo | None:
    """The ``DistributedShampoo`` inside wrappers that keep it as ``.optimizer`` (Accelerate's
    ``AcceleratedOptimizer`` and the like), or None when there is none."""
    for _ in range(_MAX_WRAPPERS):
        if isinstance(optimizer, DistributedShampoo):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        if optimizer is None:
            return None
    return None


def consolidate(optimizers: Any | Iterable[Any], to: int | Iterable[int] | None = 0) -> int:
    """Call ``consolidate_state_dict(to)`` on every ``DistributedShampoo`` among
    ``optimizers`` (wrapped or not; others are skipped). A collective: every rank must call
    it, with the same optimizers. Returns how many were consolidated."""
    if not isinstance(optimizers, (list, tuple)):
        optimizers = [optimizers]
    count = 0
    for optimizer in optimizers:
        shampoo = find_shampoo(optimizer)
        if shampoo is not None:
            shampoo.consolidate_state_dict(to=to)
            count += 1
    return count


def _accelerator_optimizers(accelerator: Any) -> list[Any]:
    optimizers = getattr(accelerator, "_optimizers", None)
    if optimizers is None:
        raise TypeError(
            "hf_shampoo: cannot find the prepared optimizers of this Accelerator; pass them "
            "explicitly: save_state(accelerator, output_dir, optimizers=[optimizer])"
        )
    return list(optimizers)


def save_state(
    accelerator: Any,
    output_dir: str | None = None,
    *,
    optimizers: Iterable[Any] | None = None,
    **kwargs: Any,
) -> str:
    """``accelerator.save_state(output_dir, **kwargs)`` with every Shampoo's state complete.

    Call it on every rank (as ``accelerator.save_state`` itself). ``optimizers`` defaults to
    those ``accelerator.prepare`` returned. Returns the directory written.
    """
    found = _accelerator_optimizers(accelerator) if optimizers is None else list(optimizers)
    consolidate(found, to=0)
    return accelerator.save_state(output_dir, **kwargs)


class _SaveStateHandle:
    """Undoes ``register_checkpoint_hook`` (``remove()``), like torch's hook handles."""

    def __init__(self, accelerator: Any, original: Any) -> None:
        self._accelerator, self._original = accelerator, original

    def remove(self) -> None:
        if self._original is not None:
            self._accelerator.save_state = self._original
            self._original = None


def register_checkpoint_hook(accelerator: Any, *optimizers: Any) -> _SaveStateHandle:
    """Make every later ``accelerator.save_state(...)`` consolidate these optimizers first.

    Accelerate's own ``register_save_state_pre_hook`` runs after an FSDP optimizer has
    been written, too late for a full state dict, so this wraps the accelerator's
    ``save_state`` instead (this accelerator only). Returns a handle whose ``remove()``
    undoes it.
    """
    if not optimizers:
        raise ValueError("register_checkpoint_hook: pass the optimizer(s) to consolidate")
    original = accelerator.save_state

    def save_state_consolidated(*args: Any, **kwargs: Any) -> str:
        consolidate(list(optimizers), to=0)
        return original(*args, **kwargs)

    accelerator.save_state = save_state_consolidated
    return _SaveStateHandle(accelerator, original)
