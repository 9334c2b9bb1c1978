"""The benchmarks' one training loop and learning-rate schedule.

``train_loop`` is what ablation.py, convergence.py, quantization_accuracy.py and
step_time.py's ``--real-run`` train with (also the AdamW run that makes the LoRA task's
base model). One divergence rule for all:
each step computes the loss and its backward first; **a non-finite loss ends the run before
that step's optimizer step** (``Run.diverged``; ``losses`` holds the steps before it). A
finite loss, however large, does not end a run. Time is the process's CPU time
(``time.process_time``), cumulative after each step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Run:
    """One run's training losses and cumulative CPU seconds per step, and whether it ended
    on a non-finite loss."""
    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    diverged: bool = False

    def padded(self, steps: int) -> list[float]:
        """The losses, with ``nan`` for the steps a diverged run did not take."""
        return self.losses + [math.nan] * (steps - len(self.losses))


def warmup_cosine(steps: int, decay: bool = True) -> Callable[[int], float]:
    """A linear warm-up over the first 5 % of steps, then a cosine decay to zero (or, with
    ``decay=False``, the peak lr to the end): a ``LambdaLR`` factor."""
    warmup = max(1, steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if not decay:
            return 1.0
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    return factor


def train_loop(model: nn.Module, opt: torch.optim.Optimizer, batches: Iterable,
               loss: Callable[[nn.Module, object], torch.Tensor],
               schedule: Callable[[int], float] | None = None,
               after_step: Callable[[int], None] | None = None,
               step: Callable[[], object] | None = None) -> Run:
    """Train ``model`` with ``opt`` on ``batches``: ``loss(model, batch)``, backward, then
    (the loss finite) ``opt.step()`` (or ``step()``, e.g. a timed one), the ``LambdaLR``
    ``schedule``'s step if given and ``after_step(step)`` (steps counted from 1). See the
    module docstring for divergence."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if schedule else None
    run = Run()
    start = time.process_time()
    for index, batch in enumerate(batches, start=1):
        value = loss(model, batch)
        opt.zero_grad()
        value.backward()
        number = value.item()
        if not math.isfinite(number):
            run.diverged = True
            return run
        (step or opt.step)()
        if scheduler is not None:
            scheduler.step()
        run.losses.append(number)
        run.seconds.append(time.process_time() - start)
        if after_step is not None:
            after_step(index)
    return run
