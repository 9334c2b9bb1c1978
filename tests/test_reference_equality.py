"""The optimizer equals the dense float64 reference (tests/reference_shampoo.py) step by step.

docs/design.md §1 (blocking), §2 (one step), §3 (eigenvalue correction, QR refresh).
"""

import pytest
import torch

from hf_shampoo import config
from tests.helpers import F64, generator, random_tensors, run_against_reference
from tests.reference_shampoo import DEFAULTS, ReferenceShampoo

pytestmark = [pytest.mark.reference, pytest.mark.device]

# max_preconditioner_dim=8 keeps (4, 5)-like parameters 2-D (the default 1024 would merge them)
BASE = {"lr": 0.1, "epsilon": 1e-6, "max_preconditioner_dim": 8}


# ------------------------------------------------------------ the reference itself


def test_reference_defaults_are_the_optimizers():
    """A setting a test leaves out means the same on both sides: the reference's defaults
    are the keyword table's (the reference shares no code with the package, so it keeps its
    own copy)."""
    assert {k: config.TABLE[k].default for k in DEFAULTS} == DEFAULTS
    with pytest.raises(TypeError, match="does not model"):
        ReferenceShampoo(torch.zeros(2), refresh_delay=1)


def test_reference_first_step_closed_form():
    """One 2-D Shampoo step from zero state: L^-1/4 G R^-1/4 = U diag(s / sqrt(s² + ε)) Vᵀ."""
    (w0, g) = random_tensors((4, 4), 2, seed=3)
    eps = 1e-3
    ref = ReferenceShampoo(w0, lr=0.5, betas=(0.0, 1.0), epsilon=eps, max_preconditioner_dim=4)
    ref.step(g)
    u, s, vh = torch.linalg.svd(g)
    expected = w0 - 0.5 * (u * (s / (s**2 + eps).sqrt())) @ vh
    torch.testing.assert_close(ref.param, expected, rtol=1e-10, atol=1e-12)


def test_reference_matches_torch_adam_without_preconditioning():
    (w0,) = random_tensors((3, 4), 1, seed=4)
    grads = random_tensors((3, 4), 5, seed=5)
    ref = ReferenceShampoo(
        w0,
        lr=0.05,
        betas=(0.9, 1.0),
        precondition_frequency=100,
        grafting="adam",
        grafting_beta2=0.99,
        grafting_epsilon=1e-8,
    )
    p = torch.nn.Parameter(w0.clone())
    adam = torch.optim.Adam([p], lr=0.05, betas=(0.9, 0.99), eps=1e-8)
    for g in grads:
        ref.step(g)
        p.grad = g.clone()
        adam.step()
    torch.testing.assert_close(ref.param, p.detach(), rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------ blocking and orders


@pytest.mark.parametrize(
    ("shape", "config"),
    [
        pytest.param((5, 4), {}, id="2d-single-block"),
        pytest.param((4, 4), {"betas": (0.0, 1.0)}, id="2d-no-filtering"),
        pytest.param((3, 4, 5), {"max_preconditioner_dim": 5}, id="3d-block"),
        pytest.param((4, 2, 3, 3), {"max_preconditioner_dim": 18}, id="merged-conv-4x18"),
        pytest.param((2, 3, 4), {"max_preconditioner_dim": 12}, id="merged-2x12"),
        pytest.param((7, 5), {"max_preconditioner_dim": 3}, id="split-7x5-by-3"),
        pytest.param((6,), {}, id="1d"),
        pytest.param((10,), {"max_preconditioner_dim": 4}, id="1d-split"),
        pytest.param((6, 4), {"max_preconditioner_dim": 1024}, id="2d-merged-to-1d"),
        pytest.param((), {}, id="0d"),
        pytest.param((1, 5, 1, 3), {"max_preconditioner_dim": 4}, id="size-1-dims"),
    ],
)
def test_blocking_and_orders(shape, config):
    run_against_reference(shape, {**BASE, **config}, steps=5)


# ------------------------------------------------------------ grafting and schedule


@pytest.mark.parametrize("grafting", ["sgd", "adagrad", "rmsprop", "adam"])
def test_grafting(grafting):
    config = {
        **BASE,
        "grafting": grafting,
        "precondition_frequency": 2,
        "start_preconditioning_step": 2,
        "grafting_beta2": 0.9,
        "grafting_epsilon": 1e-3,
    }
    run_against_reference((5, 4), config, steps=5)


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(
            {"precondition_frequency": 3, "start_preconditioning_step": 6, "grafting": "adam"},
            id="f3-s6-adam-grafting",
        ),
        pytest.param(
            {"precondition_frequency": 2, "start_preconditioning_step": 5},
            id="f2-s5-identity-before-first-refresh",
        ),
        pytest.param({"precondition_frequency": 4}, id="f4-s-default"),
    ],
)
def test_amortized_schedule(config):
    run_against_reference((4, 5), {**BASE, **config}, steps=10)


