"""Batched linear algebra of the amortized computation (docs/design.md §2–§3).

Everything here works on stacks of same-size symmetric matrices ``(n, d, d)``: symmetric
eigendecomposition with a float64 retry and a per-matrix fallback, the regularised and
pseudo-inverse roots, the symmetric product ``syrk``. Keeping an eigenbasis (the criterion,
the QR refreshes) is ``eigenbasis.py``, the coupled root iterations ``root_solvers.py``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0  # a forked child has none of the parent's pool threads: make its own


_thread = threading.local()


@contextmanager
def thread_count_untouched():
    """Within it, in the calling thread, ``per_matrix_threads`` computes the matrices in
    that thread with torch's thread count as it is. For a thread that runs beside training
    (``refresh_delay``'s worker): ``torch.set_num_threads`` from any thread sets the count
    of the whole process, the training thread's operators included."""
    _thread.untouched = True
    try:
        yield
    finally:
        _thread.untouched = False


def per_matrix_threads(fn: Callable, jobs: list[tuple[tuple[Tensor, ...], tuple[Tensor, ...]]]):
    """``fn(*inputs, *outputs)`` for every job ``(inputs, outputs)`` of stacks of matrices
    (``fn`` writes its results into the outputs), one matrix at a time on a pool of
    torch's intra-op thread count, each matrix single-threaded, largest matrices first.

    LAPACK's eigendecomposition and QR factorization scale poorly with threads (much of
    their work is matrix-vector); independent matrices on separate cores do better (on
    two cores, eigh of 1024² matrices is about 1.2× faster), and a pool that takes the
    next matrix when a core is free keeps both cores busy across stacks of different
    sizes. On CPU with more than one thread *every* matrix is computed single-threaded,
    also one alone in its stack, so a block's result never depends on which other blocks
    share its batch (bit-identity between a distributed run and one process). Exceptions
    are raised after all matrices are done.
    """
    global _pool, _pool_pid
    threads = torch.get_num_threads()
    if not jobs:
        return
    if threads == 1 or jobs[0][0][0].device.type != "cpu" or getattr(
            _thread, "untouched", False):
        for inputs, outputs in jobs:
            fn(*inputs, *outputs)
        return
    tasks = [(inputs[0].shape[-1], k, i) for k, (inputs, _) in enumerate(jobs)
             for i in range(inputs[0].shape[0])]
    tasks.sort(key=lambda task: -task[0])  # stable: largest first, then job and row order
    if _pool is None or _pool._max_workers != threads or _pool_pid != os.getpid():
        _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hf_shampoo")
        _pool_pid = os.getpid()
    torch.set_num_threads(1)
    try:
        futures = []
        for _, k, i in tasks:
            inputs, outputs = jobs[k]
            futures.append(_pool.submit(_single_threaded, fn,
                                        *(t[i : i + 1] for t in inputs + outputs)))
        for future in futures:
            future.exception()  # wait for all before raising any
        for future in futures:
            future.result()
    finally:
        torch.set_num_threads(threads)


def _single_threaded(fn: Callable, *args) -> None:
    torch.set_num_threads(1)
    fn(*args)


def finite_rows(tensor: Tensor) -> Tensor:
    """Per leading index: whether every element is finite.

    Fast path: a row whose sum is finite has no inf or NaN (they propagate through a
    sum); only rows whose sum is not finite (a non-finite value, or an overflow) are
    checked element by element. The answer never depends on the fast path.
    """
    rows = tensor.reshape(tensor.shape[0], -1)
    ok = torch.isfinite(rows.sum(dim=1))
    if not bool(ok.all()):
        ok = torch.isfinite(rows).all(dim=1)
    return ok


def all_finite(tensor: Tensor) -> bool:
    """Whether every element is finite (fast path as in ``finite_rows``)."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


@dataclass
class Eigh:
    """Eigenvalues ``(n, d)`` ascending, eigenvectors ``(n, d, d)`` and which succeeded."""

    eigenvalues: Tensor
    eigenvectors: Tensor
    ok: list[bool]


def _eigh_into(matrices: Tensor, values: Tensor, vectors: Tensor) -> None:
    # LAPACK works in place: torch copies the matrices into ``vectors`` (column-major)
    torch.linalg.eigh(matrices, out=(values, vectors))


def _retried(decompose: Callable, matrix: Tensor) -> tuple[Tensor, ...] | None:
    """``decompose(matrix)`` in the matrix's dtype, then in float64 (docs/design.md §2: the
    float64 retry), its results in the matrix's dtype; None if both raise or give
    non-finite values."""
    for dtype in dict.fromkeys((matrix.dtype, torch.float64)):
        try:
            results = decompose(matrix.to(dtype))
        except RuntimeError:  # torch.linalg.LinAlgError derives from RuntimeError
            continue
        if all(all_finite(t) for t in results):
            return tuple(t.to(matrix.dtype) for t in results)
    return None


def _eigh_one(matrix: Tensor) -> tuple[Tensor, ...] | None:
    """One matrix's ``(eigenvalues, eigenvectors)``, retried in float64; None if both fail."""
    return _retried(torch.linalg.eigh, matrix)


