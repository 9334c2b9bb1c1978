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
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor

from . import linalg
from .config import corrected_exponent, dim_exponents, is_refresh_step, start_step
from .kronecker import multi_mode_product, update_factor

MAX_CONSECUTIVE_FAILURES = 3
GRAFTING_NORM_EPSILON = 1e-16


class ShampooNumericalError(RuntimeError):
    """A factor matrix became non-finite, or its eigendecomposition kept failing."""


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
            if group["preconditioner"] == "shampoo":
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
    def updated_factors(self, state: dict[str, Tensor], group: dict, grad: Tensor) -> dict:
        """Out-of-place factor updates (used at refresh steps, checked before committing)."""
        beta2 = group["betas"][1]
        fdtype = group["factor_matrix_dtype"]
        g = grad.to(fdtype)
        return {
            f"factor_matrix_{j}": update_factor(state[f"factor_matrix_{j}"], g, j, beta2, True)
            for j in self.preconditioned_dims(group)
        }

    def direction(
        self,
        state: dict[str, Tensor],
        group: dict,
        step: int,
        grad: Tensor,
        param: Tensor | None,
        new_factors: dict[str, Tensor] | None,
        members: list[int],
    ) -> Tensor:
        """SPEC §2 lines 2–7 for the blocks in ``state`` (the whole stack or a subset of it,
        ``members`` giving their positions); returns ``P`` (before ``-lr``). ``grad`` (with
        L2 decay already added, line 1) and ``param`` are stacked copies in ``work_dtype``
        that this function may modify. ``new_factors`` are this step's factor matrices when
        the caller already computed them (refresh steps)."""
        beta1, beta2 = group["betas"]
        wd, wd_type = group["weight_decay"], group["weight_decay_type"]
        fdtype = group["factor_matrix_dtype"]
        dims = self.preconditioned_dims(group)

        # line 2: factor statistics and, at refresh steps, the amortized computation
        if new_factors is not None:
            state.update(new_factors)
        else:
            g = grad.to(fdtype)
            for j in dims:
                update_factor(state[f"factor_matrix_{j}"], g, j, beta2)
        if is_refresh_step(group, step):
            self._refresh(state, group, step, members)
        corrected = group["preconditioner"] == "eigenvalue_corrected"
        bias2 = 1.0 - beta2**step if group["use_bias_correction"] and beta2 < 1 else 1.0
        if corrected:
            bases = self._bases(state, group)
            rotated = multi_mode_product(grad.to(fdtype), bases, transpose=True).to(grad.dtype)
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
        filtered = self._filtered_gradient(state, group, step, grad)

        # line 5: search direction
        def graft(x: Tensor) -> Tensor:
            if grafting in (None, "sgd"):
                return x
            v = state["grafting_state"]
            if grafting == "adam":
                v = v / (1.0 - gb2**step)
            return x / (v.sqrt() + group["grafting_epsilon"])

        diagonal = group["preconditioner"] == "diagonal"
        if diagonal or (step < start_step(group) and grafting is not None):
            direction = graft(filtered)
        else:
            if corrected:
                direction = self._corrected_direction(state, group, filtered, bases, bias2)
            else:
                roots = [state.get(f"inverse_root_{j}") for j in range(self.order)]
                direction = multi_mode_product(filtered.to(fdtype), roots).to(filtered.dtype)
            if grafting is not None:
                reduce = tuple(range(1, direction.dim()))
                graft_norm = torch.linalg.vector_norm(graft(filtered), dim=reduce, keepdim=True)
                norm = torch.linalg.vector_norm(direction, dim=reduce, keepdim=True)
                direction = direction * (graft_norm / (norm + GRAFTING_NORM_EPSILON))

        # line 6: weight decay folded into the direction
        if wd > 0 and wd_type != "l2":
            peak = group["peak_lr"]
            alpha = {
                "decoupled": wd,
                "corrected": wd * float(group["lr"]) / peak if peak else 0.0,
                "independent": wd / peak if peak else 0.0,
            }[wd_type]
            direction = direction + alpha * param

        # line 7: classic momentum
        mu = group["momentum"]
        if mu > 0:
            dampening = group["dampening"]
            buf = state["momentum"]
            buf.mul_(mu).add_(direction, alpha=1.0 - dampening)
            if group["nesterov"]:
                direction = direction * (1.0 - dampening) + mu * buf
            else:
                direction = buf
        return direction

    def _filtered_gradient(self, state: dict, group: dict, step: int, grad: Tensor) -> Tensor:
        beta1 = group["betas"][0]
        if beta1 == 0:
            return grad
        beta3 = group["beta3"] if group["beta3"] is not None else beta1
        m = state["filtered_grad"]
        bias = group["use_bias_correction"]
        if beta3 == beta1:
            m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
            return m / (1.0 - beta1**step) if bias else m.clone()
        filtered = torch.add(m * beta3, grad, alpha=1.0 - beta3)
        if bias:
            filtered.div_(1.0 - beta3 * beta1 ** (step - 1))
        m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        return filtered

    def _bases(self, state: dict, group: dict) -> list[Tensor | None]:
        dims = set(self.preconditioned_dims(group))
        return [state[f"eigenvectors_{j}"] if j in dims else None for j in range(self.order)]

    def _corrected_direction(
        self, state: dict, group: dict, filtered: Tensor, bases: list, bias2: float
    ) -> Tensor:
        fdtype = group["factor_matrix_dtype"]
        rotated = multi_mode_product(filtered.to(fdtype), bases, transpose=True).to(filtered.dtype)
        exponent = corrected_exponent(group, self.order)
        scaled = state["corrected_eigenvalues"] / bias2
        scaled = linalg.power(scaled, exponent)
        rotated = rotated / (scaled + group["epsilon"])
        return multi_mode_product(rotated.to(fdtype), bases).to(filtered.dtype)

    # ------------------------------------------------------- amortized computation
    def _refresh(self, state: dict, group: dict, step: int, members: list[int]) -> None:
        """SPEC §2 line 2 (amortized part) and §3 for every preconditioned dim.

        Every path yields, per block, the eigenvalues of ``A + εI`` and a basis: from
        ``eigh``, from warm-started QR, or (a block whose kept basis passes the tolerance
        criterion) ``diag(QᵀAQ) + ε`` with the kept basis. Blocks whose decomposition
        failed keep their previous root / basis.
        """
        beta2 = group["betas"][1]
        bias2 = 1.0 - beta2**step if group["use_bias_correction"] and beta2 < 1 else 1.0
        epsilon = group["epsilon"]
        first = step == start_step(group)
        keeps = self.keeps_basis(group)
        use_qr = group["eigendecomposition"] == "qr" and not first
        shampoo = group["preconditioner"] == "shampoo"
        exponents = dim_exponents(group, self.order)
        for j in self.preconditioned_dims(group):
            factor = state[f"factor_matrix_{j}"]
            matrix = factor / bias2 if bias2 != 1.0 else factor
            n, d = matrix.shape[0], matrix.shape[-1]
            device = matrix.device
            if keeps and not first:
                stale, diagonal = linalg.stale_mask(
                    matrix, state[f"eigenvectors_{j}"], group["eigenbasis_tolerance"]
                )
                todo = stale.nonzero().flatten()
                values = diagonal + epsilon
            else:
                todo = torch.arange(n, device=device)
                values = matrix.new_zeros(n, d)
            ok = torch.ones(n, dtype=torch.bool)
            done = todo
            if len(todo) > 0:
                sub = matrix if len(todo) == n else matrix[todo]
                if use_qr:
                    basis, estimates, order = linalg.qr_iteration(
                        sub,
                        state[f"eigenvectors_{j}"][todo],
                        group["qr_max_iterations"],
                        group["eigenbasis_tolerance"],
                    )
                    new_values = estimates + epsilon
                    sub_ok = (
                        torch.isfinite(basis).flatten(1).all(1) & torch.isfinite(estimates).all(1)
                    ).cpu()
                else:
                    eye = torch.eye(d, dtype=matrix.dtype, device=device)
                    eig = linalg.batched_eigh(sub + epsilon * eye)
                    basis, new_values = eig.eigenvectors, eig.eigenvalues
                    if keeps:  # kept bases are sorted by descending eigenvalue (see qr_iteration)
                        basis, new_values = basis.flip(-1), new_values.flip(-1)
                    sub_ok = torch.tensor(eig.ok, dtype=torch.bool)
                ok[todo.cpu()] = sub_ok
                good = sub_ok.to(device)
                done = todo[good]
                if use_qr and not shampoo:
                    self._permute_corrected(state, j, done, order[good])
                if keeps:
                    state[f"eigenvectors_{j}"][done] = basis[good]
                values[done] = new_values[good]
            if shampoo:
                if keeps:
                    idx = ok.nonzero().flatten().to(device)
                    vectors = state[f"eigenvectors_{j}"][idx]
                else:
                    idx, vectors = done, basis[good]
                if len(idx) > 0:
                    lam = linalg.regularized_eigenvalues(values[idx], epsilon)
                    state[f"inverse_root_{j}"][idx] = linalg.inverse_root_from_eigen(
                        lam, vectors, exponents[j]
                    )
            self._count_failures(f"factor_matrix_{j}", ok, members, step)

    def _permute_corrected(self, state: dict, dim: int, blocks: Tensor, order: Tensor) -> None:
        """Reorder ``D`` along ``dim`` for ``blocks`` as their basis columns were sorted."""
        if len(blocks) == 0:
            return
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