# ------------------------------------------------------------ betas, beta3, bias correction


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({"betas": (0.9, 0.99)}, id="beta2<1"),
        pytest.param({"betas": (0.5, 1.0)}, id="beta2=1"),
        pytest.param({"betas": (0.0, 0.95)}, id="beta1=0"),
        pytest.param({"betas": (0.9, 0.99), "beta3": 0.5}, id="beta3<beta1"),
        pytest.param({"betas": (0.8, 1.0), "beta3": 0.95}, id="beta3>beta1"),
        pytest.param({"betas": (0.9, 0.99), "use_bias_correction": False}, id="no-bias-corr"),
        pytest.param(
            {"betas": (0.9, 0.99), "beta3": 0.7, "use_bias_correction": False},
            id="no-bias-corr-beta3",
        ),
        pytest.param(
            {
                "betas": (0.9, 0.99),
                "use_bias_correction": False,
                "grafting": "adam",
                "precondition_frequency": 2,
                "start_preconditioning_step": 4,
            },
            id="no-bias-corr-adam-grafting",
        ),
    ],
)
def test_betas_and_bias_correction(config):
    run_against_reference((4, 5), {**BASE, **config}, steps=6)


# ------------------------------------------------------------ weight decay and momentum

LRS = [0.1, 0.1, 0.05, 0.02, 0.2, 0.07]  # a scheduler changes the group's lr (peak_lr = 0.1)


@pytest.mark.parametrize("wd_type", ["l2", "decoupled", "corrected", "independent"])
def test_weight_decay(wd_type):
    config = {**BASE, "weight_decay": 0.3, "weight_decay_type": wd_type, "grafting": "rmsprop"}
    run_against_reference((4, 3), config, lrs=LRS, steps=len(LRS))


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({"momentum": 0.9}, id="momentum"),
        pytest.param({"momentum": 0.9, "dampening": 0.3}, id="momentum-dampening"),
        pytest.param({"momentum": 0.8, "nesterov": True}, id="nesterov"),
        pytest.param(
            {"momentum": 0.8, "dampening": 0.1, "nesterov": True}, id="nesterov-dampening"
        ),
        pytest.param(
            {
                "momentum": 0.5,
                "weight_decay": 0.1,
                "grafting": "adagrad",
                "precondition_frequency": 2,
            },
            id="momentum-wd-grafting",
        ),
    ],
)
def test_momentum(config):
    run_against_reference((3, 5), {**BASE, **config}, steps=6)


# ------------------------------------------------------------ inverse_exponent_override


@pytest.mark.parametrize(
    ("shape", "config"),
    [
        pytest.param((4, 5), {"inverse_exponent_override": {2: 0.3}}, id="2d-all-dims"),
        pytest.param((4, 5), {"inverse_exponent_override": {2: {0: 0.0}}}, id="2d-dim0-off"),
        pytest.param((4, 5), {"inverse_exponent_override": {2: {1: 0.5}}}, id="2d-dim1-only"),
        pytest.param((4, 5), {"inverse_exponent_override": {1: 0.1}}, id="other-order-unused"),
        pytest.param((6,), {"inverse_exponent_override": {1: 0.25}}, id="1d"),
        pytest.param(
            (3, 4, 5),
            {"max_preconditioner_dim": 5, "inverse_exponent_override": {3: {1: 0.0, 2: 0.2}}},
            id="3d-mixed",
        ),
    ],
)
def test_inverse_exponent_override(shape, config):
    run_against_reference(shape, {**BASE, **config}, steps=4)


# ------------------------------------------------------------ eigenvalue correction (§3)

EC = {
    "lr": 0.05,
    "betas": (0.9, 0.99),
    "epsilon": 1e-8,
    "preconditioner": "eigenvalue_corrected",
    "precondition_frequency": 1,
    "start_preconditioning_step": 3,
    "max_preconditioner_dim": 8,
}


