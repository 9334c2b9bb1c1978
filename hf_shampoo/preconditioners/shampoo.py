"""Shampoo: the preconditioner is a product of per-dim inverse roots (docs/design.md §2–§3).

``P = G ×_1 I_1 ... ×_k I_k`` with ``I_j = (F_j / bc2 + εI)^(-e_j)``, recomputed at
refresh steps from an eigendecomposition: ``eigh``, or warm-started QR from the kept basis
(``eigendecomposition="qr"``), and with ``eigenbasis_tolerance > 0`` only where the kept
basis fails the docs/design.md §3 criterion. State: ``factor_matrix_{j}``, ``inverse_root_{j}``,
and ``eigenvectors_{j}`` (sorted by descending eigenvalue) when QR or the criterion needs
them. The roots are computed in ``factor_matrix_dtype`` and stored in
``inv_factor_matrix_dtype`` (Meta's option of that name); ``P`` is computed in the roots'
dtype and returned in the gradient's, as Meta does.
"""

from __future__ import annotations

from torch import Tensor

from .. import linalg, root_solvers
from ..kronecker import multi_mode_product
from ..update_rules import Scratch
from . import refresh as common
from .base import KroneckerFactored


def is_elongated(shape: tuple[int, ...], group) -> bool:
    """A matrix whose long side is at least ``diagonal_aspect`` times the short one: it is
    blocked as a matrix (never merged into one dim), so that its long side can be diagonal."""
    aspect = group.get("diagonal_aspect")
    if aspect is None or len(shape) != 2 or min(shape) == 0:
        return False
    return max(shape) >= aspect * min(shape)


def diagonal_dims(shape: tuple[int, ...], group) -> list[int]:
    """The dim of a matrix block whose factor is kept diagonal (``diagonal_aspect``): the
    long side, where it is at least ``diagonal_aspect`` times the short one (a LoRA
    adapter's ``d × r``); none for other blocks or without ``diagonal_aspect``."""
    aspect = group.get("diagonal_aspect")
    if aspect is None or len(shape) != 2:
        return []
    long = 0 if shape[0] >= shape[1] else 1
    return [long] if shape[long] >= aspect * shape[1 - long] else []


