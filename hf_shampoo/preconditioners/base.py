"""The interface every preconditioner kind implements, and the Kronecker-factor statistics
that the factored kinds share (docs/design.md §2 line 2).

A kind is a stateless object; its methods take the ``BlockStack`` (state, members,
failure counts) and the step's ``StackStep`` (rows, gradient, refresh rows). The stack
calls, in this order: ``update_statistics`` (factor matrices), ``refresh`` for the rows
whose amortized computation is due, ``after_refresh`` (statistics kept in the refreshed
basis), then ``precondition`` of the filtered gradient. Grafting, weight decay and momentum
are the shared ``stages``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..config import dim_exponents
from ..kronecker import update_factor
from ..stages import Scratch


class Preconditioner:
    """One kind of preconditioner (the ``preconditioner`` keyword's value)."""

    name: str = ""
    # whether the direction is rescaled to the grafting method's norm (docs/design.md §2 line 5);
    # False for a kind whose direction is the grafting direction itself
    grafted: bool = True
    # whether parameters are blocked as matrices (dim 0, the rest) instead of by merging
    matrix_blocks: bool = False
    # whether the kind has an amortized computation (refresh steps, a staggered schedule)
    refreshes: bool = True

    def preconditioned_dims(self, group: dict, order: int) -> list[int]:
        """Dims with a Kronecker factor."""
        return [j for j, e in enumerate(dim_exponents(group, order)) if e != 0]

    def step_flops(self, shape: tuple[int, ...], group: dict) -> float:
        """What one block of this shape costs its owner per step, in floating-point
        operations (the ``"compute"`` assignment cost): a factor update and a
        preconditioning product per factored dim, each ``2 d · numel``, and an amortized
        refresh of about ``10 d³`` per ``precondition_frequency`` steps; elementwise
        passes (about ``10 · numel``) for every kind."""
        numel = math.prod(shape)
        flops = 10.0 * numel
        frequency = max(int(group.get("precondition_frequency", 1) or 1), 1)
        for j in self.preconditioned_dims(group, len(shape)):
            d = shape[j]
            flops += 4.0 * d * numel + 10.0 * d**3 / frequency
        return flops

    def keeps_basis(self, group: dict) -> bool:
        """Whether eigenvectors are state."""
        return False

    def state_shapes(self, stack, group: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name → (per-block shape, dtype) of the kind's state (names: ``stack.py``)."""
        return {}

    def initial_state(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, n: int,
                      device: torch.device) -> Tensor:
        """The value of a new state tensor for ``n`` blocks: identity roots and bases,
        zeros elsewhere."""
        if name.startswith(("inverse_root_", "eigenvectors_")) and len(shape) == 2:
            return torch.eye(shape[0], dtype=dtype, device=device).repeat(n, 1, 1)
        if name.startswith("inverse_root_") and len(shape) == 1:  # a diagonal root
            return torch.ones((n, *shape), dtype=dtype, device=device)
        return torch.zeros((n, *shape), dtype=dtype, device=device)

    def factor_dims(self, stack, group: dict) -> list[int]:
        """Dims whose factor matrix is state, updated every step (docs/design.md §2 line 2)."""
        return self.preconditioned_dims(group, stack.order)

    def statistics_input(self, state: dict, group: dict, g: Tensor, dim: int, order: int,
                         rows: list[int] | None = None) -> Tensor:
        """What factor ``dim``'s statistics are built from (``rows``: of the state)."""
        return g

    def checked_factors(self, stack, job) -> dict[str, Tensor]:
        """This step's factor matrices of the refreshing rows, out of place (to check them
        for non-finite values before anything changes)."""
        return {}

    def update_statistics(self, stack, job, g: Tensor, scratch: Scratch) -> None:
        """Line 2: the factor statistics of every row of the job (``g``: factor dtype)."""

    def refresh(self, stack, job, rows: list[int], first: bool, workspace) -> None:
        """Line 2's amortized computation for ``rows`` (``first``: their first one)."""

    def after_refresh(self, stack, job, g: Tensor, scratch: Scratch) -> None:
        """Statistics that live in the (possibly refreshed) basis."""

    def precondition(self, stack, job, filtered: Tensor, out: Tensor, scratch: Scratch) -> Tensor:
        """Line 5 before grafting: ``P`` of the filtered gradient, into ``out`` if it can."""
        raise NotImplementedError


class KroneckerFactored(Preconditioner):
    """Kinds with a factor matrix ``F_j = β2 F_j + (1-β2) X_(j) X_(j)ᵀ`` per dim
    (docs/design.md §2)."""

    def state_shapes(self, stack, group: dict) -> dict:
        shapes = {}
        for j in self.factor_dims(stack, group):
            d = stack.shape[j]
            shapes[f"factor_matrix_{j}"] = ((d, d), group["factor_matrix_dtype"])
        return shapes

    def checked_factors(self, stack, job) -> dict[str, Tensor]:
        """When every row refreshes, ``update_statistics`` adopts these (``job.new_factors``)
        instead of updating again; otherwise they only serve the check, and the factors of
        all rows are updated in place (a row's product does not depend on its batch)."""
        group, rows = job.group, job.refresh_rows
        everything = len(rows) == job.grad.shape[0]
        g = job.grad.to(group["factor_matrix_dtype"])
        if not everything:
            g = g[rows]
        factors = {}
        for j in self.factor_dims(stack, group):
            factor = job.state[f"factor_matrix_{j}"]
            factor = factor if everything else factor[rows]
            source = self.statistics_input(job.state, group, g, j, stack.order,
                                           None if everything else rows)
            factors[f"factor_matrix_{j}"] = update_factor(
                factor, source, j, group["betas"][1], out_of_place=True)
        return factors

    def update_statistics(self, stack, job, g: Tensor, scratch: Scratch) -> None:
        state, group = job.state, job.group
        if job.new_factors is not None:
            state.update(job.new_factors)
            return
        unfold_into = scratch("scratch") if g is job.grad else None
        dims = self.factor_dims(stack, group)
        # every dim's input from the state before this step (KL: the current roots)
        inputs = {j: self.statistics_input(state, group, g, j, stack.order) for j in dims}
        for j in dims:
            update_factor(state[f"factor_matrix_{j}"], inputs[j], j, group["betas"][1],
                          scratch=unfold_into)
