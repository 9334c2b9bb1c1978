"""4-bit Shampoo, eigendecomposed Shampoo and eigenvalue-corrected Shampoo
(``quantization="4bit"``; docs/design.md §5, arXiv 2405.18144).

A factor ``F_j`` with at least 4096 elements is kept as its eigendecomposition: float32
eigenvalues ``factor_eigenvalues_{j}`` and 4-bit eigenvectors ``factor_eigenvectors_{j}``
(stored transposed, one eigenvector per row, so that a 64-element quantisation block lies
within one eigenvector). Shampoo's inverse root ``I_j`` is kept as a float32 diagonal
``inverse_root_{j}_diagonal`` and a 4-bit off-diagonal ``inverse_root_{j}``; the
eigenvalue-corrected kind uses the factor's eigenvectors as its basis. Smaller factors are
kept and updated as in 32 bits. Everything else (grafting, ``D``, momentum) is float32.

The factor statistics of the quantised dims follow the paper: a factor is rebuilt from one
sampled gradient every ``statistics_frequency`` steps (default: ``precondition_frequency``)
and at refresh steps, instead of every step, except in the first ``statistics_warmup``
steps of a block's schedule (default: up to its first refresh), where every step is a
sample, so that the first roots come from every gradient as in 32 bits rather than from
one (docs/design.md §5: one sampled gradient leaves the first factors rank-deficient).
With ``Δ`` the steps since the block's previous sample (its step count at the first one),
``V`` the dequantised eigenvectors after one Björck step and ``λ`` the eigenvalues (0
before the first sample):
``F = β2^Δ · V diag(λ) Vᵀ + (1 − β2^Δ) · G Gᵀ`` (``β2 = 1``: ``F + Δ · G Gᵀ``), so that the
gradient stands for the ``Δ`` steps since the last sample and ``1 − β2^t`` stays the bias
correction. ``F`` is then decomposed (``eigh``; warm-started QR from ``V`` with
``eigendecomposition="qr"`` once a block has eigenvectors) and its eigenvectors quantised;
at refresh steps Shampoo's inverse root is computed from the new float32 eigenvectors
before they are quantised. The eigenvalue-corrected basis is the factor's eigenvectors, so
it follows the samples.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import eigenbasis, linalg, quantization
from ..kronecker import update_factor
from ..update_rules import Scratch, second_moment_bias
from . import refresh as common
from .eigendecomposed import EigendecomposedShampoo
from .eigenvalue_corrected import EigenvalueCorrected
from .shampoo import Shampoo

# Björck steps after dequantising eigenvectors to rebuild a factor (the paper's t1)
REBUILD_BJORCK_STEPS = 1


class QuantizedFactors:
    """What both 4-bit kinds share: which dims are quantised, their state and its update."""

    def quantized_dims(self, stack, group: dict) -> list[int]:
        return [j for j in self.preconditioned_dims(group, stack.order)
                if stack.shape[j] ** 2 >= quantization.MIN_QUANTIZED_ELEMENTS]

    def factor_dims(self, stack, group: dict) -> list[int]:
        quantized = set(self.quantized_dims(stack, group))
        return [j for j in self.preconditioned_dims(group, stack.order) if j not in quantized]

    def state_shapes(self, stack, group: dict) -> dict:
        """The kind's 32-bit state for the small factors, and the quantised factors'."""
        shapes = super().state_shapes(stack, group)
        shapes.update(self.vector_and_matrix_shapes(stack, group, "factor_eigenvalues_{}",
                                                    "factor_eigenvectors_{}"))
        return shapes

    def vector_and_matrix_shapes(self, stack, group: dict, vector: str, matrix: str) -> dict:
        """For each quantised dim ``j`` of size ``d``: a float32 ``d``-vector named
        ``vector.format(j)`` and a 4-bit ``d × d`` matrix named ``matrix.format(j)``."""
        shapes = {}
        for j in self.quantized_dims(stack, group):
            d = stack.shape[j]
            shapes[vector.format(j)] = ((d,), torch.float32)
            shapes.update(quantization.state_shapes(matrix.format(j), d, d))
        return shapes

    def initial_state(self, name, shape, dtype, n, device) -> Tensor:
        if name.endswith(("_codes", "_scales")):
            base, kind = name.rsplit("_", 1)
            d = shape[0]
            start = torch.eye(d, device=device) if base.startswith("factor_eigenvectors_") \
                else torch.zeros(d, d, device=device)  # a root's off-diagonal part
            q = quantization.quantize(start)
            value = q.codes if kind == "codes" else q.scales
            return value.repeat(n, 1, 1)
        if name.startswith("inverse_root_") and name.endswith("_diagonal"):
            return torch.ones((n, *shape), dtype=dtype, device=device)
        return super().initial_state(name, shape, dtype, n, device)

    def eigenvectors(self, state: dict, dim: int, d: int, rows: Tensor | None = None,
                     bjorck: int = 0) -> Tensor:
        """``V`` (eigenvectors as columns) of the rows, dequantised, ``bjorck`` steps."""
        sub = state if rows is None else {
            k: state[k][rows] for k in (f"factor_eigenvectors_{dim}_codes",
                                       f"factor_eigenvectors_{dim}_scales")}
        v = quantization.load(sub, f"factor_eigenvectors_{dim}", d).mT
        return quantization.bjorck(v, bjorck)

    @staticmethod
    def sample_every(group: dict) -> int:
        return group["statistics_frequency"] or group["precondition_frequency"]

    @classmethod
    def warmup_steps(cls, group: dict) -> int:
        """How many first steps of a block's schedule sample every gradient
        (``statistics_warmup``; None: up to the first refresh)."""
        warmup = group["statistics_warmup"]
        return cls.start_step(group) if warmup is None else warmup

    def previous_sample(self, group: dict, t: int) -> int:
        """The step (of a block's own schedule) of its last sample before ``t``; 0: none.
        Samples: every step of the warm-up, every ``statistics_frequency`` steps and at the
        refresh steps."""
        every, start = self.sample_every(group), self.start_step(group)
        previous = max(every * ((t - 1) // every), start if start < t else 0)
        if t - 1 <= self.warmup_steps(group):
            previous = max(previous, t - 1)
        return previous

    def sample_rows(self, job) -> list[int]:
        """Rows whose quantised factors take a sample this step without refreshing."""
        every, refresh = self.sample_every(job.group), set(job.refresh_rows)
        warmup = self.warmup_steps(job.group)
        steps = [job.own_step(r) for r in range(job.grad.shape[0])]
        return [r for r, t in enumerate(steps)
                if r not in refresh and t >= 1 and (t % every == 0 or t <= warmup)]

    def sampled_factors(self, stack, job, rows: list[int]) -> dict[int, Tensor]:
        """``F`` of each quantised dim for ``rows`` (module docstring), out of place."""
        group, state = job.group, job.state
        beta2 = group["betas"][1]
        index = torch.tensor(rows, device=job.grad.device)
        g = job.grad.to(torch.float32)[index]
        deltas = []
        for r in rows:
            t = job.own_step(r)
            deltas.append(t - self.previous_sample(group, t))
        delta = torch.tensor(deltas, dtype=torch.float64, device="cpu")
        if beta2 == 1.0:
            keep, weight = torch.ones_like(delta), delta
        else:
            keep = beta2**delta
            weight = 1.0 - keep
        keep = keep.to(g.dtype).to(g.device).view(-1, 1, 1)
        weight = weight.to(g.dtype).to(g.device).view(-1, 1, 1)
        factors = {}
        for j in self.quantized_dims(stack, group):
            d = stack.shape[j]
            outer = update_factor(g.new_zeros(len(rows), d, d), g, j, 0.0)  # G Gᵀ
            # before the first sample λ = 0, so the rebuilt factor is 0
            v = self.eigenvectors(state, j, d, index, REBUILD_BJORCK_STEPS)
            lam = state[f"factor_eigenvalues_{j}"][index]
            # V diag(λ) Vᵀ = C Cᵀ with C = V diag(√λ), as a symmetric product (λ of a
            # positive semi-definite factor; eigh's round-off below 0 is dropped)
            scaled = v * lam.clamp_min(0).sqrt().unsqueeze(-2)
            previous = linalg.syrk(torch.empty_like(scaled), scaled)
            factors[j] = previous.mul_(keep).add_(outer.mul_(weight))
        return factors

    def checked_factors(self, stack, job) -> dict[str, Tensor]:
        """The 32-bit factors as usual, and the sampled factors of the quantised dims (kept
        for the refresh that follows), rows in ``job.refresh_rows`` order."""
        factors = super().checked_factors(stack, job)
        groups = common.split_first(job.refresh_rows, job.first_rows)
        sampled: dict[int, list[Tensor]] = {}
        for rows, _ in groups:
            computed = self.sampled_factors(stack, job, rows)
            job.cache[("sampled", tuple(rows))] = computed
            for j, f in computed.items():
                sampled.setdefault(j, []).append(f)
        order = [r for rows, _ in groups for r in rows]
        perm = [order.index(r) for r in job.refresh_rows]
        for j, parts in sampled.items():
            factors[f"sampled_factor_{j}"] = torch.cat(parts)[perm]
        return factors

    def update_statistics(self, stack, job, g: Tensor, scratch: Scratch) -> None:
        if job.new_factors is not None:  # only the 32-bit factors are state
            job.new_factors = {k: v for k, v in job.new_factors.items()
                               if not k.startswith("sampled_factor_")}
        super().update_statistics(stack, job, g, scratch)
        rows = self.sample_rows(job)
        if rows:  # a sample between refreshes: new eigenvectors, no root
            self.refresh_quantized(stack, job, rows, self.descending(job.group))

    def descending(self, group: dict) -> bool:
        """Whether bases are kept by descending eigenvalue (else eigh's ascending order)."""
        return False

    def qr_tolerance(self, group: dict) -> float:
        """The QR algorithm's criterion on the sampled factors (0: always iterate)."""
        return 0.0

    def eigh_refresh(self, state: dict, dim: int, d: int, index: Tensor, factor: Tensor,
                     group: dict, fresh: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """``(eigenvalues, eigenvectors, ok, kept)`` of the sampled factors by ``eigh``
        (``kept``: a mask of the rows whose stored basis was re-used, or None)."""
        eig = linalg.batched_eigh(factor)
        ok = torch.tensor(eig.ok, dtype=torch.bool, device="cpu")
        return eig.eigenvalues, eig.eigenvectors, ok, None

    def refresh_quantized(self, stack, job, rows: list[int],
                          descending: bool) -> dict[int, tuple[Tensor, Tensor, Tensor]]:
        """New eigendecompositions of the quantised factors of ``rows``: eigenvalues and
        quantised eigenvectors stored (failed matrices keep theirs). Returns, per dim, the
        local rows that succeeded with their float32 eigenvalues and eigenvectors."""
        group, state = job.group, job.state
        device = job.grad.device
        index = torch.tensor(rows, device=device)
        results = {}
        sampled = job.cache.pop(("sampled", tuple(rows)), None)
        if sampled is None:
            sampled = self.sampled_factors(stack, job, rows)
        # eigh for a block's first decomposition (no eigenvectors to start QR from), decided
        # row by row: which other rows share the call (the stack's other blocks, their
        # staggered offsets) must not change a row's algorithm, or an owner holding a part
        # of the stack would compute otherwise than one process
        fresh = [self.previous_sample(group, job.own_step(r)) == 0 for r in rows]
        parts = [(torch.tensor([k for k, f in enumerate(fresh) if f is want], device=device),
                  want) for want in (True, False) if want in fresh]
        for j, factor in sampled.items():
            d = stack.shape[j]
            ok = torch.zeros(len(rows), dtype=torch.bool, device="cpu")
            done_parts, value_parts, vector_parts = [], [], []
            for local, first in parts:
                every = len(parts) == 1
                sub_index = index if every else index[local]
                values, vectors, sub_ok, kept = self._decompose(
                    state, j, d, sub_index, factor if every else factor[local], group, first,
                    descending)
                ok[local.cpu()] = sub_ok.cpu()
                done = sub_ok.nonzero().flatten().to(device)
                if len(done) > 0:
                    state[f"factor_eigenvalues_{j}"][sub_index[done]] = values[done].float()
                    new = done if kept is None else done[~kept.to(device)[done]]
                    if len(new) > 0:  # a kept basis is not quantised again (no drift)
                        quantization.store(state, f"factor_eigenvectors_{j}",
                                           vectors[new].mT.float().contiguous(),
                                           sub_index[new])
                done_parts.append(local[done])
                value_parts.append(values[done])
                vector_parts.append(vectors[done])
            stack.count_failures(f"factor_eigenvectors_{j}", ok,
                                 [job.members[r] for r in rows], job.step)
            results[j] = (torch.cat(done_parts), torch.cat(value_parts),
                          torch.cat(vector_parts))
        return results

    def _decompose(self, state: dict, j: int, d: int, index: Tensor, factor: Tensor,
                   group: dict, fresh: bool, descending: bool
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """``(eigenvalues, eigenvectors, ok, kept)`` of sampled factors of the rows ``index``
        (``fresh``: their first decomposition, by ``eigh``)."""
        if fresh or group["eigendecomposition"] == "eigh":
            values, vectors, ok, kept = self.eigh_refresh(state, j, d, index, factor, group,
                                                          fresh)
            if descending:
                values, vectors = values.flip(-1), vectors.flip(-1)
            return values, vectors, ok, kept
        start = self.eigenvectors(state, j, d, index, REBUILD_BJORCK_STEPS)
        if descending:
            vectors, values, _ = eigenbasis.qr_iteration(
                factor, start, group["qr_max_iterations"], method=group["orthogonalization"])
        else:
            vectors, values = eigenbasis.qr_algorithm_direct(
                factor, start, group["qr_max_iterations"], self.qr_tolerance(group),
                group["orthogonalization"])
        ok = (linalg.finite_rows(vectors) & linalg.finite_rows(values)).cpu()
        return values, vectors, ok, None


class QuantizedShampoo(QuantizedFactors, Shampoo):
    name = "shampoo"

    def state_shapes(self, stack, group: dict) -> dict:
        """Also the roots: a float32 diagonal and a 4-bit off-diagonal."""
        shapes = super().state_shapes(stack, group)
        shapes.update(self.vector_and_matrix_shapes(stack, group, "inverse_root_{}_diagonal",
                                                    "inverse_root_{}"))
        return shapes

    def refresh(self, stack, job, rows: list[int], first: bool, workspace) -> None:
        super().refresh(stack, job, rows, first, workspace)  # the 32-bit dims
        group, state = job.group, job.state
        bias2 = second_moment_bias(group, job.step)
        index = torch.tensor(rows, device=job.grad.device)
        for j, (done, values, vectors) in self.refresh_quantized(
                stack, job, rows, self.descending(group)).items():
            if len(done) == 0:
                continue
            lam, cutoff = linalg.stabilized_eigenvalues(values / bias2 + group["epsilon"], group)
            exponent = self.exponents(group, stack.order)[j]
            root = linalg.inverse_root_from_eigen(lam, vectors.contiguous(), exponent,
                                                  cutoff=cutoff)
            diagonal = root.diagonal(dim1=-2, dim2=-1).clone()
            root.diagonal(dim1=-2, dim2=-1).zero_()
            state[f"inverse_root_{j}_diagonal"][index[done]] = diagonal
            quantization.store(state, f"inverse_root_{j}", root, index[done])

    @staticmethod
    def stored_root(state: dict, dim: int, d: int) -> Tensor:
        """``I_j`` of every row of ``state``: the 4-bit off-diagonal, dequantised, with the
        float32 diagonal written in."""
        root = quantization.load(state, f"inverse_root_{dim}", d)
        root.diagonal(dim1=-2, dim2=-1).copy_(state[f"inverse_root_{dim}_diagonal"])
        return root

    def roots(self, stack, job, scratch: Scratch) -> list[Tensor | None]:
        roots = super().roots(stack, job, scratch)
        for j in self.quantized_dims(stack, job.group):
            roots[j] = self.stored_root(job.state, j, stack.shape[j])
        return roots


class QuantizedEigendecomposedShampoo(QuantizedShampoo, EigendecomposedShampoo):
    """4-bit ``eigendecomposed_shampoo``: the large factors as 4-bit Shampoo keeps them (an
    eigendecomposition already: 4-bit eigenvectors, float32 eigenvalues, the root's 4-bit
    off-diagonal), refreshed by Meta's eigh with the criterion (the kept, dequantised basis
    re-used while the sampled factor stays nearly diagonal in it) or its QR algorithm; the
    small factors as 32-bit ``eigendecomposed_shampoo``."""
    name = "eigendecomposed_shampoo"

    def qr_tolerance(self, group: dict) -> float:
        return group["eigenbasis_tolerance"]

    def eigh_refresh(self, state: dict, dim: int, d: int, index: Tensor, factor: Tensor,
                     group: dict, fresh: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        if fresh or group["eigenbasis_tolerance"] == 0:
            return super().eigh_refresh(state, dim, d, index, factor, group, fresh)
        stored = self.eigenvectors(state, dim, d, index, REBUILD_BJORCK_STEPS)
        vectors, values, ok, kept = self._eigh_or_kept(factor, stored, group)
        return values, vectors, ok, kept


class QuantizedEigenvalueCorrected(QuantizedFactors, EigenvalueCorrected):
    name = "eigenvalue_corrected"

    def refresh(self, stack, job, rows: list[int], first: bool, workspace) -> None:
        super().refresh(stack, job, rows, first, workspace)  # the 32-bit dims
        self.refresh_quantized(stack, job, rows, self.descending(job.group))

    def descending(self, group: dict) -> bool:
        return group["eigenbasis_variant"] == "descending"

    def bases(self, stack, job, scratch: Scratch) -> list[Tensor | None]:
        """The quantised dims' bases are their factors' eigenvectors, dequantised once per
        step (no Björck step: the steady path stays elementwise)."""
        bases = super().bases(stack, job, scratch)
        for j in self.quantized_dims(stack, job.group):
            if j not in job.cache:
                job.cache[j] = self.eigenvectors(job.state, j, stack.shape[j])
            bases[j] = job.cache[j]
        return bases
