"""Eigenvalue-corrected Shampoo (SOAP; docs/design.md §2–§3, Meta's ``EigenvalueCorrectedShampoo``).

Each dim keeps an eigenbasis ``Q_j`` of its factor; a diagonal second moment ``D`` of the
gradient rotated into those bases replaces the factors' eigenvalues:
``P = R⁻¹((R(Ĝ)) / ((D / bc2)^e + ε))`` with ``R(X) = X ×_1 Q_1ᵀ ... ×_k Q_kᵀ``.
Refreshes renew the bases only: ``eigh`` of ``A + εI``, or Meta's QR algorithm in the
rotated frame from the kept basis (``eigendecomposition="qr"``), with the docs/design.md §3
criterion deciding which bases are stale. ``eigenbasis_variant="meta"`` (default) is
Meta's arithmetic: ascending eigenvalue order, ``D`` never permuted;
``"descending"`` sorts bases by descending eigenvalue, refreshes first by ``eigh`` and
then by ``qr(A Q)``, and permutes ``D`` with the basis. State: ``factor_matrix_{j}``,
``eigenvectors_{j}``, ``corrected_eigenvalues`` (``D``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import eigenbasis, linalg
from ..keywords import fail
from ..kronecker import multi_mode_product
from ..update_rules import Scratch, second_moment_bias
from . import refresh as common
from .base import KroneckerFactored


class EigenvalueCorrected(KroneckerFactored):
    name = "eigenvalue_corrected"
    adam_like = True  # its epsilon is Adam's; the Trainer does not graft it by default
    scalar_override_sets_dims = False  # {order: e}: the corrected eigenvalues' exponent

    def default_exponent(self, order: int) -> float:
        """1.0 marks a rotated dim (0: a dim that keeps the identity basis)."""
        return 1.0

    @staticmethod
    def corrected_exponent(group: dict, order: int) -> float:
        """The exponent applied to ``D / bc2`` (0.5 unless overridden)."""
        override = (group["inverse_exponent_override"] or {}).get(order)
        return 0.5 if override is None or isinstance(override, dict) else float(override)

    def check(self, group: dict) -> None:
        """Per-dim exponents may only be 0; 4-bit state without a warm-up needs a cadence."""
        super().check(group)
        for entry in (group["inverse_exponent_override"] or {}).values():
            if isinstance(entry, dict) and any(e != 0 for e in entry.values()):
                fail("inverse_exponent_override", group["inverse_exponent_override"],
                     "with preconditioner='eigenvalue_corrected' a per-dim entry may only "
                     "be 0 (that dim keeps the identity basis); {order: e} sets the exponent "
                     "of the corrected eigenvalues (default 0.5)")
        if (group["quantization"] == "4bit" and group["statistics_frequency"] is None
                and group["statistics_warmup"] == 0):
            fail("statistics_frequency", None, "4-bit eigenvalue-corrected Shampoo without a "
                 "warm-up (statistics_warmup=0) needs an explicit sample cadence: with "
                 "samples at refresh steps only, one sampled gradient gives rank-deficient "
                 "factors whose arbitrary eigenbasis meets D's zero entries (it diverged on "
                 "a small CNN; docs/benchmarks/memory.md)")

    def keeps_basis(self, group: dict) -> bool:
        return True

    def state_shapes(self, stack, group: dict) -> dict:
        shapes = super().state_shapes(stack, group)
        for j in self.factor_dims(stack, group):
            d = stack.shape[j]
            shapes[f"eigenvectors_{j}"] = ((d, d), group["factor_matrix_dtype"])
        shapes["corrected_eigenvalues"] = (stack.shape, stack.work_dtype)
        return shapes

    # ------------------------------------------------------------------- refresh
    def refresh(self, stack, job, rows: list[int], first: bool, workspace) -> None:
        group = job.group
        meta = group["eigenbasis_variant"] == "meta"
        qr = group["eigendecomposition"] == "qr"
        picked = common.Rows(rows, job.grad.shape[0], job.grad.device)
        plans = common.plan_dims(job, self.factor_dims(stack, group), picked, workspace)
        if meta and qr:  # the QR algorithm checks the criterion itself, also at first
            for plan in plans:
                self._meta_qr(stack, job, plan, picked)
            return
        use_qr = qr and not first
        # Meta checks A + εI, also against the identity basis at the first refresh (τ = 0
        # marks every matrix stale either way)
        for plan, new in common.new_bases(stack, job, plans, picked, workspace, use_qr,
                                          descending=not meta, check=meta or not first,
                                          shift=meta):
            if new.order is not None and f"order_{plan.dim}" in job.state:  # delayed
                job.state[f"order_{plan.dim}"].index_copy_(0, picked.index(new.done),
                                                         new.order)
            elif new.order is not None:
                self._permute(job.state, plan.dim, picked.index(new.done), new.order)
            picked.put(job.state[f"eigenvectors_{plan.dim}"], new.done, new.basis)

    def _meta_qr(self, stack, job, plan: common.DimRefresh, picked: common.Rows) -> None:
        """Meta's QR refresh of one dim: QR iterations on ``A + εI`` from the kept basis,
        eigenvalue estimates sorted ascending with the basis; ``D`` keeps its order."""
        group, state, j = job.group, job.state, plan.dim
        name = f"eigenvectors_{j}"
        matrix = plan.matrix + group["epsilon"] * torch.eye(
            plan.matrix.shape[-1], dtype=plan.matrix.dtype, device=plan.matrix.device)
        stale: list = []
        basis, values = eigenbasis.qr_algorithm_direct(
            matrix, picked.take(state[name]), group["qr_max_iterations"],
            group["eigenbasis_tolerance"], group["orthogonalization"], first_stale=stale)
        ok = (linalg.finite_rows(basis) & linalg.finite_rows(values)).cpu()
        done = ok.nonzero().flatten().to(basis.device)
        picked.put(state[name], done, basis if len(done) == len(basis) else basis[done])
        members = [job.members[r] for r in picked.list]
        if stale and group["eigenbasis_tolerance"] > 0:
            stack.health.record_recomputed(f"factor_matrix_{j}", len(stack.members), members,
                                           stale[0])
        stack.count_failures(f"factor_matrix_{j}", ok, members, job.step, eigenvalues=values,
                             group=group)

    def delayed_extras(self, stack, group: dict) -> dict:
        """The column order of each refreshed basis (the descending variant's QR sorts
        them), by which ``D`` is reordered when the basis is applied."""
        if group["eigenbasis_variant"] == "meta" or group["eigendecomposition"] != "qr":
            return {}
        return {f"order_{j}": ((stack.shape[j],), torch.int64)
                for j in self.factor_dims(stack, group)}

    def initial_delayed(self, name, shape, dtype, n, device) -> Tensor:
        return torch.arange(shape[0], device=device).repeat(n, 1)  # no column moved

    def apply_delayed(self, state: dict, index: Tensor, result: dict) -> None:
        result = dict(result)
        for name in [k for k in result if k.startswith("order_")]:
            self._permute(state, int(name[len("order_"):]), index, result.pop(name))
        super().apply_delayed(state, index, result)

    @staticmethod
    def _permute(state: dict, dim: int, blocks: Tensor, order: Tensor) -> None:
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

    # ---------------------------------------------------------- statistics, direction
    def after_refresh(self, stack, job, g: Tensor, scratch: Scratch) -> None:
        """``D = β2 D + (1-β2) R(G)²`` in the current bases."""
        beta2 = job.group["betas"][1]
        rotated = _rotate(g, self.bases(stack, job, scratch), True, scratch("rotated"),
                          scratch("scratch"))
        d = job.state["corrected_eigenvalues"]
        if beta2 != 1.0:
            d.mul_(beta2)
        d.addcmul_(rotated, rotated, value=1.0 if beta2 == 1.0 else 1.0 - beta2)

    def precondition(self, stack, job, filtered: Tensor, out: Tensor, scratch: Scratch) -> Tensor:
        group = job.group
        bases = self.bases(stack, job, scratch)
        rotated = _rotate(filtered, bases, True, scratch("rotated"), scratch("scratch"))
        exponent = self.corrected_exponent(group, stack.order)
        bias2 = second_moment_bias(group, job.step)
        scaled = torch.div(job.state["corrected_eigenvalues"], bias2, out=scratch("graft"))
        scaled = linalg.power(scaled, exponent, in_place=True)
        rotated.div_(scaled.add_(group["epsilon"]))
        _rotate(rotated, bases, False, out, scratch("scratch"))
        return out

    def bases(self, stack, job, scratch: Scratch) -> list[Tensor | None]:
        """``Q_j`` per dim (None: the identity)."""
        dims = set(self.factor_dims(stack, job.group))
        return [job.state[f"eigenvectors_{j}"] if j in dims else None
                for j in range(stack.order)]


def _rotate(x: Tensor, bases: list, transpose: bool, out: Tensor, scratch: Tensor) -> Tensor:
    """``x`` in (``transpose``) or out of the eigenbases, into ``out`` where dtypes allow."""
    if x.dtype == out.dtype and all(b is None or b.dtype == x.dtype for b in bases):
        return multi_mode_product(x, bases, transpose, out=out, scratch=scratch)
    fdtype = next(b.dtype for b in bases if b is not None)
    return out.copy_(multi_mode_product(x.to(fdtype), bases, transpose))