@pytest.mark.parametrize(
    ("shape", "config", "expect"),
    [
        pytest.param((4, 5), {}, {}, id="eigh"),
        pytest.param((4, 5), {"betas": (0.9, 1.0)}, {}, id="eigh-beta2=1"),
        pytest.param(
            (4, 5),
            {"betas": (0.0, 0.9), "use_bias_correction": False},
            {},
            id="eigh-no-filtering-no-bias-corr",
        ),
        pytest.param((3, 4, 5), {"max_preconditioner_dim": 5}, {}, id="eigh-3d"),
        pytest.param(
            (7, 5),
            {"max_preconditioner_dim": 4, "start_preconditioning_step": 5},
            {},
            id="eigh-split",
        ),
        pytest.param(
            (4, 5),
            {"grafting": "adam", "precondition_frequency": 2, "start_preconditioning_step": 4},
            {},
            id="eigh-adam-grafting",
        ),
        pytest.param((4, 5), {"momentum": 0.5, "weight_decay": 0.1}, {}, id="eigh-momentum-wd"),
        pytest.param(
            (4, 5),
            {"eigenbasis_tolerance": 0.12},
            {"skipped": True, "eigh": 3},
            id="eigh-tolerance",
        ),
        pytest.param((4, 5), {"eigendecomposition": "qr"}, {"qr_steps": True}, id="qr-1-iter-tol0"),
        pytest.param(
            (4, 5),
            {"eigendecomposition": "qr", "qr_max_iterations": 4},
            {"qr_steps": True},
            id="qr-4-iters-tol0",
        ),
        pytest.param(
            (4, 5),
            {"eigendecomposition": "qr", "eigenbasis_tolerance": 0.2},
            {"skipped": True, "qr_steps": True},
            id="qr-1-iter-tol",
        ),
        pytest.param(
            (4, 5),
            {"eigendecomposition": "qr", "qr_max_iterations": 3, "eigenbasis_tolerance": 0.15},
            {"skipped": True, "qr_steps": True},
            id="qr-3-iters-tol",
        ),
        pytest.param(
            (3, 4, 5),
            {"eigendecomposition": "qr", "max_preconditioner_dim": 5, "qr_max_iterations": 2},
            {"qr_steps": True},
            id="qr-3d",
        ),
    ],
)
def test_eigenvalue_corrected(shape, config, expect):
    # The tolerances were chosen so that, in the reference, every criterion evaluation is at
    # least 3% away from τ (no decision can flip on round-off) and both outcomes occur.
    ref = run_against_reference(shape, {**EC, **config}, steps=8)
    _assert_exercised(ref, expect)


def _assert_exercised(ref, expect: dict) -> None:
    """The case really exercises what its name says (counters of the reference)."""
    if expect.get("skipped"):
        assert ref.stats["skipped"] > 0
    if expect.get("qr_steps"):
        assert ref.stats["qr_steps"] > 0
    if "eigh" in expect:
        assert ref.stats["eigh"] >= expect["eigh"]


DESCENDING = [
    pytest.param((4, 5), {}, {"eigh": 3}, id="eigh"),
    pytest.param((4, 5), {"eigenbasis_tolerance": 0.12}, {"skipped": True, "eigh": 3},
                 id="eigh-tolerance"),
    pytest.param((4, 5), {"eigendecomposition": "qr"}, {"qr_steps": True}, id="qr-1-iter"),
    pytest.param((4, 5), {"eigendecomposition": "qr", "eigenbasis_tolerance": 0.12},
                 {"skipped": True, "qr_steps": True}, id="qr-1-iter-tol"),
    pytest.param((3, 4, 5), {"eigendecomposition": "qr", "max_preconditioner_dim": 5,
                             "qr_max_iterations": 2}, {"qr_steps": True}, id="qr-3d"),
]


@pytest.mark.parametrize("shape, config, expect", DESCENDING)
def test_eigenvalue_corrected_descending_variant(shape, config, expect):
    """eigenbasis_variant="descending": an earlier reading of docs/design.md §3."""
    config = {**EC, "eigenbasis_variant": "descending", **config}
    ref = run_against_reference(shape, config, steps=8)
    _assert_exercised(ref, expect)


def _swapping_row_scales(n_steps: int = 8) -> list:
    """(4, 6) gradients whose row scales reverse at step 4: the row factor's eigenvalues
    swap order, so a QR refresh must reorder the basis."""
    gen = generator(11)
    grads = []
    for t in range(n_steps):
        scales = torch.tensor([3.0, 1.0, 0.3, 0.1], dtype=F64)
        if t >= 3:
            scales = scales.flip(0)
        grads.append(scales[:, None] * torch.randn(4, 6, generator=gen, dtype=F64))
    return grads


def test_descending_variant_permutes_d_and_differs_from_meta():
    grads = _swapping_row_scales()
    config = {**EC, "betas": (0.5, 0.5), "eigendecomposition": "qr",
              "eigenbasis_variant": "descending"}
    ref = run_against_reference((4, 6), config, grads=grads)
    assert ref.stats["permuted"] > 0
    meta = ReferenceShampoo(grads[0] * 0 + 1, **{**config, "eigenbasis_variant": "meta"})
    other = ReferenceShampoo(grads[0] * 0 + 1, **config)
    for g in grads:
        meta.step(g)
        other.step(g)
    assert (meta.param - other.param).abs().max() > 1e-3


