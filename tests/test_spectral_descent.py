"""Spectral descent (Muon) and sign descent against dense float64 formulas and against
torch.optim.Muon; validation, blocking, schedules and exact resume.

The float64 references orthogonalize one matrix at a time, written from the definitions
(Newton–Schulz from ``G / ‖G‖_F`` on the short side's Gram matrix; ``U Vᵀ`` of the SVD);
the optimizer stacks same-shape blocks and orthogonalizes them in one batched call.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from hf_shampoo import DistributedShampoo
from hf_shampoo.orthogonalization import lr_adjustment

pytestmark = pytest.mark.unit

F64 = torch.float64
MUON = (3.4445, -4.7750, 2.0315)


def reference_newton_schulz(g: torch.Tensor, steps: int = 5, coefficients=MUON):
    a, b, c = coefficients
    x = g / max(float(torch.linalg.matrix_norm(g)), 1e-8)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def reference_svd(g: torch.Tensor):
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    return u @ vh


def reference_scale(rule, rows, cols):
    return {None: 1.0, "original": math.sqrt(max(1, rows / cols)),
            "match_rms_adamw": 0.2 * math.sqrt(max(rows, cols)),
            "spectral_unclamped": math.sqrt(rows / cols)}[rule]


def one_step(shapes, seed=0, **config):
    """(initial weights, gradients, weights after one step) with no momentum (Ĝ = G)."""
    g = torch.Generator().manual_seed(seed)
    initial = [torch.randn(s, generator=g, dtype=F64) for s in shapes]
    grads = [torch.randn(s, generator=g, dtype=F64) for s in shapes]
    params = [torch.nn.Parameter(w.clone()) for w in initial]
    opt = DistributedShampoo(params, lr=0.5, betas=(0.0, 1.0), factor_matrix_dtype=F64, **config)
    for p, grad in zip(params, grads):
        p.grad = grad.clone()
    opt.step()
    return initial, grads, [p.detach() for p in params]


# ---------------------------------------------------------------------- formulas
@pytest.mark.parametrize("orthogonalization", ["newton_schulz", "svd"])
@pytest.mark.parametrize("rule", [None, "original", "match_rms_adamw", "spectral_unclamped"])
def test_whole_matrices_match_the_float64_formula(orthogonalization, rule):
    # tall, wide, square, a row vector as a 1 x n matrix, and a conv kernel as (out, rest);
    # (40, 30) and (30, 40) share no stack, the two (8, 8) share one
    shapes = [(40, 30), (30, 40), (8, 8), (8, 8), (1, 12), (6, 3, 3, 3)]
    initial, grads, after = one_step(shapes, preconditioner="spectral_descent",
                                     spectral_orthogonalization=orthogonalization,
                                     spectral_lr_adjustment=rule, max_preconditioner_dim=64)
    orth = reference_svd if orthogonalization == "svd" else reference_newton_schulz
    for w, grad, got in zip(initial, grads, after):
        matrix = grad.reshape(grad.shape[0], -1)
        rows, cols = matrix.shape
        expected = w - 0.5 * reference_scale(rule, rows, cols) * orth(matrix).reshape(w.shape)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_svd_direction_has_unit_singular_values():
    initial, _, after = one_step([(12, 7)], preconditioner="spectral_descent",
                                 spectral_orthogonalization="svd")
    singular = torch.linalg.svdvals((initial[0] - after[0]) / 0.5)
    torch.testing.assert_close(singular, torch.ones(7, dtype=F64), rtol=1e-12, atol=1e-12)


def test_newton_schulz_iterations_and_coefficients():
    coefficients = (3.0, -3.2, 1.2)  # p(1) = 1: converges to the orthogonal factor
    initial, grads, after = one_step([(9, 5)], preconditioner="spectral_descent",
                                     newton_schulz_iterations=12,
                                     newton_schulz_coefficients=coefficients)
    expected = initial[0] - 0.5 * reference_newton_schulz(grads[0], 12, coefficients)
    torch.testing.assert_close(after[0], expected, rtol=1e-12, atol=1e-12)
    # and with these coefficients, 12 steps are close to the exact U Vᵀ
    torch.testing.assert_close(after[0], initial[0] - 0.5 * reference_svd(grads[0]),
                               rtol=0, atol=1e-3)


def test_blocks_are_orthogonalized_one_by_one():
    # (40, 30) with max_preconditioner_dim 16: blocks (16,16), (16,14), (8,16), (8,14)
    initial, grads, after = one_step([(40, 30)], preconditioner="spectral_descent",
                                     max_preconditioner_dim=16)
    expected = initial[0].clone()
    for rows in (slice(0, 16), slice(16, 32), slice(32, 40)):
        for cols in (slice(0, 16), slice(16, 30)):
            expected[rows, cols] -= 0.5 * reference_newton_schulz(grads[0][rows, cols])
    torch.testing.assert_close(after[0], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scale", [None, "l1"])
def test_sign_descent_matches_the_formula(scale):
    shapes = [(6, 4), (5, 3, 3), (7,), ()]
    initial, grads, after = one_step(shapes, preconditioner="sign_descent", sign_scale=scale,
                                     max_preconditioner_dim=64)
    for w, grad, got in zip(initial, grads, after):
        factor = grad.abs().sum() if scale == "l1" else 1.0
        torch.testing.assert_close(got, w - 0.5 * factor * torch.sign(grad),
                                   rtol=1e-12, atol=1e-12)


def test_lr_adjustment_rules():
    for rule in (None, "original", "match_rms_adamw", "spectral_unclamped"):
        for rows, cols in ((64, 16), (16, 64), (32, 32)):
            assert lr_adjustment(rule, rows, cols) == pytest.approx(
                reference_scale(rule, rows, cols), rel=1e-15)


def test_momentum_and_start_step():
    """Ĝ is the filtered gradient (β1, β3, bias correction) and spectral descent starts at
    step 1 whatever precondition_frequency says; with grafting, Adam's norm is applied."""
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(6, 4, generator=g, dtype=F64)
    grads = [torch.randn(6, 4, generator=g, dtype=F64) for _ in range(3)]
    p = torch.nn.Parameter(w0.clone())
    opt = DistributedShampoo([p], lr=0.1, betas=(0.9, 1.0), beta3=0.5, factor_matrix_dtype=F64,
                             preconditioner="spectral_descent", precondition_frequency=50,
                             grafting="adam", grafting_beta2=0.99, grafting_epsilon=1e-8)
    w, m, v = w0.clone(), torch.zeros_like(w0), torch.zeros_like(w0)
    for t, grad in enumerate(grads, start=1):
        p.grad = grad.clone()
        opt.step()
        filtered = (0.5 * m + 0.5 * grad) / (1 - 0.5 * 0.9 ** (t - 1))
        m = 0.9 * m + 0.1 * grad
        v = 0.99 * v + 0.01 * grad * grad
        adam = filtered / ((v / (1 - 0.99**t)).sqrt() + 1e-8)
        direction = reference_newton_schulz(filtered)
        w = w - 0.1 * adam.norm() / (direction.norm() + 1e-16) * direction
        torch.testing.assert_close(p.detach(), w, rtol=1e-10, atol=1e-12)