@dataclass
class Svd:
    """Left singular vectors ``(n, d, r)``, singular values ``(n, r)`` descending, and
    which matrices succeeded (failed ones hold zeros)."""

    u: Tensor
    s: Tensor
    ok: list[bool]


def batched_svd(matrices: Tensor) -> Svd:
    """The thin SVD of every matrix of a stack ``(n, d, c)``, each matrix single-threaded
    where torch has several threads (``per_matrix_threads``: a block's result does not
    depend on its stack). Where LAPACK raises for one of them, each matrix is decomposed
    on its own (own dtype, then float64), and matrices that still fail are reported in
    ``ok`` with zeros, so that the caller can keep its previous result for them."""
    n, d, c = matrices.shape
    r = min(d, c)
    u, s = matrices.new_empty(n, d, r), matrices.new_empty(n, r)
    try:
        per_matrix_threads(_svd_into, [((matrices,), (u, s, matrices.new_empty(n, r, c)))])
        return Svd(u, s, [True] * n)
    except RuntimeError:  # torch.linalg.LinAlgError derives from RuntimeError
        pass
    return Svd(u.zero_(), s.zero_(), _each(_svd_one, matrices, (u, s)))


def _svd_into(matrices: Tensor, u: Tensor, s: Tensor, vh: Tensor) -> None:
    torch.linalg.svd(matrices, full_matrices=False, out=(u, s, vh))


def _svd_one(matrix: Tensor) -> tuple[Tensor, ...] | None:
    """One matrix's thin SVD ``(U, S)``, retried in float64; None if both fail."""
    return _retried(lambda m: torch.linalg.svd(m, full_matrices=False)[:2], matrix)


def batched_eigh(matrices: Tensor, vectors_out: Tensor | None = None) -> Eigh:
    """Symmetric eigendecomposition of a stack (see ``batched_eigh_many``)."""
    return batched_eigh_many([matrices], [vectors_out])[0]


def batched_eigh_many(
    stacks: list[Tensor], vectors_out: list[Tensor | None] | None = None
) -> list[Eigh]:
    """Symmetric eigendecomposition of several stacks; a failed matrix falls back alone.

    All matrices are decomposed together first (``per_matrix_threads``). In a stack where
    one raises or returns non-finite values, each matrix is decomposed on its own (own
    dtype, then float64), and matrices that still fail are reported in ``ok`` with
    identity placeholders so the caller can keep its previous result for them.
    ``vectors_out``: memory of each stack's size (any layout) for its eigenvectors, which
    are returned column-major (a transposed view).
    """
    jobs = []
    for matrices, memory in zip(stacks, vectors_out or [None] * len(stacks)):
        n, d = matrices.shape[0], matrices.shape[-1]
        memory = matrices.new_empty(n, d, d) if memory is None else memory
        # The transposed view is column-major, as LAPACK wants it: torch's working copy is
        # then a plain copy, not a transposing one. For a symmetric matrix it is the same
        # matrix (LAPACK reads its lower triangle, i.e. the upper one of ``matrices``).
        jobs.append(((matrices.mT,), (matrices.new_empty(n, d), memory.view(n, d, d).mT)))
    try:
        per_matrix_threads(_eigh_into, jobs)
        raised = False
    except RuntimeError:  # torch.linalg.LinAlgError derives from RuntimeError
        raised = True
    results = []
    for matrices, (_, (values, vectors)) in zip(stacks, jobs):
        if not raised and all_finite(values) and all_finite(vectors):
            results.append(Eigh(values, vectors, [True] * matrices.shape[0]))
        else:
            results.append(_eigh_each(matrices))
    return results