def test_qr_refresh_reorders_the_basis_and_leaves_d_as_it_is():
    """Eigenvalues of the row factor swap order over time: the QR refresh re-sorts the basis
    ascending, and D keeps its order (Meta's semantics, docs/design.md §3)."""
    grads = _swapping_row_scales()
    config = {**EC, "betas": (0.5, 0.5), "eigendecomposition": "qr", "qr_max_iterations": 1}
    ref = run_against_reference((4, 6), config, grads=grads)
    assert ref.stats["permuted"] > 0


# ------------------------------------------------------------------ KL-Shampoo (docs/design.md §3)
KL = {"lr": 0.05, "epsilon": 1e-6, "preconditioner": "kl_shampoo", "max_preconditioner_dim": 8}


@pytest.mark.parametrize(
    "shape, config",
    [
        pytest.param((4, 5), {}, id="2d"),
        pytest.param((3, 4, 5), {"max_preconditioner_dim": 5}, id="3d"),
        pytest.param((6,), {}, id="1d"),
        pytest.param((12, 5), {"precondition_frequency": 2, "grafting": "adam"},
                     id="split-f2-adam-grafting"),
        pytest.param((4, 5), {"betas": (0.9, 0.95), "weight_decay": 0.1, "momentum": 0.5},
                     id="beta2-wd-momentum"),
        pytest.param((3, 4, 5), {"max_preconditioner_dim": 5,
                                 "inverse_exponent_override": {3: {1: 0.0}}},
                     id="3d-dim-off"),
    ],
)
def test_kl_shampoo(shape, config):
    run_against_reference(shape, {**KL, **config}, steps=7)


def test_kl_shampoo_statistics_differ_from_shampoo():
    """After the first refresh the factors see the preconditioned gradient: KL-Shampoo and
    Shampoo then move the parameter differently (the test above is not Shampoo twice)."""
    from hf_shampoo import DistributedShampoo

    grads = random_tensors((4, 5), 4, seed=3)
    out = []
    for kind in ("shampoo", "kl_shampoo"):
        p = torch.nn.Parameter(torch.zeros(4, 5, dtype=F64))
        opt = DistributedShampoo([p], lr=0.05, epsilon=1e-6, preconditioner=kind,
                                 max_preconditioner_dim=8,  # (4, 5) stays 2-D
                                 factor_matrix_dtype=F64)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        out.append(p.detach().clone())
    assert (out[0] - out[1]).norm() > 0.05 * out[0].norm(), (out[0] - out[1]).norm() / out[0].norm()


# ------------------------------------------------------------------ pseudo-inverse roots
PSEUDO = {"lr": 0.05, "epsilon": 0.0, "rank_deficient": "pseudo_inverse",
          "max_preconditioner_dim": 8}


@pytest.mark.parametrize("kind", ["shampoo", "kl_shampoo"])
@pytest.mark.parametrize(
    "shape, config",
    [
        # (8, 5): the 8 x 8 factor has seen 2 gradients at the first refresh (rank 2)
        pytest.param((8, 5), {"precondition_frequency": 2, "rank_rtol": None}, id="rtol-eps"),
        pytest.param((8, 5), {"precondition_frequency": 2, "rank_atol": 0.5}, id="atol"),
        pytest.param((6,), {"rank_rtol": 1e-3, "grafting": "adam"}, id="1d-rtol-adam"),
        pytest.param((3, 4, 5), {"max_preconditioner_dim": 5, "rank_rtol": None,
                                 "inverse_exponent_override": {3: {1: 0.0}}}, id="3d-dim-off"),
    ],
)
def test_pseudo_inverse_roots(kind, shape, config):
    """rank_deficient="pseudo_inverse": the inverse roots of rank-deficient factors drop
    the directions at or below the cutoff (docs/design.md §2), float64 formula."""
    run_against_reference(shape, {**PSEUDO, "preconditioner": kind, **config}, steps=6)


def test_pseudo_inverse_keeps_the_update_in_the_gradients_span():
    """With rank-1 gradients G = u xᵀ (x fixed) the right factor has rank 1: the pseudo-
    inverse update stays in the span of x exactly, where a perturbation (ε = 1e-12) also
    moves along the null space's rounding noise."""
    from hf_shampoo import DistributedShampoo

    g = generator(4)
    x = torch.randn(5, generator=g)
    p = torch.nn.Parameter(torch.zeros(8, 5))
    opt = DistributedShampoo([p], lr=0.1, epsilon=0.0, rank_deficient="pseudo_inverse",
                             rank_rtol=None, max_preconditioner_dim=8)
    for _ in range(4):
        p.grad = torch.outer(torch.randn(8, generator=g), x)
        opt.step()
    across = p.detach() - (p.detach() @ x)[:, None] * x / x.dot(x)
    assert p.detach().norm() > 0 and across.norm() <= 1e-5 * p.detach().norm()
