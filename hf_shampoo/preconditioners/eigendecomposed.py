"""Eigendecomposed Shampoo and KL-Shampoo (Meta's ``EigendecomposedShampooPreconditionerConfig``
and ``EigendecomposedKLShampooPreconditionerConfig``; docs/design.md §2–§3).

The preconditioner is Shampoo's, ``P = Ĝ ×_1 I_1 ... ×_k I_k``, but a refresh keeps each
factor's eigendecomposition ``A_j + εI = Q_j diag(λ_j) Q_jᵀ`` and the roots are taken from
it, ``I_j = Q_j diag(λ_j')^(-e_j) Q_jᵀ`` (``λ'``: the perturbation's shift or the
pseudo-inverse's cutoff, as for Shampoo). Because the eigenvectors are kept, the
decomposition can be Meta's: ``eigh`` (ascending), with ``eigenbasis_tolerance > 0`` the
kept basis re-used while ``Q_jᵀ(A_j + εI)Q_j`` stays nearly diagonal (its diagonal is then
``λ_j``), or ``eigendecomposition="qr"``: Meta's QR algorithm from the kept basis, the
same one as the eigenvalue-corrected kind's. Meta recomputes the roots from ``(Q, λ)`` on
every step; they change only at refreshes, so here they are computed there and kept
(``inverse_root_{j}``, one more ``d × d`` per factor, no per-step ``d³``). State:
``factor_matrix_{j}``, ``eigenvectors_{j}`` (identity at first), ``eigenvalues_{j}``
(ones at first, as Meta), ``inverse_root_{j}``. The KL kind builds its statistics as
``kl_shampoo`` does, from the current roots.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import eigenbasis, linalg
from . import refresh as common
from .kl_shampoo import NOT_QUANTIZABLE, KLShampoo
from .shampoo import Shampoo


class EigendecomposedShampoo(Shampoo):
    name = "eigendecomposed_shampoo"
    coupled_roots = root_dtype = diagonal_factors = False

    def keeps_basis(self, group: dict) -> bool:
        return True

    def state_shapes(self, stack, group: dict) -> dict:
        shapes = super().state_shapes(stack, group)
        for j in self.factor_dims(stack, group):
            shapes[f"eigenvalues_{j}"] = ((stack.shape[j],), group["factor_matrix_dtype"])
        return shapes

    def initial_state(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, n: int,
                      device: torch.device) -> Tensor:
        if name.startswith("eigenvalues_"):
            return torch.ones((n, *shape), dtype=dtype, device=device)
        return super().initial_state(name, shape, dtype, n, device)

    def refresh(self, stack, job, rows: list[int], first: bool, workspace) -> None:
        """New ``(Q_j, λ_j)`` and roots for ``rows``; a failed matrix keeps all three."""
        group, state = job.group, job.state
        picked = common.Rows(rows, job.grad.shape[0], job.grad.device)
        for plan in common.plan_dims(job, self.factor_dims(stack, group), picked, workspace):
            j, matrix = plan.dim, plan.matrix
            eye = torch.eye(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device)
            ridge = matrix + group["epsilon"] * eye
            kept = picked.take(state[f"eigenvectors_{j}"])
            members = [job.members[r] for r in picked.list]
            if group["eigendecomposition"] == "qr":
                stale: list = []
                basis, values = eigenbasis.qr_algorithm_direct(
                    ridge, kept, group["qr_max_iterations"], group["eigenbasis_tolerance"],
                    group["orthogonalization"], first_stale=stale)
                ok = (linalg.finite_rows(basis) & linalg.finite_rows(values)).cpu()
                stale = stale[0] if stale else None
            else:
                basis, values, ok, held = self._eigh_or_kept(ridge, kept, group)
                stale = ~held
            if stale is not None and group["eigenbasis_tolerance"] > 0:
                stack.health.record_recomputed(f"factor_matrix_{j}", len(stack.members),
                                               members, stale)
            done = ok.nonzero().flatten().to(matrix.device)
            if len(done) < len(ok):
                basis, values = basis[done], values[done]
            picked.put(state[f"eigenvectors_{j}"], done, basis)
            picked.put(state[f"eigenvalues_{j}"], done, values)
            if len(done):
                lam, cutoff = linalg.stabilized_eigenvalues(values, group)
                exponent = self.exponents(group, stack.order)[j]
                root = state[f"inverse_root_{j}"]
                picked.put(root, done, linalg.inverse_root_from_eigen(
                    lam, basis.contiguous(), exponent, cutoff=cutoff).to(root.dtype))
            stack.count_failures(f"factor_matrix_{j}", ok, members, job.step,
                                 eigenvalues=values, group=group)

    @staticmethod
    def _eigh_or_kept(ridge: Tensor, kept: Tensor, group: dict
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Meta's ``eigh`` refresh: with a tolerance, the kept basis and ``diag(QᵀAQ)``
        where the criterion holds; ``eigh`` (ascending) elsewhere. Returns the bases, the
        eigenvalues, ``ok`` and which rows kept their basis (the criterion held), both
        masks on the CPU."""
        n = ridge.shape[0]
        basis = kept.clone(memory_format=torch.contiguous_format)
        values = ridge.new_zeros(n, ridge.shape[-1])
        todo = torch.arange(n, device=ridge.device)
        if group["eigenbasis_tolerance"] > 0:
            check = eigenbasis.check_basis(ridge, kept, group["eigenbasis_tolerance"])
            values.copy_(check.diagonal)
            todo = check.stale.nonzero().flatten()
        ok = torch.ones(n, dtype=torch.bool, device="cpu")
        held = torch.ones(n, dtype=torch.bool, device="cpu")
        held[todo.cpu()] = False
        if len(todo):
            eig = linalg.batched_eigh(ridge if len(todo) == n else ridge[todo])
            good = torch.tensor(eig.ok, dtype=torch.bool, device="cpu")
            ok[todo.cpu()] = good
            rows = todo[good.to(todo.device)]
            basis[rows] = eig.eigenvectors[good.to(todo.device)]
            values[rows] = eig.eigenvalues[good.to(todo.device)]
        return basis, values, ok, held


class EigendecomposedKLShampoo(EigendecomposedShampoo):
    name = "eigendecomposed_kl_shampoo"
    not_quantizable_because = NOT_QUANTIZABLE
    statistics_input = KLShampoo.statistics_input
