"""``root_inverse="coupled_newton"`` / ``"coupled_higher_order"`` (hf_shampoo/root_solvers.py,
docs/design.md §2): the iterations against exact roots, per-matrix stopping inside a batch,
failures, and the optimizer against the float64 eigh reference."""

from __future__ import annotations

import pytest
import torch

from hf_shampoo import DistributedShampoo, root_solvers
from tests.helpers import F64, TEST_DEVICE, generator, run_against_reference

pytestmark = [pytest.mark.unit, pytest.mark.device]


def _spd(n: int, d: int, seed: int, spread: float = 1e3) -> torch.Tensor:
    """Random symmetric positive definite matrices with eigenvalues in [1, spread]."""
    g = generator(seed)
    q, _ = torch.linalg.qr(torch.randn(n, d, d, generator=g, dtype=F64))
    values = torch.logspace(0, torch.log10(torch.tensor(spread)).item(), d, dtype=F64)
    return (q * values) @ q.mT


def _exact(a: torch.Tensor, p: int, ridge: float = 0.0) -> torch.Tensor:
    values, vectors = torch.linalg.eigh(a + ridge * torch.eye(a.shape[-1], dtype=a.dtype))
    return (vectors * values.pow(-1.0 / p)[..., None, :]) @ vectors.mT


@pytest.mark.parametrize("p", [2, 4, 6])
def test_coupled_newton_converges_to_the_inverse_root(p):
    a = _spd(3, 7, seed=p)
    x, ok = root_solvers.coupled_newton(a, p, epsilon=1e-6, tolerance=1e-13, max_iterations=200)
    assert ok.all()
    exact = _exact(a, p, 1e-6)
    assert ((x - exact).norm(dim=(-2, -1)) / exact.norm(dim=(-2, -1))).max() < 1e-10


@pytest.mark.parametrize("order", [2, 3, 5])
def test_coupled_higher_order_converges_to_the_inverse_root(order):
    a = _spd(3, 7, seed=order)
    x, ok = root_solvers.coupled_higher_order(a, 4, rel_epsilon=0.0, abs_epsilon=1e-6,
                                              tolerance=1e-13, order=order)
    assert ok.all()
    exact = _exact(a, 4, 1e-6)
    assert ((x - exact).norm(dim=(-2, -1)) / exact.norm(dim=(-2, -1))).max() < 1e-10


@pytest.mark.parametrize("solver", ["newton", "higher"])
def test_each_matrix_stops_on_its_own_inside_a_batch(solver):
    """A well-conditioned matrix converges in fewer steps than an ill-conditioned one; in
    one batch each gets exactly what it gets alone (Meta iterates each matrix on its own)."""
    a = torch.cat([_spd(1, 6, seed=1, spread=2.0), _spd(1, 6, seed=2, spread=1e6),
                   _spd(1, 6, seed=3, spread=50.0)])

    def run(m):
        if solver == "newton":
            return root_solvers.coupled_newton(m, 4, epsilon=1e-9, tolerance=1e-9)
        return root_solvers.coupled_higher_order(m, 4, 0.0, 1e-9, tolerance=1e-9)

    together, ok = run(a)
    assert ok.all()
    # a GPU's batched products may round differently from single ones
    rtol = 1e-13 if TEST_DEVICE.type == "cpu" else 1e-9
    for i in range(3):
        alone, _ = run(a[i:i + 1])
        torch.testing.assert_close(together[i], alone[0], rtol=rtol, atol=0)


def test_failures_are_flagged_per_matrix():
    a = _spd(3, 5, seed=0)
    a[1, 0, 0] = float("nan")
    _, ok = root_solvers.coupled_newton(a, 4, epsilon=1e-6)
    assert ok.tolist() == [True, False, True]
    # a singular matrix without a ridge: the higher-order result misses A X^p = I
    singular = torch.zeros(2, 4, 4, dtype=F64)
    singular[:, 0, 0] = 1.0
    singular[1] = torch.eye(4, dtype=F64)
    _, ok = root_solvers.coupled_higher_order(singular, 2, 0.0, 0.0)
    assert ok.tolist() == [False, True]