def _eigh_each(matrices: Tensor) -> Eigh:
    n, d = matrices.shape[0], matrices.shape[-1]
    values = matrices.new_ones(n, d)
    vectors = torch.eye(d, dtype=matrices.dtype, device=matrices.device).repeat(n, 1, 1)
    return Eigh(values, vectors, _each(_eigh_one, matrices, (values, vectors)))


def _each(one: Callable, matrices: Tensor, outputs: tuple[Tensor, ...]) -> list[bool]:
    """``one`` (``_eigh_one``, ``_svd_one``) on each matrix of the stack alone, its results
    written into ``outputs`` row by row (a failed matrix's rows keep their placeholders);
    which succeeded."""
    ok = []
    for i in range(matrices.shape[0]):
        result = one(matrices[i])
        ok.append(result is not None)
        for out, value in zip(outputs, result or ()):
            out[i] = value
    return ok


def regularized_eigenvalues(eigenvalues: Tensor, epsilon: float) -> Tensor:
    """Eigenvalues of ``A + εI`` shifted by ``ε - λ_min`` where ``λ_min < ε`` (docs/design.md §2).

    In two roundings, ``(λ - λ_min) + ε``, as Meta does: the smallest becomes exactly ``ε``.
    One rounding, ``λ + (ε - λ_min)``, loses ε next to a negative round-off ``λ_min`` much
    larger than ε (float32, a large rank-deficient factor) and can leave an exact 0, whose
    inverse root is infinite."""
    smallest = eigenvalues.amin(dim=-1, keepdim=True)
    return torch.where(smallest < epsilon, (eigenvalues - smallest) + epsilon, eigenvalues)


def pseudo_inverse_cutoff(eigenvalues: Tensor, atol: float, rtol: float | None) -> Tensor:
    """Per matrix, the eigenvalue at or below which a pseudo-inverse root is 0 (docs/design.md
    §2): ``max(rtol * max(λ_max, 0), atol)``, with ``rtol=None`` meaning ``d * eps`` of the
    eigenvalues' dtype (``d`` eigenvalues per matrix), as ``torch.linalg.matrix_rank`` and
    Meta's ``PseudoInverseConfig``. Shape ``(..., 1)``."""
    if rtol is None:
        rtol = eigenvalues.shape[-1] * torch.finfo(eigenvalues.dtype).eps
    return (rtol * eigenvalues.amax(dim=-1, keepdim=True).relu()).clamp(min=atol)


def stabilized_eigenvalues(eigenvalues: Tensor, group: dict) -> tuple[Tensor, Tensor | None]:
    """What the inverse root of a factor is taken of, by the group's ``rank_deficient``:
    ``"perturbation"``: the ε-regularised eigenvalues and no cutoff; ``"pseudo_inverse"``:
    the eigenvalues as they are and the cutoff at or below which their inverse power is 0."""
    if group.get("rank_deficient", "perturbation") == "pseudo_inverse":
        return eigenvalues, pseudo_inverse_cutoff(eigenvalues, group["rank_atol"],
                                                  group["rank_rtol"])
    return regularized_eigenvalues(eigenvalues, group["epsilon"]), None


def drop_at_cutoff(inverse: Tensor, eigenvalues: Tensor, cutoff: Tensor | None) -> Tensor:
    """``inverse`` (a power of ``eigenvalues``) with 0 where ``λ <= cutoff``: the directions
    a pseudo-inverse drops (unchanged without a cutoff)."""
    if cutoff is None:
        return inverse
    return torch.where(eigenvalues <= cutoff, torch.zeros_like(inverse), inverse)


def inverse_power(eigenvalues: Tensor, exponent: float, cutoff: Tensor | None = None) -> Tensor:
    """``λ^(-exponent)``, 0 where ``λ <= cutoff`` (a pseudo-inverse's dropped directions)."""
    return drop_at_cutoff(power(eigenvalues, -exponent), eigenvalues, cutoff)


