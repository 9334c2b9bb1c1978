"""What every Kronecker-factored kind's amortized refresh shares (docs/design.md §2 line 2, §3).

A refresh works on some rows of a stack (the blocks whose schedule says so). Per
preconditioned dim it takes ``A = F / bc2`` of those rows (``DimRefresh``), decides with
the docs/design.md §3 criterion which matrices need a new basis, decomposes those (all
dims' ``eigh`` calls batched together, or warm-started QR), and writes the new bases back,
keeping the previous basis of a matrix whose decomposition failed. ``Rows`` does the row bookkeeping
without copies where every row refreshes. The kinds decide what a basis is used for
(inverse roots, eigenvalue correction) in their own modules.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import eigenbasis, linalg
from ..update_rules import second_moment_bias


@dataclass
class DimRefresh:
    """One dim's part of a refresh: ``A = F / bc2`` of the refreshing rows, which of them
    need a new decomposition (``todo``) and the eigenvalues known so far."""

    dim: int
    matrix: Tensor
    todo: Tensor
    values: Tensor
    check: eigenbasis.BasisCheck | None = None


class Rows:
    """Some rows of a job's state tensors (all of them without copies where possible).

    ``take`` reads them, ``put`` writes them back; ``local`` indices count within the rows.
    """

    def __init__(self, rows: list[int], total: int, device: torch.device) -> None:
        self.list = rows
        self.everything = rows == list(range(total))
        self.rows = None if self.everything else torch.tensor(rows, device=device)

    def index(self, local: Tensor) -> Tensor:
        """State row indices of ``local``."""
        return local if self.rows is None else self.rows[local]

    def take(self, tensor: Tensor, local: Tensor | None = None) -> Tensor:
        if local is None:
            return tensor if self.rows is None else tensor[self.rows]
        if self.rows is None and len(local) == tensor.shape[0]:
            return tensor  # local is every row, in order
        return tensor[self.index(local)]

    def covers(self, local: Tensor, tensor: Tensor) -> bool:
        """Whether ``local`` is every row of ``tensor``, in order."""
        return self.rows is None and len(local) == tensor.shape[0]

    def put(self, tensor: Tensor, local: Tensor, values: Tensor) -> None:
        if self.covers(local, tensor):
            tensor.copy_(values)
        elif len(local) > 0:
            tensor.index_copy_(0, self.index(local), values)


def split_first(rows: list[int], first: list[int]) -> list[tuple[list[int], bool]]:
    """Refreshing rows grouped by whether it is their first refresh."""
    later = [r for r in rows if r not in set(first)]
    return [(group, is_first) for group, is_first in ((first, True), (later, False)) if group]


def plan_dims(job, dims: list[int], picked: Rows, workspace) -> list[DimRefresh]:
    """``A = F / bc2`` of the picked rows for each dim in ``dims``, every matrix to do."""
    state, device = job.state, job.grad.device
    bias2 = second_moment_bias(job.group, job.step)
    plans = []
    for j in dims:
        matrix = picked.take(state[f"factor_matrix_{j}"])
        if bias2 != 1.0:
            matrix = torch.div(matrix, bias2, out=workspace.get(
                f"refresh_matrix_{j}", matrix.shape, matrix.dtype, device))
        n, d = matrix.shape[0], matrix.shape[-1]
        plans.append(DimRefresh(j, matrix, torch.arange(n, device=device), matrix.new_zeros(n, d)))
    return plans


def apply_criterion(job, plan: DimRefresh, picked: Rows, shift: bool) -> None:
    """docs/design.md §3: only matrices whose kept basis fails the criterion stay to do; the others'
    eigenvalues are ``diag(QᵀAQ) + ε``. ``shift``: check ``A + εI`` (Meta's
    eigenvalue-corrected mode) instead of ``A``."""
    group, epsilon = job.group, job.group["epsilon"]
    checked = plan.matrix
    if shift and group["eigenbasis_tolerance"] > 0:
        d = checked.shape[-1]
        checked = checked + epsilon * torch.eye(d, dtype=checked.dtype, device=checked.device)
    plan.check = eigenbasis.check_basis(
        checked, picked.take(job.state[f"eigenvectors_{plan.dim}"]),
        group["eigenbasis_tolerance"],
    )
    plan.todo = plan.check.stale.nonzero().flatten()
    plan.values = plan.check.diagonal + epsilon


def record_criterion(stack, job, plan: DimRefresh, picked: Rows) -> None:
    """For ``metrics()``: which of the picked rows' bases the criterion found stale (with
    ``eigenbasis_tolerance > 0``; τ = 0 recomputes every basis, no criterion)."""
    if plan.check is not None and job.group["eigenbasis_tolerance"] > 0:
        stack.health.record_recomputed(f"factor_matrix_{plan.dim}", len(stack.members),
                                       [job.members[r] for r in picked.list],
                                       plan.check.stale)


def eigh_all(job, plans: list[DimRefresh], workspace) -> dict[int, linalg.Eigh]:
    """``eigh(A + εI)`` of every matrix to do, all dims in one batched call; by dim."""
    epsilon, device = job.group["epsilon"], job.grad.device
    plans = [p for p in plans if len(p.todo) > 0]
    inputs = []
    for p in plans:
        sub = p.matrix if len(p.todo) == len(p.matrix) else p.matrix[p.todo]
        if sub.data_ptr() == job.state[f"factor_matrix_{p.dim}"].data_ptr():
            sub = sub + epsilon * torch.eye(sub.shape[-1], dtype=sub.dtype, device=device)
        else:  # our own copy: A + εI in place
            sub.diagonal(dim1=-2, dim2=-1).add_(epsilon)
        inputs.append(sub)
    # temporaries of the factors' size live in the workspace (fresh memory would cost page
    # faults every refresh)
    memory = [workspace.get(f"refresh_vectors_{p.dim}", s.shape, s.dtype, device)
              for p, s in zip(plans, inputs)]
    return dict(zip((p.dim for p in plans), linalg.batched_eigh_many(inputs, memory)))


@dataclass
class NewBases:
    """One dim's decompositions: per refreshing row whether it succeeded (``ok``, on the
    CPU), the local rows with a new basis (``done``) and the eigenvalues of every row
    (``values``: new ones where done, kept ones elsewhere); ``order``: QR's column sort."""

    ok: Tensor
    done: Tensor
    basis: Tensor | None
    values: Tensor
    order: Tensor | None = None


