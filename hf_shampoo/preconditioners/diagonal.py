"""Diagonal: no Kronecker factors; the grafting method's direction is the update (for
biases and norms, or whole groups; with ``grafting=None`` or ``"sgd"`` it is the filtered
gradient itself)."""

from __future__ import annotations

from torch import Tensor

from .. import update_rules
from .base import Preconditioner


class Diagonal(Preconditioner):
    name = "diagonal"
    grafted = False  # the direction already is the grafting direction
    needs_grafting = True

    def preconditioned_dims(self, group: dict, order: int) -> list[int]:
        return []

    def precondition(self, stack, job, filtered: Tensor, out: Tensor, scratch) -> Tensor:
        return update_rules.graft(job.state, job.group, job.step, filtered, scratch("graft"))