def power(values: Tensor, exponent: float, in_place: bool = False) -> Tensor:
    """``values ** exponent``, computed the same way wherever an element sits in the tensor.

    On CPU, ``pow`` takes a vectorised path for most elements and a scalar one for the
    tail, and the two can differ in the last bit; so a block's result would depend on how
    many blocks share its batch, breaking bit-equality between a distributed run and one
    process. Exponents ``±1/2^k`` (the defaults 1/2 and 1/4 among them) use chains of
    correctly rounded square roots and one division instead; other exponents are computed
    in float64 and rounded to ``values.dtype``, on CPU through a strided view, which
    ``pow`` never vectorises: every element takes the scalar path, wherever it sits (in
    float64 alone, a float64 ``pow`` would still differ between the two paths).
    ``in_place=True`` overwrites ``values`` (a scratch tensor) where it can.
    """
    magnitude, steps = abs(exponent), 0
    while magnitude < 1 and steps < 6:
        magnitude, steps = magnitude * 2, steps + 1
    if magnitude == 1:
        out = values
        for _ in range(steps):
            out = out.sqrt_() if in_place else out.sqrt()
            in_place = True  # later steps work on our own tensor
        if exponent < 0:
            return out.reciprocal_() if in_place else out.reciprocal()
        return out
    if values.device.type == "cpu":
        spread = torch.empty((*values.shape, 2), dtype=torch.float64, device="cpu")
        result = spread[..., 0].copy_(values).pow_(exponent)
    else:
        result = values.double().pow(exponent)
    return (values if in_place else torch.empty_like(values)).copy_(result)


# Below these sizes a symmetric product is one plain bmm (splitting it does not pay; the
# thresholds were measured on a 2-core AVX-512 CPU, see docs/benchmarks/step_time.md).
SYRK_MIN_DIM = 256
SYRK_MIN_INNER = 512


def syrk(out: Tensor, left: Tensor, beta: float = 0.0, alpha: float = 1.0) -> Tensor:
    """``out = beta·out + alpha·X Xᵀ`` (``X = left``, a stack ``(n, d, k)``), in place.

    BLAS's ``syrk`` computes one triangle of a symmetric product; torch has none. Here the
    product is cut into 2×2 blocks: the two diagonal blocks recursively, the upper-right
    one as a ``bmm``, and the lower-left one is its transpose; for ``d = 1024`` that is
    about 60% of the flops of a full ``bmm``. With ``beta = 0`` the old contents of
    ``out`` are ignored (NaNs included).
    """
    d, k = left.shape[-2], left.shape[-1]
    if k == 1:
        # outer products elementwise: a one-column ``baddbmm`` rounds differently in a
        # stack of one than in a larger stack on CPU (from d = 31 on), and the lossless
        # distributors stack only an owner's own blocks (docs/design.md §8)
        if beta == 0.0:
            torch.mul(left, left.mT, out=out)
            return out if alpha == 1.0 else out.mul_(alpha)
        return out.mul_(beta).addcmul_(left, left.mT, value=alpha)
    if d < SYRK_MIN_DIM or k < SYRK_MIN_INNER:
        return out.baddbmm_(left, left.mT, beta=beta, alpha=alpha)
    h = d // 2
    top, bottom = left[:, :h], left[:, h:]
    syrk(out[:, :h, :h], top, beta, alpha)
    out[:, :h, h:].baddbmm_(top, bottom.mT, beta=beta, alpha=alpha)
    syrk(out[:, h:, h:], bottom, beta, alpha)
    out[:, h:, :h].copy_(out[:, :h, h:].mT)
    return out


def inverse_root_from_eigen(
    eigenvalues: Tensor,
    eigenvectors: Tensor,
    exponent: float,
    out: Tensor | None = None,
    scratch: Tensor | None = None,
    cutoff: Tensor | None = None,
) -> Tensor:
    """``Q diag(λ^-e) Qᵀ = C Cᵀ`` with ``C = Q diag(λ^(-e/2))`` for a stack (eigenvalues
    already regularised, or with a pseudo-inverse ``cutoff``: ``λ <= cutoff`` contributes
    nothing), as a symmetric product. ``scratch`` (the stack's size, laid out like
    ``eigenvectors``) holds ``C``."""
    scales = inverse_power(eigenvalues, exponent / 2, cutoff).unsqueeze(-2)
    if scratch is None:
        scaled = eigenvectors * scales
    else:
        scaled = torch.mul(eigenvectors, scales, out=scratch)
    if out is None:
        out = torch.empty_like(scaled)
    return syrk(out, scaled)
