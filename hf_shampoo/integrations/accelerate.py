"""Accelerate adapter: checkpoints of a sharded ``DistributedShampoo`` under ``Accelerator``.

Under data parallelism every rank holds the state of its own blocks only, and
``accelerator.save_state`` writes the optimizer from the main process. It calls
``optimizer.state_dict()`` on every rank first, and the optimizer recognises that call
(``ranks_accelerate_saves_on``, in ``checkpoint/consolidate.py`` and importable from
here): there it gathers every rank's blocks onto the ranks that
write, so a plain ``accelerator.save_state()`` writes a complete ``optimizer.bin``.
``save_state(accelerator, output_dir)`` does the same and then marks the directory complete
(``checkpoint.integrity.COMPLETE_MARK``) once every rank has written its part;
``load_state(accelerator, input_dir)`` refuses a directory without that mark, or whose files
changed since, with a ``CheckpointError``; ``latest_checkpoint(parent)`` finds the newest
complete one. ``accelerator.load_state`` needs nothing: every rank loads the full file
(``weights_only=True``) and keeps the blocks it owns, at any world size.

Everything else works as is: rank and world size come from Accelerate's process state,
``accelerator.accumulate`` steps the optimizer once per accumulated batch, and a step the
fp16 ``GradScaler`` skips never reaches the optimizer. Accelerate is imported only by the
helpers that take an ``Accelerator`` (``save_state``, ``load_state``,
``register_checkpoint_hook``): without it they raise ``ImportError`` naming the extra
(``pip install 'hf_shampoo[accelerate]'``); ``find_shampoo``, ``consolidate`` and
``latest_checkpoint`` need only torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..checkpoint.consolidate import ranks_accelerate_saves_on  # noqa: F401 (public here)
from ..checkpoint.integrity import check_marked, mark_complete, newest_complete
from ..optimizer import DistributedShampoo
from ..optional import require

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


def _require_accelerate(helper: str) -> None:
    require("accelerate", f"hf_shampoo.integrations.accelerate.{helper}")


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
    """``accelerator.save_state(output_dir, **kwargs)`` with every Shampoo's state complete,
    then the directory marked complete once every rank has written (``COMPLETE_MARK``, written
    by the main process; by each node's main process with ``save_on_each_node``).

    Call it on every rank (as ``accelerator.save_state`` itself). ``optimizers`` defaults to
    those ``accelerator.prepare`` returned. Returns the directory written.
    """
    _require_accelerate("save_state")
    found = _accelerator_optimizers(accelerator) if optimizers is None else list(optimizers)
    each_node = _saves_on_each_node(accelerator)
    consolidate(found, to=None if each_node else 0)
    written = accelerator.save_state(output_dir, **kwargs)
    accelerator.wait_for_everyone()
    if accelerator.is_local_main_process if each_node else accelerator.is_main_process:
        mark_complete(written)
    accelerator.wait_for_everyone()
    return written


def _saves_on_each_node(accelerator: Any) -> bool:
    return bool(getattr(getattr(accelerator, "project_configuration", None),
                        "save_on_each_node", False))


def latest_checkpoint(parent: str | Path) -> Path | None:
    """The newest complete checkpoint directory under ``parent`` (``checkpoint_N`` as
    Accelerate's automatic naming writes, or ``checkpoint-N``), passing over, with a
    warning each, newer ones whose save was cut short; None when there is none."""
    import warnings

    found, skipped = newest_complete(parent)
    for path, why in skipped:
        warnings.warn(f"hf_shampoo: passing over {path}: {why}", stacklevel=2)
    return found


def load_state(accelerator: Any, input_dir: str | Path, **kwargs: Any) -> None:
    """``accelerator.load_state(input_dir, **kwargs)`` once ``input_dir`` is known complete:
    a directory that ``save_state`` did not finish marking, or whose files changed since,
    raises ``CheckpointError`` (which file, what to do) before anything is loaded. Call it
    on every rank."""
    _require_accelerate("load_state")
    check_marked(input_dir)
    accelerator.load_state(str(input_dir), **kwargs)


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
    undoes it. (A plain ``accelerator.save_state()`` now writes a complete optimizer state
    by itself; this remains for code written against earlier versions.)
    """
    _require_accelerate("register_checkpoint_hook")
    if not optimizers:
        raise ValueError("register_checkpoint_hook: pass the optimizer(s) to consolidate")
    original = accelerator.save_state

    def save_state_consolidated(*args: Any, **kwargs: Any) -> str:
        consolidate(list(optimizers), to=0)
        return original(*args, **kwargs)

    accelerator.save_state = save_state_consolidated
    return _SaveStateHandle(accelerator, original)
