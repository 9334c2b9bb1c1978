"""Sign descent (Meta's ``SignDescentPreconditionerConfig``; docs/muon.md).

The search direction of a block is ``s · sign(Ĝ)``: ``s = 1`` by default (Meta's scale) or,
with ``sign_scale="l1"``, the block's ``‖Ĝ‖₁``, which makes it steepest descent under the
L∞ norm. Elementwise, so parameters are blocked as for every kind. No state of its own.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..keywords import Keyword, choice
from .base import Preconditioner

# sign descent's scale: None = 1 (Meta's default); "l1" = the block's ‖Ĝ‖₁
SIGN_KEYWORDS = (
    Keyword("sign_scale", None, str, choice(None, "l1"), doc=(
            "sign descent: `None` (scale 1) or `\"l1\"` (the block's `‖Ĝ‖₁`: steepest descent"
            " under the L∞ norm)")),
)


class SignDescent(Preconditioner):
    name = "sign_descent"
    refreshes = False
    keywords = SIGN_KEYWORDS

    def preconditioned_dims(self, group: dict, order: int) -> list[int]:
        return []

    def precondition(self, stack, job, filtered: Tensor, out: Tensor, scratch) -> Tensor:
        torch.sign(filtered, out=out)
        if job.group["sign_scale"] == "l1":
            dims = tuple(range(1, filtered.dim()))
            out.mul_(torch.linalg.vector_norm(filtered, ord=1, dim=dims, keepdim=True))
        return out
