"""Inverse roots by coupled iterations, matrix products only (docs/design.md §2): the
``root_inverse="coupled_newton"`` and ``"coupled_higher_order"`` alternatives to ``eigh``.

Both take a stack ``A`` of symmetric positive semi-definite matrices ``(n, d, d)`` and an
integer root ``p`` and return ``X ≈ A^(-1/p)`` per matrix with a flag per matrix saying
whether it can be used. They follow Meta's ``matrix_inverse_root_newton`` and
``matrix_inverse_root_higher_order`` (``CoupledNewtonConfig``, ``CoupledHigherOrderConfig``)
step for step, for every matrix on its own: a matrix stops iterating when its own error
test says so, while the others go on, batched (one ``bmm`` per product for the matrices
still iterating).

- **Coupled Newton**: ``A ← A + εI``, ``z = (p + 1) / (2‖A‖_F)``, ``X = z^(1/p) I``,
  ``M = z A``; while ``max|M − I| > tolerance`` and fewer than ``max_iterations`` steps:
  ``M' = (1 + 1/p) I − M / p``, ``X ← X M'``, ``M ← M'^p M``. A matrix that reaches the
  iteration limit is used as it is (Meta warns).
- **Coupled higher order** (order ``o >= 2``; 2 is Newton): the ridge is
  ``max(rel_epsilon · ‖A‖_∞, abs_epsilon)``, ``z = 1 / trace(A)``; one Newton step, then
  steps with ``M' = Σ_i b_i (I − M)^i`` (Horner; Lakić's coefficients
  ``b_i = Π_{k<i} (1 + k p) / (i! p^i)``), stopping at the tolerance, at the limit, or
  early when the error grows by more than 1.2× or stalls below 1e-3 (that step is kept,
  as Meta keeps it). A matrix whose ``max|A X^p − I|`` exceeds 0.1 is a failure (Meta
  raises; here its previous root is kept, as for a failed ``eigh``).

A failure is also any non-finite result. tf32 matmuls are off during the higher-order
iteration, as Meta does by default.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from .linalg import power

# Meta's defaults (CoupledNewtonConfig, CoupledHigherOrderConfig)
NEWTON_TOLERANCE = 1e-6
HIGHER_ORDER_TOLERANCE = 1e-8
MAX_TRUE_ERROR = 0.1  # Meta's threshold on max|A X^p - I| of the higher-order result


def _max_abs_minus_identity(m: Tensor) -> Tensor:
    """``max |M − I|`` per matrix (torch.dist(M, I, p=inf) of each)."""
    eye = torch.eye(m.shape[-1], dtype=m.dtype, device=m.device)
    return (m - eye).abs().amax(dim=(-2, -1))


def _power(m: Tensor, p: int) -> Tensor:
    return torch.linalg.matrix_power(m, p)


def coupled_newton(a: Tensor, p: int, epsilon: float, max_iterations: int = 100,
                   tolerance: float = NEWTON_TOLERANCE) -> tuple[Tensor, Tensor]:
    """``(X, ok)``: ``X ≈ (A + εI)^(-1/p)`` per matrix of the stack ``a`` (not changed)."""
    d = a.shape[-1]
    eye = torch.eye(d, dtype=a.dtype, device=a.device)
    ridge = a + epsilon * eye if epsilon != 0 else a.clone()
    alpha = -1.0 / p
    z = (p + 1) / (2 * torch.linalg.matrix_norm(ridge))  # Frobenius, per matrix
    x = power(z, -alpha)[:, None, None] * eye  # the same bits for any stack size
    m = z[:, None, None] * ridge
    error = _max_abs_minus_identity(m)
    active = error > tolerance
    for _ in range(max_iterations):
        rows = active.nonzero().flatten()
        if len(rows) == 0:
            break
        m_rows = m[rows]
        step = m_rows * alpha + eye * (1 - alpha)
        x[rows] = torch.bmm(x[rows], step)
        m_rows = torch.bmm(_power(step, p), m_rows)
        m[rows] = m_rows
        error[rows] = _max_abs_minus_identity(m_rows)
        active[rows] = error[rows] > tolerance
    return x, torch.isfinite(x).flatten(1).all(dim=1)


def _lakic_coefficients(p: int, order: int) -> list[float]:
    b, num, den = [1.0], 1, 1
    for i in range(1, order):
        num *= 1 + (i - 1) * p
        den *= i * p
        b.append(num / den)
    return b


@contextlib.contextmanager
def _no_tf32():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def coupled_higher_order(a: Tensor, p: int, rel_epsilon: float, abs_epsilon: float,
                         max_iterations: int = 100, tolerance: float = HIGHER_ORDER_TOLERANCE,
                         order: int = 3) -> tuple[Tensor, Tensor]:
    """``(X, ok)``: ``X ≈ (A + ridge·I)^(-1/p)`` per matrix of the stack ``a`` (not changed)."""
    with _no_tf32():
        return _higher_order(a, p, rel_epsilon, abs_epsilon, max_iterations, tolerance, order)


def _higher_order(a, p, rel_epsilon, abs_epsilon, max_iterations, tolerance, order):
    d = a.shape[-1]
    eye = torch.eye(d, dtype=a.dtype, device=a.device)
    b = _lakic_coefficients(p, order)
    s = -1.0 / p
    lambda_max = torch.linalg.matrix_norm(a, ord=float("inf"))  # max row sum, per matrix
    finite_input = torch.isfinite(lambda_max)
    ridge_size = torch.clamp(lambda_max * rel_epsilon, min=abs_epsilon)
    ridge = a + ridge_size[:, None, None] * eye
    z = torch.reciprocal(ridge.diagonal(dim1=-2, dim2=-1).sum(-1))
    x = power(z, -s)[:, None, None] * eye
    m = z[:, None, None] * ridge
    # one Newton step first (it guarantees the convergence of the higher-order steps)
    step = m * s + eye * (1 - s)
    x = torch.bmm(x, step)
    m = torch.bmm(_power(step, p), m)
    error = _max_abs_minus_identity(m)
    active = error > tolerance
    for _ in range(max_iterations - 1):
        rows = active.nonzero().flatten()
        if len(rows) == 0:
            break
        m_rows = m[rows]
        base = eye - m_rows
        step = base * b[order - 1] + eye * b[order - 2]
        for i in reversed(range(order - 2)):
            step = torch.baddbmm(eye.expand_as(step), step, base, beta=b[i])
        x[rows] = torch.bmm(x[rows], step)
        m_rows = torch.bmm(_power(step, p), m_rows)
        m[rows] = m_rows
        new_error = _max_abs_minus_identity(m_rows)
        old_error = error[rows]
        stop = (new_error > old_error * 1.2) | ((new_error == old_error) & (old_error < 1e-3))
        error[rows] = torch.where(stop, old_error, new_error)
        active[rows] = ~stop & (new_error > tolerance)
    true_error = _max_abs_minus_identity(torch.bmm(ridge, _power(x, p)))
    ok = finite_input & (true_error <= MAX_TRUE_ERROR) & torch.isfinite(x).flatten(1).all(dim=1)
    return x, ok
