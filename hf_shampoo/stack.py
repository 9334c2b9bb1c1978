"""State and per-step math of one stack of same-shape blocks (SPEC §2–§3).

A ``BlockStack`` holds every optimizer state tensor of ``n`` same-shape blocks of one
parameter group, stacked along a leading dim, so that factor updates, preconditioning
and eigendecompositions are single batched calls. ``direction`` runs SPEC §2 lines 1–7
for the stack and returns the search direction ``P``; the optimizer scales it by ``-lr``
and applies it. State names (also the checkpoint keys, see ``checkpoint.py``):

- ``factor_matrix_{j}``: ``F_j`` per preconditioned dim ``j``
- ``inverse_root_{j}``: ``I_j`` (shampoo)
- ``eigenvectors_{j}``: ``Q_j`` (eigenvalue-corrected; shampoo with qr or a tolerance)
- ``corrected_eigenvalues``: ``D`` (eigenvalue-corrected)
- ``grafting_state``: ``V``; ``filtered_grad``: ``M``; ``momentum``: ``B``

Intermediate results of a step live in a ``Workspace`` shared by all stacks, and the
stacked gradients in a buffer per stack, so that a steady step allocates nothing.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor

from . import linalg
from .config import ROOT_INVERSE_KINDS, corrected_exponent, dim_exponents
from .kronecker import multi_mode_product, update_factor

MAX_CONSECUTIVE_FAILURES = 3
GRAFTING_NORM_EPSILON = 1e-16


class ShampooNumericalError(RuntimeError):
    """A factor matrix became non-finite, or its eigendecomposition kept failing."""


class Workspace:
    """Scratch tensors reused by every stack and every step.

    Stacks are processed one after another, so one buffer per name, grown to the largest
    request, serves them all. A tensor from ``get`` is valid until the next ``get`` of the
    same name (with the same dtype and device).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, Tensor] = {}

    def get(self, name: str, shape, dtype: torch.dtype, device: torch.device) -> Tensor:
        numel = math.prod(shape)
        key = (name, dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer[:numel].view(shape)


@dataclass
class StackStep:
    """One step of one stack: the rows it works on (blocks with a gradient) and what each
    row does this step. Row lists index ``grad``; ``members`` maps rows to stack positions."""

    group: dict
    step: int
    members: list[int]
    state: dict[str, Tensor]  # the stack's state, or a copy of the rows of ``members``
    grad: Tensor  # stacked gradients with L2 decay added (SPEC §2 line 1), work dtype
    param: Tensor | None  # stacked parameters when decoupled weight decay needs them
    refresh_rows: list[int] = field(default_factory=list)  # amortized computation now
    first_rows: list[int] = field(default_factory=list)  # of those: the first refresh
    grafting_rows: list[int] = field(default_factory=list)  # before their start step
    new_factors: dict[str, Tensor] | None = None  # checked factors of every row, to adopt


@dataclass
class BlockRef:
    """One block: which parameter it belongs to and where it sits in it."""

    group_index: int
    param_index: int  # position in the optimizer's flat parameter order (state_dict key)
    block_index: int  # row-major index among the parameter's blocks (SPEC §1)
    param: Tensor
    name: str
    merged: tuple[int, ...]  # the parameter's merged shape (SPEC §1)
    slices: tuple[slice, ...] | None  # the block within it; None for a single-block parameter


@dataclass
class BlockStack:
    """The optimizer state of ``n`` same-shape blocks of one parameter group."""

    group_index: int
    shape: tuple[int, ...]
    members: list[BlockRef]
    work_dtype: torch.dtype
    rank: int = 0  # the rank that owns this stack's state and computes its directions
    directions: Tensor | None = None  # -lr * P per block, (n, *shape); may view a shared buffer
    state: dict[str, Tensor] = field(default_factory=dict)
    failures: dict[str, list[int]] = field(default_factory=dict)
    # per member: steps by which its refresh schedule is delayed (refresh_schedule)
    refresh_offsets: list[int] = field(default_factory=list)
    gathered_grad: Tensor | None = field(default=None, repr=False)  # reused every step
    gathered_param: Tensor | None = field(default=None, repr=False)  # FSDP owners: weights

    @property
    def order(self) -> int:
        return len(self.shape)

    @property
    def device(self) -> torch.device:
        return self.members[0].param.device

    def preconditioned_dims(self, group: dict) -> list[int]:
        return [j for j, e in enumerate(dim_exponents(group, self.order)) if e != 0]

    def keeps_basis(self, group: dict) -> bool:
        """Whether eigenvectors are state (needed by QR and by the refresh criterion)."""
        if group["preconditioner"] == "diagonal":
            return False
        return group["preconditioner"] == "eigenvalue_corrected" or (
            group["eigendecomposition"] == "qr" or group["eigenbasis_tolerance"] > 0
        )

    # ----------------------------------------------------------------- state layout
    def expected_state(self, group: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name → (per-block shape, dtype) of every state tensor this group needs."""
        fdtype = group["factor_matrix_dtype"]
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for j in self.preconditioned_dims(group):
            d = self.shape[j]
            shapes[f"factor_matrix_{j}"] = ((d, d), fdtype)
            if group["preconditioner"] in ROOT_INVERSE_KINDS:
                shapes[f"inverse_root_{j}"] = ((d, d), fdtype)
            if self.keeps_basis(group):
                shapes[f"eigenvectors_{j}"] = ((d, d), fdtype)
        if group["preconditioner"] == "eigenvalue_corrected":
            shapes["corrected_eigenvalues"] = (self.shape, self.work_dtype)
        if group["grafting"] in ("adagrad", "rmsprop", "adam"):
            shapes["grafting_state"] = (self.shape, self.work_dtype)
        if group["betas"][0] > 0:
            shapes["filtered_grad"] = (self.shape, self.work_dtype)
        if group["momentum"] > 0:
            shapes["momentum"] = (self.shape, self.work_dtype)
        return shapes

    def materialize(self, group: dict) -> None:
        """Allocate missing state (identity roots and bases, zeros elsewhere) and move the
        state to the parameters' device if they moved."""
        device, n = self.device, len(self.members)
        for name, tensor in self.state.items():
            if tensor.device != device:
                self.state[name] = tensor.to(device)
        for name, (shape, dtype) in self.expected_state(group).items():
            if name in self.state:
                continue
            if name.startswith(("inverse_root_", "eigenvectors_")):
                eye = torch.eye(shape[0], dtype=dtype, device=device)
                self.state[name] = eye.repeat(n, 1, 1)
            else:
                self.state[name] = torch.zeros((n, *shape), dtype=dtype, device=device)
            if name.startswith("factor_matrix_"):
                self.failures[name] = [0] * n

    # --------------------------------------------------------------- one step
    def checked_factors(self, job: StackStep) -> dict[str, Tensor]:
        """This step's factor matrices of the rows that refresh, computed out of place so
        that they can be checked for non-finite values before anything changes.

        When every row refreshes, ``direction`` adopts them (``job.new_factors``) instead of
        updating the factors again; otherwise they only serve the check, and ``direction``
        updates all rows in place (a row's product does not depend on its batch).
        """
        group, rows = job.group, job.refresh_rows
        everything = len(rows) == job.grad.shape[0]
        g = job.grad.to(group["factor_matrix_dtype"])
        if not everything:
            g = g[rows]
        factors = {}
        for j in self.preconditioned_dims(group):
            factor = job.state[f"factor_matrix_{j}"]
            factor = factor if everything else factor[rows]
            factors[f"factor_matrix_{j}"] = update_factor(
                factor, self._statistics_input(job.state, group, g, j,
                                               None if everything else rows),
                j, group["betas"][1], out_of_place=True
            )
        return factors

    def _statistics_input(self, state: dict, group: dict, g: Tensor, dim: int,
                          rows: list[int] | None = None) -> Tensor:
        """What factor ``dim``'s statistics are built from: the gradient, or for KL-Shampoo
        the gradient multiplied along every other preconditioned dim by that dim's current
        inverse root (the identity before the first refresh; SPEC §3)."""
        if group["preconditioner"] != "kl_shampoo" or self.order == 1:
            return g
        roots = [None if i == dim else state.get(f"inverse_root_{i}")
                 for i in range(self.order)]
        if rows is not None:
            roots = [None if r is None else r[rows] for r in roots]
        if all(r is None for r in roots):
            return g
        return multi_mode_product(g, roots)

    def direction(self, job: StackStep, workspace: Workspace, out: Tensor, lr: float) -> None:
        """SPEC §2 lines 2–8 for the rows of ``job``: writes ``-lr * P`` into ``out``.

        ``job.grad`` and ``job.param`` may be modified. Intermediate results live in
        ``workspace`` (shared by all stacks), so that a steady step allocates nothing.
        """
        group, step, state, grad = job.group, job.step, job.state, job.grad
        beta2 = group["betas"][1]
        fdtype = group["factor_matrix_dtype"]
        same_dtype = grad.dtype == fdtype

        def scratch(name: str) -> Tensor:
            return workspace.get(name, grad.shape, grad.dtype, grad.device)

        # line 2: factor statistics and, at refresh steps, the amortized computation
        g = grad if same_dtype else grad.to(fdtype)
        if job.new_factors is not None:
            state.update(job.new_factors)
        else:
            unfold_into = scratch("scratch") if same_dtype else None
            kl = group["preconditioner"] == "kl_shampoo"
            inputs = {j: self._statistics_input(state, group, g, j)
                      for j in self.preconditioned_dims(group)} if kl else {}
            for j in self.preconditioned_dims(group):  # (KL: all from the roots before now)
                update_factor(state[f"factor_matrix_{j}"], inputs.get(j, g), j, beta2,
                              scratch=unfold_into)
        for rows, first in _split_first(job.refresh_rows, job.first_rows):
            self._refresh(job, rows, first, workspace)
        corrected = group["preconditioner"] == "eigenvalue_corrected"
        bias2 = 1.0 - beta2**step if group["use_bias_correction"] and beta2 < 1 else 1.0
        if corrected:
            bases = self._bases(state, group)
            rotated = self._rotate(g, bases, True, scratch("rotated"), scratch("scratch"))
            weight = 1.0 if beta2 == 1.0 else 1.0 - beta2
            d = state["corrected_eigenvalues"]
            if beta2 != 1.0:
                d.mul_(beta2)
            d.addcmul_(rotated, rotated, value=weight)

        # line 3: grafting state from the same (post-L2) gradient
        grafting = group["grafting"]
        gb2 = group["grafting_beta2"]
        if grafting == "adagrad":
            state["grafting_state"].addcmul_(grad, grad)
        elif grafting in ("rmsprop", "adam"):
            state["grafting_state"].mul_(gb2).addcmul_(grad, grad, value=1.0 - gb2)

        # line 4: filtered gradient
        filtered = self._filtered_gradient(state, group, step, grad, scratch("filtered"))

        # line 5: search direction
        def graft(x: Tensor) -> Tensor:
            """graft(x) into the "graft" scratch (x itself for sgd / no grafting)."""
            if grafting in (None, "sgd"):
                return x
            denominator = scratch("graft")
            if grafting == "adam":
                torch.div(state["grafting_state"], 1.0 - gb2**step, out=denominator)
            else:
                denominator.copy_(state["grafting_state"])
            denominator.sqrt_().add_(group["grafting_epsilon"])
            return torch.div(x, denominator, out=denominator)

        rows = grad.shape[0]
        if group["preconditioner"] == "diagonal" or (
            grafting is not None and len(job.grafting_rows) == rows
        ):
            direction = graft(filtered)
            scale = None
        else:
            direction = scratch("direction")
            if corrected:
                self._corrected_direction(state, group, filtered, bases, bias2, direction,
                                          scratch)
            else:
                roots = [state.get(f"inverse_root_{j}") for j in range(self.order)]
                if same_dtype:
                    multi_mode_product(filtered, roots, out=direction, scratch=scratch("scratch"))
                else:
                    direction.copy_(multi_mode_product(filtered.to(fdtype), roots))
            scale = None
            if grafting is not None:
                reduce = tuple(range(1, direction.dim()))
                grafted = graft(filtered)
                graft_norm = torch.linalg.vector_norm(grafted, dim=reduce, keepdim=True)
                norm = torch.linalg.vector_norm(direction, dim=reduce, keepdim=True)
                scale = graft_norm / (norm + GRAFTING_NORM_EPSILON)
                if job.grafting_rows:  # staggered start: these rows are still grafting
                    scale[job.grafting_rows] = 1.0
                    direction[job.grafting_rows] = grafted[job.grafting_rows]

        # line 6: weight decay folded into the direction; line 7: classic momentum
        wd, wd_type = group["weight_decay"], group["weight_decay_type"]
        decays = wd > 0 and wd_type != "l2"
        mu = group["momentum"]
        if not decays and mu == 0:  # line 8 fused with the grafting scale: one pass
            if scale is None:
                torch.mul(direction, -lr, out=out)
            else:
                torch.mul(direction, scale.mul_(-lr), out=out)
            return
        if scale is not None:
            direction.mul_(scale)
        elif grafting in (None, "sgd") and direction is filtered:  # not ours to modify
            direction = scratch("direction").copy_(filtered)
        if decays:
            peak = group["peak_lr"]
            alpha = {
                "decoupled": wd,
                "corrected": wd * float(group["lr"]) / peak if peak else 0.0,
                "independent": wd / peak if peak else 0.0,
            }[wd_type]
            direction.add_(job.param.mul_(alpha))
        if mu > 0:
            dampening = group["dampening"]
            buf = state["momentum"]
            buf.mul_(mu).add_(direction, alpha=1.0 - dampening)
            if group["nesterov"]:
                direction.mul_(1.0 - dampening).add_(buf, alpha=mu)
            else:
                direction = buf
        torch.mul(direction, -lr, out=out)  # line 8: the caller adds out to the parameters

    def _filtered_gradient(
        self, state: dict, group: dict, step: int, grad: Tensor, out: Tensor
    ) -> Tensor:
        """SPEC §2 line 4: Ĝ (into ``out`` unless it is ``grad`` or ``M`` itself)."""
        beta1 = group["betas"][0]
        if beta1 == 0:
            return grad
        beta3 = group["beta3"] if group["beta3"] is not None else beta1
        m = state["filtered_grad"]
        bias = group["use_bias_correction"]
        if beta3 == beta1:
            m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
            return torch.div(m, 1.0 - beta1**step, out=out) if bias else m
        filtered = torch.mul(m, beta3, out=out).add_(grad, alpha=1.0 - beta3)
        if bias:
            filtered.div_(1.0 - beta3 * beta1 ** (step - 1))
        m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        return filtered

    def _bases(self, state: dict, group: dict) -> list[Tensor | None]:
        dims = set(self.preconditioned_dims(group))
        return [state[f"eigenvectors_{j}"] if j in dims else None for j in range(self.order)]

    @staticmethod
    def _rotate(x: Tensor, bases: list, transpose: bool, out: Tensor, scratch: Tensor) -> Tensor:
        """``x`` in (``transpose``) or out of the eigenbases, into ``out`` where dtypes allow."""
        if x.dtype == out.dtype and all(b is None or b.dtype == x.dtype for b in bases):
            return multi_mode_product(x, bases, transpose, out=out, scratch=scratch)
        fdtype = next(b.dtype for b in bases if b is not None)
        return out.copy_(multi_mode_product(x.to(fdtype), bases, transpose))

    def _corrected_direction(
        self, state: dict, group: dict, filtered: Tensor, bases: list, bias2: float,
        out: Tensor, scratch,
    ) -> None:
        rotated = self._rotate(filtered, bases, True, scratch("rotated"), scratch("scratch"))
        exponent = corrected_exponent(group, self.order)
        scaled = torch.div(state["corrected_eigenvalues"], bias2, out=scratch("graft"))
        scaled = linalg.power(scaled, exponent, in_place=True)
        rotated.div_(scaled.add_(group["epsilon"]))
        self._rotate(rotated, bases, False, out, scratch("scratch"))

    # ------------------------------------------------------- amortized computation
    def _refresh(self, job: StackStep, rows: list[int], first: bool, workspace: Workspace) -> None:
        """SPEC §2 line 2 (amortized part) and §3 for every preconditioned dim of ``rows``.

        Every path yields, per block, the eigenvalues of ``A + εI`` and a basis: from
        ``eigh``, from warm-started QR, or (a block whose kept basis passes the tolerance
        criterion) ``diag(QᵀAQ) + ε`` with the kept basis. Blocks whose decomposition
        failed keep their previous root / basis. ``first``: the rows' first refresh.
        The ``eigh`` calls of all dims run together (``linalg.batched_eigh_many``), and
        temporaries of the factors' size live in ``workspace`` (fresh memory would cost
        page faults every refresh).
        """
        group, state = job.group, job.state
        beta2 = group["betas"][1]
        bias2 = 1.0 - beta2**job.step if group["use_bias_correction"] and beta2 < 1 else 1.0
        epsilon = group["epsilon"]
        keeps = self.keeps_basis(group)
        corrected = group["preconditioner"] == "eigenvalue_corrected"
        meta = corrected and group["eigenbasis_variant"] == "meta"
        # eigenvalue-corrected with QR: Meta's qr_algorithm from the kept basis (the
        # identity before the first refresh), which checks the criterion itself (SPEC §3)
        meta_qr = meta and group["eigendecomposition"] == "qr"
        use_qr = group["eigendecomposition"] == "qr" and not first and not meta_qr
        device = job.grad.device
        picked = _Rows(rows, job.grad.shape[0], device)  # local indices count within rows

        # which matrices of each dim need a new decomposition (SPEC §3 criterion)
        plans = []
        for j in self.preconditioned_dims(group):
            factor = picked.take(state[f"factor_matrix_{j}"])
            matrix = factor
            if bias2 != 1.0:
                matrix = torch.div(factor, bias2, out=workspace.get(
                    f"refresh_matrix_{j}", factor.shape, factor.dtype, device))
            n, d = matrix.shape[0], matrix.shape[-1]
            plan = _DimRefresh(j, matrix, torch.arange(n, device=device), matrix.new_zeros(n, d))
            if keeps and (not first or meta) and not meta_qr:
                # eigenvalue-corrected: Meta checks A + εI, also against the identity basis
                # at the first refresh (τ = 0 marks every matrix stale either way)
                checked = matrix
                if meta and group["eigenbasis_tolerance"] > 0:
                    checked = matrix + epsilon * torch.eye(d, dtype=matrix.dtype, device=device)
                plan.check = linalg.check_basis(
                    checked, picked.take(state[f"eigenvectors_{j}"]),
                    group["eigenbasis_tolerance"]
                )
                plan.todo = plan.check.stale.nonzero().flatten()
                plan.values = plan.check.diagonal + epsilon
            plans.append(plan)

        # eigh of A + εI for every dim at once (not for QR refreshes)
        eigh_plans = [p for p in plans if len(p.todo) > 0 and not use_qr and not meta_qr]
        inputs = []
        for p in eigh_plans:
            sub = p.matrix if len(p.todo) == len(p.matrix) else p.matrix[p.todo]
            if sub.data_ptr() == state[f"factor_matrix_{p.dim}"].data_ptr():
                sub = sub + epsilon * torch.eye(sub.shape[-1], dtype=sub.dtype, device=device)
            else:  # our own copy: A + εI in place
                sub.diagonal(dim1=-2, dim2=-1).add_(epsilon)
            inputs.append(sub)
        memory = [workspace.get(f"refresh_vectors_{p.dim}", s.shape, s.dtype, device)
                  for p, s in zip(eigh_plans, inputs)]
        decompositions = dict(zip((p.dim for p in eigh_plans),
                                  linalg.batched_eigh_many(inputs, memory)))

        for plan in plans:
            if meta_qr:
                self._meta_qr_refresh(job, plan, picked)
                continue
            self._finish_refresh(job, plan, picked, use_qr, decompositions.get(plan.dim),
                                 workspace)

    def _meta_qr_refresh(self, job: StackStep, plan: _DimRefresh, picked: _Rows) -> None:
        """Eigenvalue-corrected QR refresh of one dim, as Meta computes it: QR iterations on
        ``A + εI`` from the kept basis, eigenvalue estimates sorted ascending with the
        basis; ``D`` keeps its order (SPEC §3)."""
        group, state, j = job.group, job.state, plan.dim
        name = f"eigenvectors_{j}"
        matrix = plan.matrix + group["epsilon"] * torch.eye(
            plan.matrix.shape[-1], dtype=plan.matrix.dtype, device=plan.matrix.device)
        basis, values = linalg.qr_algorithm(matrix, picked.take(state[name]),
                                            group["qr_max_iterations"],
                                            group["eigenbasis_tolerance"])
        ok = (linalg.finite_rows(basis) & linalg.finite_rows(values)).cpu()
        done = ok.nonzero().flatten().to(basis.device)
        picked.put(state[name], done, basis if len(done) == len(basis) else basis[done])
        self._count_failures(f"factor_matrix_{j}", ok, [job.members[r] for r in picked.list],
                             job.step)

    def _finish_refresh(
        self, job: StackStep, plan: _DimRefresh, picked: _Rows, use_qr: bool,
        eig: linalg.Eigh | None, workspace: Workspace,
    ) -> None:
        """One dim of ``_refresh``: QR or the eigh result into bases, eigenvalues, roots."""
        group, state, j = job.group, job.state, plan.dim
        epsilon = group["epsilon"]
        keeps = self.keeps_basis(group)
        shampoo = group["preconditioner"] in ROOT_INVERSE_KINDS
        device = plan.matrix.device
        n = plan.matrix.shape[0]
        todo, values = plan.todo, plan.values
        vectors_name = f"eigenvectors_{j}"
        ok = torch.ones(n, dtype=torch.bool)
        done, basis = todo, None
        if len(todo) > 0:
            full = len(todo) == n
            if use_qr:
                basis, estimates, order = linalg.qr_iteration(
                    plan.matrix if full else plan.matrix[todo],
                    picked.take(state[vectors_name], todo),
                    group["qr_max_iterations"],
                    group["eigenbasis_tolerance"],
                    product=plan.check.product if full else plan.check.product[todo],
                )
                new_values = estimates + epsilon
                sub_ok = (linalg.finite_rows(basis) & linalg.finite_rows(estimates)).cpu()
            else:
                basis, new_values = eig.eigenvectors, eig.eigenvalues
                # our QR keeps bases by descending eigenvalue; eigenvalue-corrected with
                # eigenbasis_variant="meta": eigh's ascending order, paired with D as it is
                if keeps and (shampoo or group["eigenbasis_variant"] == "descending"):
                    basis, new_values = basis.flip(-1), new_values.flip(-1)
                sub_ok = torch.tensor(eig.ok, dtype=torch.bool)
            if not bool(sub_ok.all()):
                ok[todo.cpu()] = sub_ok
                good = sub_ok.to(device)
                done, basis, new_values = todo[good], basis[good], new_values[good]
                if use_qr:
                    order = order[good]
            if use_qr and not shampoo:
                self._permute_corrected(state, j, picked.index(done), order)
            if keeps:
                picked.put(state[vectors_name], done, basis)
            if len(done) == n:
                values = new_values
            else:
                values[done] = new_values
        if shampoo:
            if keeps:  # every row that did not fail, with its kept or new basis
                local = ok.nonzero().flatten().to(device)
                vectors = picked.take(state[vectors_name], local)
            else:
                local, vectors = done, basis
            if len(local) > 0:
                lam = linalg.regularized_eigenvalues(
                    values if len(local) == n else values[local], epsilon
                )
                exponent = dim_exponents(group, self.order)[j]
                root = state[f"inverse_root_{j}"]
                scaled = workspace.get("refresh_scaled", vectors.shape, vectors.dtype, device)
                if not vectors.is_contiguous():  # column-major from eigh: keep its layout
                    scaled = scaled.mT
                if picked.covers(local, root):
                    linalg.inverse_root_from_eigen(lam, vectors, exponent, root, scaled)
                else:
                    picked.put(root, local, linalg.inverse_root_from_eigen(
                        lam, vectors, exponent, scratch=scaled))
        self._count_failures(f"factor_matrix_{j}", ok, [job.members[r] for r in picked.list],
                             job.step)

    def _permute_corrected(self, state: dict, dim: int, blocks: Tensor, order: Tensor) -> None:
        """Reorder ``D`` along ``dim`` for ``blocks`` as their basis columns were sorted."""
        unmoved = torch.arange(order.shape[-1], device=order.device)
        if len(blocks) == 0 or bool((order == unmoved).all()):
            return  # nothing moved (the usual case for a warm-started basis)
        d = state["corrected_eigenvalues"]
        sub = d[blocks]
        shape = [sub.shape[0]] + [1] * (sub.dim() - 1)
        shape[dim + 1] = sub.shape[dim + 1]
        index = order.reshape(shape).expand_as(sub)
        d[blocks] = sub.gather(dim + 1, index)

    def _count_failures(self, name: str, ok: Tensor, members: list[int], step: int) -> None:
        counts = self.failures.setdefault(name, [0] * len(self.members))
        for position, success in zip(members, ok.tolist()):
            if success:
                counts[position] = 0
                continue
            counts[position] += 1
            member = self.members[position]
            message = (
                f"DistributedShampoo: eigendecomposition of {name} of parameter "
                f"{member.name!r} (block {member.block_index}) failed at step {step}"
            )
            if counts[position] > MAX_CONSECUTIVE_FAILURES:
                raise ShampooNumericalError(
                    f"{message} for the {counts[position]}th time in a row; giving up"
                )
            warnings.warn(f"{message}; keeping the previous preconditioner", stacklevel=4)


@dataclass
class _DimRefresh:
    """One dim's part of a refresh: ``A = F / bc2`` of the refreshing rows, which of them
    need a new decomposition (``todo``) and the eigenvalues known so far."""

    dim: int
    matrix: Tensor
    todo: Tensor
    values: Tensor
    check: linalg.BasisCheck | None = None


class _Rows:
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


def _split_first(rows: list[int], first: list[int]) -> list[tuple[list[int], bool]]:
    """Refreshing rows grouped by whether it is their first refresh (eigh, no criterion)."""
    later = [r for r in rows if r not in set(first)]
    return [(group, is_first) for group, is_first in ((first, True), (later, False)) if group]