def test_staggered_schedule_changes_nothing():
    runs = []
    for schedule in ("all", "staggered"):
        _, _, after = one_step([(6, 4), (6, 4), (9, 3)], preconditioner="spectral_descent",
                               precondition_frequency=4, refresh_schedule=schedule)
        runs.append(after)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------- torch.optim.Muon
def muon_pair(shapes, rule, nesterov, steps, nesterov_as=None, lr=0.02, mu=0.95, wd=0.1):
    """Relative error of our parameters against torch.optim.Muon's after ``steps`` steps,
    configured by the documented mapping (``nesterov_as``: map as if it were that)."""
    g = torch.Generator().manual_seed(0)
    initial = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]
    theirs = [torch.nn.Parameter(w.clone()) for w in initial]
    ours = [torch.nn.Parameter(w.clone()) for w in initial]
    muon = torch.optim.Muon(theirs, lr=lr, weight_decay=wd, momentum=mu, nesterov=nesterov,
                            adjust_lr_fn=rule)
    mapped_nesterov = nesterov if nesterov_as is None else nesterov_as
    shampoo = DistributedShampoo(
        ours, lr=lr, betas=(mu, 1.0), use_bias_correction=False, weight_decay=wd,
        preconditioner="spectral_descent", spectral_lr_adjustment=rule,
        newton_schulz_dtype=torch.bfloat16, max_preconditioner_dim=4096,
        **({"beta3": mu**2} if mapped_nesterov else {}))
    for step in range(steps):
        for p, q, grad in zip(theirs, ours, grads[step]):
            p.grad, q.grad = grad.clone(), grad.clone()
        muon.step()
        shampoo.step()
    return max(float((q.detach() - p.detach()).norm() / (p.detach() - w).norm())
               for p, q, w in zip(theirs, ours, initial))


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch 2.9+")
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("rule", ["original", "match_rms_adamw"])
def test_equals_torch_muon_within_bfloat16_rounding(rule, nesterov):
    # tall, wide and square matrices, two of one shape (one stack)
    shapes = [(64, 16), (16, 64), (32, 32), (32, 32)]
    error = muon_pair(shapes, rule, nesterov, steps=10)
    assert error < 1e-2  # bfloat16 has 8 bits of mantissa: 2^-7 ≈ 7.8e-3 per rounding
    # the check can tell a wrong mapping: Nesterov taken for plain momentum or back
    assert muon_pair(shapes, rule, nesterov, steps=10, nesterov_as=not nesterov) > 5e-2


