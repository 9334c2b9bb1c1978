"""Dense float64 reference of docs/design.md §1-§3 for one parameter: slow, plain loops,
no batching.

It is the independent reading of the spec that the optimizer is compared against; it
deliberately shares no code with ``hf_shampoo`` (its own blocking included).

Choices the spec leaves open, and what this reference does (Meta's
``distributed_shampoo`` is the tie-breaker where the spec is silent):

1.  Blocking (§1).  Merging walks the dims from last to first, keeping a running
    product of the current group and starting a new group when the next dim would push
    it above ``max_preconditioner_dim``.  Blocks produced by the split keep the order of
    the merged tensor even when a chunk has size 1 (a ``(1, 3)`` block is order 2 with a
    1x1 factor).
2.  ``inverse_exponent_override`` is keyed by the *block* order k (after merging); a dim
    not listed in a ``{dim: e}`` dict keeps the default ``1/(2k)``.  ``e = 0`` gives the
    identity for that dim (the factor is still accumulated, it is simply never used).
    Overrides are modelled for ``preconditioner="shampoo"`` and ``"kl_shampoo"``.
3.  The ε / λ_min rule (§2): ``L, V = eigh(A + εI)``; if ``min(L) < ε`` every eigenvalue
    is shifted by ``ε - min(L)``, as ``(L - min(L)) + ε`` (Meta's two roundings: the smallest
    is then exactly ε); ``I = V diag(L^-e) Vᵀ``.  With ``rank_deficient="pseudo_inverse"``
    (ε = 0): ``L, V = eigh(A)``, and an eigenvalue ``<= max(rtol max(L, 0), atol)``
    (``rtol=None``: ``len(L)`` float64 eps) contributes 0 instead of ``L^-e``.
4.  Eigenvalue correction (§3), as Meta's ``EigenvalueCorrectedShampooPreconditionerList``
    and ``matrix_functions.qr_algorithm`` compute it.  ``Q_j`` starts as the identity and
    every refresh works on ``A_j + εI`` (``A_j = F_j / bc2``).  ``eigh``: with τ > 0 the
    criterion ``‖B - diag(B)‖_F <= τ ‖B‖_F`` (``B = QᵀAQ``) is checked first, also against
    the identity at the first refresh, and keeps ``Q_j`` when it holds; otherwise ``Q_j``
    is eigh's eigenvectors in eigh's ascending order.  ``qr``: from the kept basis (the
    identity at the first refresh), ``B = QᵀAQ``; while fewer than ``qr_max_iterations``
    steps were taken and the criterion fails: ``Q', R = qr(B)``, ``B = R Q'``,
    ``Q = Q Q'``; then the columns are sorted by ascending ``diag(B)`` (stable).  ``D`` is
    never permuted or reset: its history is paired with the new columns as they come.
5.  Adam grafting always divides by its own ``1 - grafting_beta2**t`` (Meta's Adam
    grafting is built with bias correction on, independent of ``use_bias_correction``);
    RMSprop and AdaGrad grafting never do.
6.  ``beta3`` is ignored when ``beta1 == 0`` (then Ĝ = G).
7.  Weight decay uses the parameter value before this step's update; ``peak_lr`` is the
    ``lr`` given at construction; ``step(grad, lr=...)`` models a scheduler that changed
    the group's lr.
8.  The step counter ``t`` increments on every call, also when ``grad is None`` (then
    nothing else happens), as in Meta's per-group step counter.
9.  A non-finite ``A_j`` at a refresh raises ``RuntimeError`` before anything of the
    parameter is changed.  A failing ``eigh`` keeps the previous I_j / Q_j with a warning;
    the fourth failure in a row of the same factor raises.
10. ``schedule_offset`` (``refresh_schedule="staggered"``) delays the schedule: the
    refresh rule and the grafting-only phase read ``t - offset`` instead of ``t``.
11. KL-Shampoo (``preconditioner="kl_shampoo"``, Meta's ``RootInvKLShampooPreconditionerList``):
    roots as Shampoo; the statistics of factor ``j`` are built from the gradient multiplied
    along every other dim ``i`` by that dim's current inverse root ``I_i`` (before this
    step's refresh; the identity before the first).
12. ``eigenbasis_variant="descending"`` (our former reading of §3): the first refresh of a
    factor is ``eigh(A + εI)`` without the criterion; later ones check it on ``A``; every
    kept basis is sorted by descending eigenvalue (eigh's output flipped); QR steps are
    ``Q, _ = qr(A Q)`` on ``A`` (no εI), then a stable descending sort of ``diag(QᵀAQ)``
    with ``D`` permuted along that dim by the same permutation (not after 0 steps).
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch
from torch import Tensor

__all__ = ["ReferenceShampoo", "reference_block_slices", "reference_merged_shape"]


# ---------------------------------------------------------------- §1 blocking


def reference_merged_shape(shape: tuple[int, ...], max_dim: int) -> tuple[int, ...]:
    dims = [int(d) for d in shape if d != 1]
    if not dims:
        return (1,)
    merged = [dims[-1]]
    for d in reversed(dims[:-1]):
        if merged[0] * d <= max_dim:
            merged[0] *= d
        else:
            merged.insert(0, d)
    return tuple(merged)


def reference_block_slices(shape: tuple[int, ...], max_dim: int) -> list[tuple[slice, ...]]:
    """Slices into the merged view, row-major over the chunk grid."""
    merged = reference_merged_shape(shape, max_dim)
    per_dim = [
        [slice(start, min(start + max_dim, n)) for start in range(0, n, max_dim)] for n in merged
    ]
    return [tuple(combo) for combo in itertools.product(*per_dim)]


# ---------------------------------------------------------------- tensor helpers


def mode_product(x: Tensor, m: Tensor, j: int) -> Tensor:
    """y[..., a, ...] = sum_b m[a, b] x[..., b, ...]  (b at position j)."""
    return torch.tensordot(m, x, dims=([1], [j])).movedim(0, j)


def contract_all_but(g: Tensor, j: int) -> Tensor:
    gj = g.movedim(j, 0).reshape(g.shape[j], -1)
    return gj @ gj.T


def off_diagonal_ratio_small(b: Tensor, tol: float) -> bool:
    if tol == 0.0:
        return False  # τ = 0 always refreshes (§3)
    off = torch.linalg.norm(b - torch.diag(torch.diag(b)))
    return bool(off <= tol * torch.linalg.norm(b))


# ---------------------------------------------------------------- the reference


class _Block:
    def __init__(self, index: tuple[slice, ...], shape: tuple[int, ...]):
        self.index = index
        self.shape = shape
        k = len(shape)

        def z() -> Tensor:
            return torch.zeros(shape, dtype=torch.float64)

        self.factors = [torch.zeros(d, d, dtype=torch.float64) for d in shape]
        self.inv_roots = [torch.eye(d, dtype=torch.float64) for d in shape]
        self.bases = [torch.eye(d, dtype=torch.float64) for d in shape]
        self.has_basis = [False] * k
        self.failures = [0] * k
        self.corrected = z()  # D
        self.grafting = z()  # V
        self.filtered = z()  # M
        self.momentum = z()  # B


#: The settings the reference reads and the value each takes when a call leaves it out
#: (``test_reference_defaults_are_the_optimizers`` holds them equal to the keyword table's).
DEFAULTS: dict[str, Any] = {
    "lr": 1e-2, "betas": (0.9, 1.0), "beta3": None, "epsilon": 1e-12, "momentum": 0.0,
    "dampening": 0.0, "nesterov": False, "weight_decay": 0.0,
    "weight_decay_type": "decoupled", "use_bias_correction": True,
    "max_preconditioner_dim": 1024, "precondition_frequency": 1,
    "start_preconditioning_step": None, "preconditioner": "shampoo",
    "eigendecomposition": "eigh", "eigenbasis_tolerance": 0.0, "qr_max_iterations": 1,
    "eigenbasis_variant": "meta", "inverse_exponent_override": None, "grafting": None,
    "grafting_beta2": 0.999, "grafting_epsilon": 1e-8, "rank_deficient": "perturbation",
    "rank_atol": 0.0, "rank_rtol": 0.0,
}


class ReferenceShampoo:
    """One parameter's run: ``settings`` are the optimizer's keywords it models (``DEFAULTS``);
    ``name`` is used in errors; ``schedule_offset`` runs the refresh schedule that many steps
    late (``refresh_schedule="staggered"``; bias corrections still use the true step)."""

    def __init__(self, param: Tensor, name: str = "param", schedule_offset: int = 0,
                 **settings: Any):
        unknown = sorted(set(settings) - set(DEFAULTS))
        if unknown:
            raise TypeError(f"ReferenceShampoo does not model {unknown}")
        s = {**DEFAULTS, **settings}
        self.param = param.detach().clone().to(torch.float64)
        self.lr = self.peak_lr = s["lr"]
        self.beta1, self.beta2 = s["betas"]
        self.beta3 = self.beta1 if s["beta3"] is None else s["beta3"]
        self.eps = s["epsilon"]
        self.mu, self.dampening, self.nesterov = s["momentum"], s["dampening"], s["nesterov"]
        self.wd, self.wd_type = s["weight_decay"], s["weight_decay_type"]
        self.bias_correction = s["use_bias_correction"]
        self.f = s["precondition_frequency"]
        start = s["start_preconditioning_step"]
        self.s = self.f if start is None else start
        assert self.s >= self.f
        self.preconditioner = s["preconditioner"]
        self.eigendecomposition = s["eigendecomposition"]
        self.tol, self.qr_iters = s["eigenbasis_tolerance"], s["qr_max_iterations"]
        self.variant = s["eigenbasis_variant"]
        self.override = s["inverse_exponent_override"] or {}
        self.grafting_type = s["grafting"]
        self.gb2, self.geps = s["grafting_beta2"], s["grafting_epsilon"]
        self.name = name
        self.offset = schedule_offset
        # note 3: "pseudo_inverse" drops the eigenvalues at or below the rank cutoff
        self.pseudo_inverse = s["rank_deficient"] == "pseudo_inverse"
        self.rank_atol, self.rank_rtol = s["rank_atol"], s["rank_rtol"]
        max_preconditioner_dim = s["max_preconditioner_dim"]
        self.t = 0
        # counters, so that tests can check that a case exercises what it claims to
        self.stats = {"eigh": 0, "qr_steps": 0, "skipped": 0, "permuted": 0}

        self.merged_shape = reference_merged_shape(tuple(self.param.shape), max_preconditioner_dim)
        merged = self.param.reshape(self.merged_shape)
        self.blocks = [
            _Block(idx, tuple(merged[idx].shape))
            for idx in reference_block_slices(tuple(self.param.shape), max_preconditioner_dim)
        ]

    # ------------------------------------------------------------ pieces

    def exponents(self, k: int) -> list[float]:
        default = 1.0 / (2 * k)
        ov = self.override.get(k)
        if ov is None:
            return [default] * k
        if isinstance(ov, dict):
            return [float(ov.get(j, default)) for j in range(k)]
        return [float(ov)] * k

    def graft(self, x: Tensor, blk: _Block) -> Tensor:
        if self.grafting_type == "sgd":
            return x
        v_hat = blk.grafting
        if self.grafting_type == "adam":
            v_hat = v_hat / (1 - self.gb2**self.t)
        return x / (v_hat.sqrt() + self.geps)

    def _check_finite(self, a: Tensor, j: int) -> None:
        if not torch.isfinite(a).all():
            raise RuntimeError(
                f"non-finite factor matrix {j} of parameter {self.name!r} at step {self.t}"
            )

    def _eigh(self, a: Tensor, blk: _Block, j: int) -> tuple[Tensor, Tensor] | None:
        try:
            lam, vec = torch.linalg.eigh(a)
        except RuntimeError as exc:  # pragma: no cover - not exercised by the tests
            blk.failures[j] += 1
            if blk.failures[j] > 3:
                raise
            warnings.warn(f"eigh failed ({exc}); keeping the previous preconditioner", stacklevel=2)
            return None
        blk.failures[j] = 0
        return lam, vec

    def _refresh_shampoo(self, blk: _Block, bc2: float) -> None:
        exps = self.exponents(len(blk.shape))
        for j, fac in enumerate(blk.factors):
            a = fac / bc2
            self._check_finite(a, j)
            if exps[j] == 0.0:
                blk.inv_roots[j] = torch.eye(fac.shape[0], dtype=torch.float64)
                continue
            eye = torch.eye(a.shape[0], dtype=torch.float64)
            res = self._eigh(a + self.eps * eye, blk, j)
            if res is None:
                continue
            lam, vec = res
            if self.pseudo_inverse:
                rtol = (lam.numel() * torch.finfo(lam.dtype).eps if self.rank_rtol is None
                        else self.rank_rtol)
                cutoff = max(rtol * max(lam.max().item(), 0.0), self.rank_atol)
                inverse = [0.0 if v <= cutoff else v ** -exps[j] for v in lam.tolist()]
                blk.inv_roots[j] = vec @ torch.diag(torch.tensor(inverse, dtype=torch.float64)
                                                    ) @ vec.T
                continue
            lam_min = lam.min()
            if lam_min < self.eps:
                lam = (lam - lam_min) + self.eps
            blk.inv_roots[j] = vec @ torch.diag(lam.pow(-exps[j])) @ vec.T

    def _refresh_eigenbasis(self, blk: _Block, bc2: float) -> None:
        if self.variant == "descending":
            self._refresh_eigenbasis_descending(blk, bc2)
            return
        for j, fac in enumerate(blk.factors):
            a = fac / bc2
            self._check_finite(a, j)
            a_eps = a + self.eps * torch.eye(a.shape[0], dtype=torch.float64)
            q = blk.bases[j]
            if self.eigendecomposition == "eigh":
                if self.tol > 0 and off_diagonal_ratio_small(q.T @ a_eps @ q, self.tol):
                    self.stats["skipped"] += 1
                    continue
                res = self._eigh(a_eps, blk, j)
                if res is not None:
                    blk.bases[j] = res[1]  # eigh's ascending order (note 4)
                    self.stats["eigh"] += 1
                continue
            # Meta's QR algorithm in the rotated frame (note 4)
            b = q.T @ a_eps @ q
            steps = 0
            while steps < self.qr_iters and not off_diagonal_ratio_small(b, self.tol):
                qk, r = torch.linalg.qr(b)
                b = r @ qk
                q = q @ qk
                steps += 1
            self.stats["qr_steps"] += steps
            if steps == 0:
                self.stats["skipped"] += 1
            order = torch.sort(torch.diag(b), stable=True).indices
            if not torch.equal(order, torch.arange(len(order))):
                self.stats["permuted"] += 1
            blk.bases[j] = q[:, order]

    def _refresh_eigenbasis_descending(self, blk: _Block, bc2: float) -> None:
        """``eigenbasis_variant="descending"`` (note 12)."""
        for j, fac in enumerate(blk.factors):
            a = fac / bc2
            self._check_finite(a, j)
            a_eps = a + self.eps * torch.eye(a.shape[0], dtype=torch.float64)
            q = blk.bases[j]
            if not blk.has_basis[j]:
                res = self._eigh(a_eps, blk, j)
                if res is not None:
                    blk.bases[j] = res[1].flip(-1)  # descending, see note 4
                    blk.has_basis[j] = True
                    self.stats["eigh"] += 1
                continue
            if self.eigendecomposition == "eigh":
                if off_diagonal_ratio_small(q.T @ a @ q, self.tol):
                    self.stats["skipped"] += 1
                    continue
                res = self._eigh(a_eps, blk, j)
                if res is not None:
                    blk.bases[j] = res[1].flip(-1)
                    self.stats["eigh"] += 1
                continue
            # warm-started QR (§3)
            steps = 0
            while steps < self.qr_iters and not off_diagonal_ratio_small(q.T @ a @ q, self.tol):
                q, _ = torch.linalg.qr(a @ q)
                steps += 1
            self.stats["qr_steps"] += steps
            if steps == 0:
                self.stats["skipped"] += 1
                continue
            estimates = torch.diag(q.T @ a @ q)
            order = torch.sort(estimates, descending=True, stable=True).indices
            if not torch.equal(order, torch.arange(len(order))):
                self.stats["permuted"] += 1
            blk.bases[j] = q[:, order]
            blk.corrected = blk.corrected.index_select(j, order)

    def _rotate(self, x: Tensor, blk: _Block, transpose: bool) -> Tensor:
        for j, q in enumerate(blk.bases):
            x = mode_product(x, q.T if transpose else q, j)
        return x

    # ------------------------------------------------------------ one step

    @torch.no_grad()
    def step(self, grad: Tensor | None, lr: float | None = None) -> None:
        self.t += 1
        if grad is None:
            return
        if lr is not None:
            self.lr = lr
        t = self.t
        w_mat = self.param.reshape(self.merged_shape)
        g_mat = grad.detach().to(torch.float64).reshape(self.merged_shape)
        clock = t - self.offset  # the block's schedule clock (t unless staggered)
        amortized = (clock % self.f == 0 and clock > self.s) or clock == self.s
        b1, b2, b3 = self.beta1, self.beta2, self.beta3
        w = 1.0 if b2 == 1 else 1.0 - b2
        bc2 = 1.0 - b2**t if (self.bias_correction and b2 < 1) else 1.0

        updates = []
        for blk in self.blocks:
            W = w_mat[blk.index].clone()
            G = g_mat[blk.index].clone()
            # 1  L2
            if self.wd and self.wd_type == "l2":
                G = G + self.wd * W
            # 2  factor matrices, amortized part, eigenvalue correction
            statistics = [G] * len(blk.shape)
            if self.preconditioner == "kl_shampoo":  # note 11: the other dims' roots
                statistics = []
                for j in range(len(blk.shape)):
                    X = G
                    for i, root in enumerate(blk.inv_roots):
                        if i != j:
                            X = mode_product(X, root, i)
                    statistics.append(X)
            for j in range(len(blk.shape)):
                blk.factors[j] = b2 * blk.factors[j] + w * contract_all_but(statistics[j], j)
            if amortized:
                if self.preconditioner in ("shampoo", "kl_shampoo"):
                    self._refresh_shampoo(blk, bc2)
                else:
                    self._refresh_eigenbasis(blk, bc2)
            if self.preconditioner == "eigenvalue_corrected":
                R = self._rotate(G, blk, transpose=True)
                blk.corrected = b2 * blk.corrected + w * R.square()
            # 3  grafting state
            if self.grafting_type == "adagrad":
                blk.grafting = blk.grafting + G.square()
            elif self.grafting_type in ("rmsprop", "adam"):
                blk.grafting = self.gb2 * blk.grafting + (1 - self.gb2) * G.square()
            # 4  filtered gradient
            if b1 > 0:
                if b3 != b1:
                    G_hat = torch.lerp(blk.filtered, G, 1 - b3)
                    bc1 = 1 - b3 * b1 ** (t - 1)
                else:
                    G_hat = None
                    bc1 = 1 - b1**t
                blk.filtered = b1 * blk.filtered + (1 - b1) * G
                if G_hat is None:
                    G_hat = blk.filtered
                if self.bias_correction:
                    G_hat = G_hat / bc1
            else:
                G_hat = G
            # 5  direction
            if clock < self.s and self.grafting_type is not None:
                P = self.graft(G_hat, blk)
            else:
                if self.preconditioner in ("shampoo", "kl_shampoo"):
                    P = G_hat
                    for j, inv in enumerate(blk.inv_roots):
                        P = mode_product(P, inv, j)
                else:
                    X = self._rotate(G_hat, blk, transpose=True)
                    X = X / ((blk.corrected / bc2).sqrt() + self.eps)
                    P = self._rotate(X, blk, transpose=False)
                if self.grafting_type is not None:
                    gnorm = torch.linalg.norm(self.graft(G_hat, blk))
                    P = P * gnorm / (torch.linalg.norm(P) + 1e-16)
            # 6  decoupled weight decay
            if self.wd and self.wd_type != "l2":
                alpha = {
                    "decoupled": self.wd,
                    "corrected": self.wd * self.lr / self.peak_lr,
                    "independent": self.wd / self.peak_lr,
                }[self.wd_type]
                P = P + alpha * W
            # 7  classic momentum
            if self.mu > 0:
                blk.momentum = self.mu * blk.momentum + (1 - self.dampening) * P
                if self.nesterov:
                    P = (1 - self.dampening) * P + self.mu * blk.momentum
                else:
                    P = blk.momentum
            updates.append((blk.index, P))
        # 8  apply (only now, so a raise above leaves the parameter untouched)
        new = w_mat.clone()
        for index, P in updates:
            new[index] = new[index] - self.lr * P
        self.param = new.reshape(self.param.shape)
