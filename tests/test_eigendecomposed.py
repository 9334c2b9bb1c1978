"""``preconditioner="eigendecomposed_shampoo"`` / ``"eigendecomposed_kl_shampoo"``
(preconditioners/eigendecomposed.py, docs/design.md §2–§3): with eigh they are Shampoo and
KL-Shampoo (the float64 reference); the roots are functions of the kept (Q, λ); Meta's QR
algorithm and criterion keep or refine the basis; bad combinations are refused."""

from __future__ import annotations

import pytest
import torch

from hf_shampoo import DistributedShampoo
from tests.helpers import F64, random_tensors, run_against_reference

pytestmark = [pytest.mark.unit, pytest.mark.device]

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
    # a (6,) vector's factor has rank t at step t, so with epsilon 1e-6 its condition is
    # ~1e7 and float64 rounding (the outer products are elementwise, the reference's are
    # matmuls) reaches ~1e-9 of the update
    rtol = 1e-8 if len(shape) == 1 else 1e-9
    run_against_reference(shape, {**BASE, "preconditioner": kind, **config}, steps=6,
                          reference_changes={"preconditioner": same_as}, rtol=rtol)


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
    ({"root_inverse": "coupled_newton"}, "root_inverse"),
    ({"diagonal_aspect": 4.0}, "diagonal_aspect"),
    ({"inv_factor_matrix_dtype": torch.bfloat16}, "inv_factor_matrix_dtype"),
])
def test_refused_combinations(changes, message):
    with pytest.raises(ValueError, match=message):
        DistributedShampoo([torch.nn.Parameter(torch.zeros(3, 4))],
                           preconditioner="eigendecomposed_shampoo", **changes)


def test_4bit_eigendecomposed_kl_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="quantization='4bit'.*KL-Shampoo's take every step"):
        DistributedShampoo([torch.nn.Parameter(torch.zeros(3, 4))], quantization="4bit",
                           preconditioner="eigendecomposed_kl_shampoo")


def _4bit_run(steps=12, **config):
    """A (64, 80) parameter (both factors large enough for 4 bits) and an (8, 6) one (merged
    into one 48-vector: a 32-bit factor)."""
    params = [torch.nn.Parameter(t) for t in (random_tensors((64, 80), 1, seed=3)[0].float(),
                                               random_tensors((8, 6), 1, seed=4)[0].float())]
    grads = [random_tensors(p.shape, steps, seed=5 + i) for i, p in enumerate(params)]
    # ε 1e-4: float32 roots of these few-gradient factors agree between kinds to round-off
    opt = DistributedShampoo(params, lr=0.01, grafting="adam", precondition_frequency=3,
                             quantization="4bit", epsilon=1e-4, **config)
    for t in range(steps):
        for p, g in zip(params, grads):
            p.grad = g[t].float()
        opt.step()
    return params, opt


def test_4bit_eigendecomposed_is_4bit_shampoo_with_the_eigh_refresh():
    """Without a tolerance both decompose every sampled factor by eigh: the same 4-bit
    state and the same parameters (the 32-bit (8, 6) block's roots from (Q, λ) agree with
    Shampoo's to round-off)."""
    ours, opt = _4bit_run(preconditioner="eigendecomposed_shampoo")
    theirs, _ = _4bit_run(preconditioner="shampoo")
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-4, atol=1e-5)
    state = opt.state_dict()["state"]
    assert "block_0.factor_eigenvectors_0_codes" in state[0]  # 4 bits for the 64 x 64 factor
    assert "block_0.eigenvectors_0" in state[1] and "block_0.eigenvalues_0" in state[1]


def test_4bit_eigendecomposed_criterion_keeps_valid_bases():
    """With a loose tolerance the kept (dequantised) basis is re-used: the stored 4-bit
    eigenvectors stay as they were at the first refresh; with a tight one they change."""
    def codes_after(steps, tolerance):
        _, opt = _4bit_run(steps, preconditioner="eigendecomposed_shampoo",
                           eigenbasis_tolerance=tolerance)
        return opt.state_dict()["state"][0]["block_0.factor_eigenvectors_0_codes"].clone()

    first = codes_after(3, 0.9)  # the first refresh: eigh
    assert torch.equal(codes_after(12, 0.9), first)
    assert not torch.equal(codes_after(12, 1e-6), first)


@pytest.mark.parametrize("config", [
    dict(preconditioner="eigendecomposed_kl_shampoo", eigendecomposition="qr",
         qr_max_iterations=2, eigenbasis_tolerance=0.05),
    dict(preconditioner="eigendecomposed_shampoo", epsilon=0.0,
         rank_deficient="pseudo_inverse", rank_rtol=None),
    dict(preconditioner="shampoo", root_inverse="coupled_higher_order"),
    dict(preconditioner="kl_shampoo", root_inverse="coupled_newton"),
    dict(preconditioner="eigendecomposed_shampoo", quantization="4bit",
         eigenbasis_tolerance=0.1, max_preconditioner_dim=64),
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