def decompose(
    job, plan: DimRefresh, picked: Rows, use_qr: bool, eig: linalg.Eigh | None,
    descending: bool,
) -> NewBases:
    """The new bases of the matrices ``plan`` has to do: warm-started QR (``qr_iteration``,
    bases by descending eigenvalue) or ``eig`` (ascending, flipped with ``descending``).
    Failed matrices drop out of ``done``."""
    group = job.group
    n = plan.matrix.shape[0]
    todo, values = plan.todo, plan.values
    ok = torch.ones(n, dtype=torch.bool, device="cpu")
    if len(todo) == 0:
        return NewBases(ok, todo, None, values)
    full = len(todo) == n
    order = None
    if use_qr:
        basis, estimates, order = eigenbasis.qr_iteration(
            plan.matrix if full else plan.matrix[todo],
            picked.take(job.state[f"eigenvectors_{plan.dim}"], todo),
            group["qr_max_iterations"],
            group["eigenbasis_tolerance"],
            product=plan.check.product if full else plan.check.product[todo],
            method=group["orthogonalization"],
        )
        new_values = estimates + group["epsilon"]
        sub_ok = (linalg.finite_rows(basis) & linalg.finite_rows(estimates)).cpu()
    else:
        basis, new_values = eig.eigenvectors, eig.eigenvalues
        if descending:
            basis, new_values = basis.flip(-1), new_values.flip(-1)
        sub_ok = torch.tensor(eig.ok, dtype=torch.bool, device="cpu")
    done = todo
    if not bool(sub_ok.all()):
        ok[todo.cpu()] = sub_ok
        good = sub_ok.to(todo.device)
        done, basis, new_values = todo[good], basis[good], new_values[good]
        if order is not None:
            order = order[good]
    if len(done) == n:
        values = new_values
    else:
        values[done] = new_values
    return NewBases(ok, done, basis, values, order)


def new_bases(stack, job, plans: list[DimRefresh], picked: Rows, workspace, use_qr: bool,
              descending: bool, check: bool, shift: bool = False
              ) -> Iterator[tuple[DimRefresh, NewBases]]:
    """The refresh every eigenbasis kind runs: with ``check``, the criterion on every dim
    (``apply_criterion``, ``shift`` as there) and its record for ``metrics()``; then every
    dim's new bases (``decompose``: warm-started QR with ``use_qr``, else one batched
    ``eigh_all``), yielded for the kind to store what it keeps, after which the dim's
    failures are counted (``BlockStack.count_failures``: it warns, or raises after too many
    in a row)."""
    if check:
        for plan in plans:
            apply_criterion(job, plan, picked, shift=shift)
            record_criterion(stack, job, plan, picked)
    decompositions = {} if use_qr else eigh_all(job, plans, workspace)
    for plan in plans:
        new = decompose(job, plan, picked, use_qr, decompositions.get(plan.dim),
                        descending=descending)
        yield plan, new
        stack.count_failures(f"factor_matrix_{plan.dim}", new.ok,
                             [job.members[r] for r in picked.list], job.step,
                             eigenvalues=new.values, group=job.group)