# ---------------------------------------------------------------------- errors, resume
def test_vectors_are_refused_with_their_name():
    with pytest.raises(ValueError, match=r"'encoder.bias' has shape \(3,\).*preset='muon'"):
        DistributedShampoo([("w", torch.nn.Parameter(torch.ones(3, 3))),
                            ("encoder.bias", torch.nn.Parameter(torch.ones(3)))],
                           preconditioner="spectral_descent")
    with pytest.raises(ValueError, match=r"shape \(\)"):
        DistributedShampoo([torch.nn.Parameter(torch.tensor(1.0))],
                           preconditioner="spectral_descent")


@pytest.mark.parametrize("key, value, allowed", [
    ("spectral_orthogonalization", "qr", "'newton_schulz', 'svd'"),
    ("newton_schulz_iterations", 0, "integer >= 1"),
    ("newton_schulz_coefficients", (1.0, 2.0), "three finite real numbers"),
    ("newton_schulz_coefficients", (1.0, float("nan"), 2.0), "three finite real numbers"),
    ("newton_schulz_dtype", torch.int8, "torch.bfloat16"),
    ("spectral_lr_adjustment", "adamw", "'original', 'match_rms_adamw', 'spectral_unclamped'"),
    ("sign_scale", "l2", "None, 'l1'"),
])
def test_bad_keywords_name_the_keyword_and_the_valid_values(key, value, allowed):
    with pytest.raises(ValueError, match=f"invalid {key}=.*{allowed}"):
        DistributedShampoo([torch.nn.Parameter(torch.ones(3, 3))],
                           preconditioner="spectral_descent", **{key: value})


def test_start_step_bound_for_descent_kinds():
    with pytest.raises(ValueError, match=r"start_preconditioning_step=0.*integer >= 1"):
        DistributedShampoo([torch.nn.Parameter(torch.ones(3, 3))],
                           preconditioner="sign_descent", start_preconditioning_step=0)
    # precondition_frequency does not bound it for kinds that refresh nothing
    DistributedShampoo([torch.nn.Parameter(torch.ones(3, 3))], preconditioner="sign_descent",
                       precondition_frequency=10, start_preconditioning_step=2)


