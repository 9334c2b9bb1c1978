"""KL-Shampoo (arXiv 2509.03378; Meta's ``RootInvKLShampooPreconditionerConfig``).

Shampoo's inverse roots and refreshes, with other statistics: factor ``j`` is built from
the gradient multiplied along every other preconditioned dim by that dim's current inverse
root (the identity before the first refresh; docs/design.md §3), so each factor sees the gradient
whitened by the others.
"""

from __future__ import annotations

from torch import Tensor

from ..kronecker import multi_mode_product
from .shampoo import Shampoo

NOT_QUANTIZABLE = ("4-bit factors are rebuilt from sampled raw gradients, KL-Shampoo's take "
                   "every step's gradient preconditioned by the current roots")


class KLShampoo(Shampoo):
    name = "kl_shampoo"
    root_dtype = diagonal_factors = False
    not_quantizable_because = NOT_QUANTIZABLE

    def statistics_input(self, state: dict, group: dict, g: Tensor, dim: int, order: int,
                         rows: list[int] | None = None) -> Tensor:
        if order == 1:
            return g
        roots = [None if i == dim else state.get(f"inverse_root_{i}") for i in range(order)]
        if rows is not None:
            roots = [None if r is None else r[rows] for r in roots]
        if all(r is None for r in roots):
            return g
        return multi_mode_product(g, roots)
