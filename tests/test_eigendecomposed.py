"""``preconditioner="eigendecomposed_shampoo"`` / ``"eigendecomposed_kl_shampoo"``
(preconditioners/eigendecomposed.py, docs/design.md §2–§3): with eigh they are Shampoo and
KL-Shampoo (the float64 reference); the roots are functions of the kept (Q, λ); Meta's QR
algorithm and criterion keep or refine the basis; bad combinations are refused."""

from __future__ import annotations

import pytest
import torch

from hf_shampoo import DistributedShampoo
from tests.helpers import F64, random_tensors, run_against_reference

BASE = {"lr": 0.05, "epsilon": 1e-6, "max_preconditioner_dim": 8, "precondition_frequency": 2}


@pytest.mark.parametrize("kind, same_as", [("eigendecomposed_shampoo", "shampoo"),
                                           ("eigendecomposed_kl_shampoo", "kl_shampoo")])
@pytest.mark.parametrize("shape, config", [
    pytest.param((4, 5), {}, id="2d"),
    pytest.param((3, 4, 5), {"max_preconditioner_dim": 5, "grafting": "adam"}, id="3d-adam"),
    pytest.param((6,), {}, id="1d"),
    pytest.param((3, 4, 5), {"max_preconditioner_dim": 5,
                             "inverse_exponent_override": {3: {1: 0.0}}}, id="3d-dim-off"),
    pytest.param((8, 5), {"epsilon": 0.0, "rank_deficient": "pseudo_inverse",
                          "rank_rtol": None}, id="pseudo-inverse"),
])
def test_with_eigh_it_is_the_root_kind(kind, same_as, shape, config):
    run_against_reference(shape, {**BASE, "preconditioner": kind, **config}, steps=6,
                          reference_changes={"preconditioner": same_as})


def _stepped(kind, steps=6, cycle=None, **config):
    """``steps`` steps on random gradients, or cycling through ``cycle`` of them."""
    p = torch.nn.Parameter(torch.zeros(6, 5, dtype=F64))
    opt = DistributedShampoo([p], factor_matrix_dtype=F64, preconditioner=kind,
                             **{**BASE, **config})
    grads = random_tensors((6, 5), cycle or steps, seed=3)
    for t in range(steps):
        p.grad = grads[t % len(grads)].clone()
        opt.step()
    return opt, opt._ensure_layout().owned[0].state


@pytest.mark.parametrize("config", [{}, {"eigendecomposition": "qr", "qr_max_iterations": 2},
                                    {"eigenbasis_tolerance": 0.2}])
def test_roots_are_the_kept_eigendecomposition_raised_to_the_exponent(config):
    """``I_j = Q diag((λ_j shifted)^(-1/4)) Qᵀ`` from the state's own ``(Q_j, λ_j)``; with
    eigh, ``Q diag(λ) Qᵀ = A_j + εI`` (A_j the bias-free factor, betas[1] = 1 here)."""
    _, state = _stepped("eigendecomposed_shampoo", **config)
    for j in range(2):
        q, lam = state[f"eigenvectors_{j}"][0], state[f"eigenvalues_{j}"][0]
        shifted = torch.where(lam.min() < 1e-6, lam - lam.min() + 1e-6, lam)
        expected = q @ torch.diag(shifted.pow(-0.25)) @ q.T
        torch.testing.assert_close(state[f"inverse_root_{j}"][0], expected, rtol=1e-12,
                                   atol=1e-12)
        torch.testing.assert_close(q.T @ q, torch.eye(q.shape[0], dtype=F64), atol=1e-12,
                                   rtol=0)
        if not config:  # an exact decomposition of the factor at the last refresh (step 6)
            factor = state[f"factor_matrix_{j}"][0]
            ridge = factor + 1e-6 * torch.eye(factor.shape[0], dtype=F64)
            torch.testing.assert_close(q @ torch.diag(lam) @ q.T, ridge, rtol=1e-10,
                                       atol=1e-10)


def test_qr_algorithm_run_long_enough_is_an_eigendecomposition():
    """Meta's QR algorithm from the identity, iterated until ``QᵀAQ`` is diagonal to the
    tolerance within one refresh, gives eigh's eigenvalues (ascending) and a basis that
    diagonalises the factor."""
    _, state = _stepped("eigendecomposed_shampoo", steps=2, eigendecomposition="qr",
                        qr_max_iterations=2000, eigenbasis_tolerance=1e-9)
    factor = state["factor_matrix_0"][0] + 1e-6 * torch.eye(6, dtype=F64)
    q, lam = state["eigenvectors_0"][0], state["eigenvalues_0"][0]
    torch.testing.assert_close(lam, torch.linalg.eigvalsh(factor), rtol=1e-8, atol=0)
    off = q.T @ factor @ q - torch.diag(lam)
    assert off.norm() <= 1e-8 * factor.norm()


@pytest.mark.parametrize(("changes", "message"), [
    ({"quantization": "4bit"}, "4-bit state exists for"),
    ({"root_inverse": "coupled_newton"}, "root_inverse"),
    ({"diagonal_aspect": 4.0}, "diagonal_aspect"),
    ({"inv_factor_matrix_dtype": torch.bfloat16}, "inv_factor_matrix_dtype"),
])
def test_refused_combinations(changes, message):
    with pytest.raises(ValueError, match=message):
        DistributedShampoo([torch.nn.Parameter(torch.zeros(3, 4))],
                           preconditioner="eigendecomposed_shampoo", **changes)


@pytest.mark.parametrize("config", [
    dict(preconditioner="eigendecomposed_kl_shampoo", eigendecomposition="qr",
         qr_max_iterations=2, eigenbasis_tolerance=0.05),
    dict(preconditioner="eigendecomposed_shampoo", epsilon=0.0,
         rank_deficient="pseudo_inverse", rank_rtol=None),
    dict(preconditioner="shampoo", root_inverse="coupled_higher_order"),
    dict(preconditioner="kl_shampoo", root_inverse="coupled_newton"),
])
def test_a_checkpoint_resumes_exactly(config):
    """state_dict() after 5 steps, loaded into a fresh optimizer: the next 5 steps are
    bit-identical to an uninterrupted run (eigenvalues, bases, roots all saved)."""
    grads = random_tensors((6, 5), 10, seed=7)

    def run(steps, params=None, opt=None, first=0):
        params = params or [torch.nn.Parameter(torch.ones(6, 5))]
        opt = opt or DistributedShampoo(params, **{**BASE, "grafting": "adam", **config})
        for t in range(first, first + steps):
            params[0].grad = grads[t].float()
            opt.step()
        return params, opt

    expected, _ = run(10)
    params, opt = run(5)
    fresh = [torch.nn.Parameter(params[0].detach().clone())]
    resumed = DistributedShampoo(fresh, **{**BASE, "grafting": "adam", **config})
    resumed.load_state_dict(opt.state_dict())
    run(5, fresh, resumed, first=5)
    assert torch.equal(fresh[0], expected[0])