def test_state_is_momentum_only_and_resumes_exactly():
    def make():
        g = torch.Generator().manual_seed(1)
        return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((12, 5), (4, 2, 3))]

    def grads(step):
        g = torch.Generator().manual_seed(100 + step)
        return [torch.randn(s, generator=g) for s in ((12, 5), (4, 2, 3))]

    config = dict(lr=0.02, preconditioner="spectral_descent", betas=(0.95, 1.0), beta3=0.9025,
                  weight_decay=0.1, spectral_lr_adjustment="original")
    params = make()
    opt = DistributedShampoo(params, **config)
    for step in range(1, 7):
        for p, grad in zip(params, grads(step)):
            p.grad = grad
        opt.step()
        if step == 3:
            saved = copy.deepcopy(opt.state_dict())  # torch's holds live references
            saved_params = [p.detach().clone() for p in params]
    keys = {k for entry in saved["state"].values() for k in entry}
    assert keys == {"block_0.filtered_grad"}
    resumed = [torch.nn.Parameter(t) for t in saved_params]
    opt2 = DistributedShampoo(resumed, **config)
    opt2.load_state_dict(saved)
    for step in range(4, 7):
        for p, grad in zip(resumed, grads(step)):
            p.grad = grad
        opt2.step()
    for a, b in zip(params, resumed):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------- Polar Express
#: arXiv 2505.16932's five quintics as its GPT-2 experiments (modded-nanogpt) publish them
POLAR_EXPRESS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def reference_polar_express(g: torch.Tensor, steps: int = 5):
    """From ``G / (1.02 ‖G‖_F)``, iteration ``i`` with the ``i``-th quintic (the last
    repeated)."""
    x = g / (1.02 * float(torch.linalg.matrix_norm(g)))
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for i in range(steps):
        a, b, c = POLAR_EXPRESS[min(i, len(POLAR_EXPRESS) - 1)]
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize("steps", [3, 5, 7])
@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (16, 16)])
def test_polar_express_equals_its_float64_formula(shape, steps):
    initial, grads, after = one_step([shape], preconditioner="spectral_descent",
                                     newton_schulz_coefficients="polar_express",
                                     newton_schulz_iterations=steps, max_preconditioner_dim=64)
    expected = initial[0] - 0.5 * reference_polar_express(grads[0], steps)
    torch.testing.assert_close(after[0], expected, rtol=1e-10, atol=1e-12)


def test_a_schedule_of_triples_runs_one_per_iteration_and_repeats_the_last():
    schedule = [MUON, (2.0, -1.5, 0.5)]
    initial, grads, after = one_step([(12, 20)], preconditioner="spectral_descent",
                                     newton_schulz_coefficients=schedule,
                                     newton_schulz_iterations=4, max_preconditioner_dim=64)
    x = grads[0] / float(torch.linalg.matrix_norm(grads[0]))
    for a, b, c in [MUON, (2.0, -1.5, 0.5), (2.0, -1.5, 0.5), (2.0, -1.5, 0.5)]:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    torch.testing.assert_close(after[0], initial[0] - 0.5 * x, rtol=1e-10, atol=1e-12)


def test_polar_express_is_closer_to_the_polar_factor_than_muons_coefficients():
    """What it is for: after 5 iterations every singular value nearer 1 (random Gaussian
    matrices, float32), so the direction is nearer ``U Vᵀ``."""
    from hf_shampoo.orthogonalization import newton_schulz

    x = torch.randn(3, 96, 320, generator=torch.Generator().manual_seed(3))
    exact = reference_svd(x.double()[0])
    errors = {}
    for name in ("muon", "polar_express"):
        y = newton_schulz(x, 5, name, torch.float32).double()
        values = torch.linalg.svdvals(y)
        errors[name] = float((y[0] - exact).norm() / exact.norm())
        if name == "polar_express":
            assert 0.8 < float(values.min()) and float(values.max()) < 1.2
    assert errors["polar_express"] < 0.6 * errors["muon"], errors


@pytest.mark.parametrize("bad", ["polar", (1.0, 2.0), [(1.0, 2.0, 3.0), (1.0,)], ()])
def test_bad_coefficients_are_refused_with_the_choices(bad):
    with pytest.raises(ValueError, match="newton_schulz_coefficients.*polar_express"):
        DistributedShampoo([torch.nn.Parameter(torch.zeros(4, 4))],
                           preconditioner="spectral_descent", newton_schulz_coefficients=bad)


def test_the_trainer_spelling_names_polar_express():
    from hf_shampoo.integrations.transformers.arguments import cast_value

    assert cast_value("newton_schulz_coefficients", "polar_express") == "polar_express"
    assert cast_value("newton_schulz_coefficients", "(3.4445;-4.775;2.0315)") == MUON