class Shampoo(KroneckerFactored):
    name = "shampoo"
    inverse_roots = coupled_roots = root_dtype = diagonal_factors = True

    def keeps_basis(self, group: dict) -> bool:
        return group["eigendecomposition"] == "qr" or group["eigenbasis_tolerance"] > 0

    def state_shapes(self, stack, group: dict) -> dict:
        shapes = super().state_shapes(stack, group)
        diagonal = self.diagonal_dims(stack, group)
        for j in self.factor_dims(stack, group):
            d = stack.shape[j]
            if j in diagonal:  # kept as its diagonal: (d,) factor and root
                shapes[f"factor_matrix_{j}"] = ((d,), group["factor_matrix_dtype"])
                shapes[f"inverse_root_{j}"] = ((d,), root_dtype(group))
                continue
            shapes[f"inverse_root_{j}"] = ((d, d), root_dtype(group))
            if self.keeps_basis(group):
                shapes[f"eigenvectors_{j}"] = ((d, d), group["factor_matrix_dtype"])
        return shapes

    def diagonal_dims(self, stack, group: dict) -> list[int]:
        """Preconditioned dims kept diagonal (``diagonal_aspect``: a matrix's long side)."""
        return [j for j in diagonal_dims(stack.shape, group)
                if j in self.factor_dims(stack, group)]

    def refresh(self, stack, job, rows: list[int], first: bool, workspace) -> None:
        """New roots for ``rows``: from ``eigh`` (the first refresh always), or QR from the
        kept basis; with a tolerance, matrices whose basis passes keep it and take
        ``diag(QᵀAQ) + ε`` as eigenvalues. A failed matrix keeps its previous root."""
        group = job.group
        keeps = self.keeps_basis(group)
        use_qr = group["eigendecomposition"] == "qr" and not first
        picked = common.Rows(rows, job.grad.shape[0], job.grad.device)
        diagonal = self.diagonal_dims(stack, group)
        full = [j for j in self.factor_dims(stack, group) if j not in diagonal]
        for plan in common.plan_dims(job, diagonal, picked, workspace):
            # a diagonal matrix: the entries of A + εI are its eigenvalues, no decomposition
            ridge = plan.matrix + group["epsilon"]
            lam, cutoff = linalg.stabilized_eigenvalues(ridge, group)
            stack.health.record_condition(f"factor_matrix_{plan.dim}", len(stack.members),
                                          [job.members[r] for r in picked.list], ridge, group)
            exponent = self.exponents(group, stack.order)[plan.dim]
            root = job.state[f"inverse_root_{plan.dim}"]
            inverse = linalg.inverse_power(lam, exponent, cutoff)
            picked.put(root, plan.todo, inverse.to(root.dtype))
        plans = common.plan_dims(job, full, picked, workspace)
        if group["root_inverse"] != "eigh":  # coupled iterations: roots without eigenvectors
            for plan in plans:
                self._coupled_roots(stack, job, plan, picked)
            return
        for plan, new in common.new_bases(stack, job, plans, picked, workspace, use_qr,
                                          descending=True, check=keeps and not first):
            if keeps:
                picked.put(job.state[f"eigenvectors_{plan.dim}"], new.done, new.basis)
            self._roots(stack, job, plan, picked, new, workspace)

    def _coupled_roots(self, stack, job, plan, picked) -> None:
        """``I_j`` of every refreshing row by Meta's coupled Newton or higher-order
        iteration (root_solvers.py); a failed matrix keeps its previous root."""
        group = job.group
        exponent = self.exponents(group, stack.order)[plan.dim]
        p = round(1 / exponent)
        iterations, tolerance = group["root_max_iterations"], group["root_tolerance"]
        if group["root_inverse"] == "coupled_newton":
            x, ok = root_solvers.coupled_newton(
                plan.matrix, p, group["epsilon"], iterations,
                root_solvers.NEWTON_TOLERANCE if tolerance is None else tolerance)
        else:
            absolute = group["root_abs_epsilon"]
            x, ok = root_solvers.coupled_higher_order(
                plan.matrix, p, group["root_rel_epsilon"],
                group["epsilon"] if absolute is None else absolute, iterations,
                root_solvers.HIGHER_ORDER_TOLERANCE if tolerance is None else tolerance,
                group["root_order"])
        local = ok.nonzero().flatten()
        root = job.state[f"inverse_root_{plan.dim}"]
        picked.put(root, local, (x if len(local) == len(x) else x[local]).to(root.dtype))
        stack.count_failures(f"factor_matrix_{plan.dim}", ok.cpu(),
                             [job.members[r] for r in picked.list], job.step,
                             what=f"inverse root ({group['root_inverse']})")

    def _roots(self, stack, job, plan, picked, new: common.NewBases, workspace) -> None:
        """``I_j`` of every row that did not fail, from its kept or new basis."""
        group, state = job.group, job.state
        device, n = plan.matrix.device, plan.matrix.shape[0]
        if self.keeps_basis(group):
            local = new.ok.nonzero().flatten().to(device)
            vectors = picked.take(state[f"eigenvectors_{plan.dim}"], local)
        else:
            local, vectors = new.done, new.basis
        if len(local) == 0:
            return
        lam, cutoff = linalg.stabilized_eigenvalues(
            new.values if len(local) == n else new.values[local], group)
        exponent = self.exponents(group, stack.order)[plan.dim]
        root = state[f"inverse_root_{plan.dim}"]
        scaled = workspace.get("refresh_scaled", vectors.shape, vectors.dtype, device)
        if not vectors.is_contiguous():  # column-major from eigh: keep its layout
            scaled = scaled.mT
        if root.dtype == vectors.dtype and picked.covers(local, root):
            linalg.inverse_root_from_eigen(lam, vectors, exponent, root, scaled, cutoff)
        else:  # computed in the factors' dtype, stored in the roots' (a no-op cast if same)
            picked.put(root, local, linalg.inverse_root_from_eigen(
                lam, vectors, exponent, scratch=scaled, cutoff=cutoff).to(root.dtype))

    def roots(self, stack, job, scratch: Scratch) -> list[Tensor | None]:
        """``I_j`` per dim (None: the identity)."""
        return [job.state.get(f"inverse_root_{j}") for j in range(stack.order)]

    def precondition(self, stack, job, filtered: Tensor, out: Tensor, scratch: Scratch) -> Tensor:
        """``P = Ĝ ×_1 I_1 ... ×_k I_k`` (identity where a dim has no root), computed in
        the roots' dtype."""
        roots = self.roots(stack, job, scratch)
        dtype = root_dtype(job.group)
        diagonal = {j: r for j, r in enumerate(roots) if r is not None and r.dim() == 2}
        if diagonal:  # scale along those dims first (the products commute), then the rest
            scaled = filtered.to(dtype)
            for j, root in diagonal.items():
                view = [root.shape[0]] + [1] * stack.order
                view[j + 1] = root.shape[1]
                scaled = scaled * root.view(view)
            roots = [None if j in diagonal else r for j, r in enumerate(roots)]
            return out.copy_(multi_mode_product(scaled, roots))
        if filtered.dtype == dtype:
            return multi_mode_product(filtered, roots, out=out, scratch=scratch("scratch"))
        return out.copy_(multi_mode_product(filtered.to(dtype), roots))


def root_dtype(group: dict):
    """The inverse roots' dtype: ``inv_factor_matrix_dtype``, else ``factor_matrix_dtype``."""
    return group["inv_factor_matrix_dtype"] or group["factor_matrix_dtype"]