NEWTON = {"lr": 0.1, "epsilon": 1e-6, "max_preconditioner_dim": 8,
          "root_inverse": "coupled_newton", "root_tolerance": 1e-13, "root_max_iterations": 200}


@pytest.mark.parametrize("solver", [{}, {"root_inverse": "coupled_higher_order",
                                         "root_order": 4}])
@pytest.mark.parametrize(
    "shape, config",
    [
        pytest.param((4, 5), {}, id="2d"),
        pytest.param((3, 4, 5), {"max_preconditioner_dim": 5, "grafting": "adam"}, id="3d-adam"),
        pytest.param((6,), {"precondition_frequency": 2}, id="1d-f2"),
        pytest.param((4, 5), {"preconditioner": "kl_shampoo"}, id="kl"),
        pytest.param((3, 4, 5), {"max_preconditioner_dim": 5,
                                 "inverse_exponent_override": {3: {1: 0.0, 2: 0.5}}},
                     id="3d-override"),
    ],
)
def test_optimizer_with_coupled_roots_equals_the_eigh_reference(solver, shape, config):
    """Run to a tight tolerance, the coupled roots are the eigh roots: the optimizer
    follows the float64 reference (which takes eigh) step by step (to 1e-7: the iterations
    stop on ``max|M - I|``, and rank-deficient factors, cond ~ 1/epsilon, amplify that)."""
    run_against_reference(shape, {**NEWTON, **solver, **config}, steps=6, rtol=1e-7,
                          ours_only=("root_inverse", "root_tolerance", "root_max_iterations",
                                     "root_order"))


def test_a_failed_root_keeps_the_previous_one_and_warns():
    p = torch.nn.Parameter(torch.zeros(4, 3, dtype=F64))
    opt = DistributedShampoo([p], lr=0.1, root_inverse="coupled_higher_order",
                             root_abs_epsilon=0.0, max_preconditioner_dim=8,
                             factor_matrix_dtype=F64)
    g = generator(0)
    p.grad = torch.randn(4, 3, generator=g, dtype=F64)
    with pytest.warns(UserWarning, match=r"inverse root \(coupled_higher_order\).*failed"):
        opt.step()  # rank-1 factors without a ridge: the iteration cannot meet A X^p = I
    assert torch.isfinite(p).all()


@pytest.mark.parametrize(("changes", "message"), [
    ({"root_inverse": "newton"}, "root_inverse"),
    ({"root_order": 1}, "root_order"),
    ({"root_max_iterations": 0}, "root_max_iterations"),
    ({"root_tolerance": -1.0}, "root_tolerance"),
    ({"root_rel_epsilon": -1.0}, "root_rel_epsilon"),
    ({"root_inverse": "coupled_newton", "preconditioner": "eigenvalue_corrected"},
     "root_inverse='coupled_newton'"),
    ({"root_inverse": "coupled_newton", "eigendecomposition": "qr"}, "eigendecomposition"),
    ({"root_inverse": "coupled_newton", "quantization": "4bit"}, "quantization"),
    ({"root_inverse": "coupled_newton", "rank_deficient": "pseudo_inverse", "epsilon": 0.0},
     "rank_deficient"),
    ({"root_inverse": "coupled_newton", "inverse_exponent_override": {2: 0.3}},
     "1/p for an integer p"),
])
def test_bad_root_solver_settings_are_refused(changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        DistributedShampoo([torch.nn.Parameter(torch.zeros(3, 4))], **changes)


def test_refresh_benchmark_prints_every_solver(capsys):
    """benchmarks/root_solvers.py at toy size: one row per solver, all accurate."""
    from benchmarks import root_solvers as bench

    bench.main(["--model", "gpt2-tiny", "--rounds", "1", "--threads", "1",
                "--device", str(TEST_DEVICE)])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0][2:] for r in rows[1:]] == list(bench.SOLVERS)
    assert all(float(r.split(" | ")[3].rstrip(" |")) < 1e-3 for r in rows[1:])
