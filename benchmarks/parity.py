"""Parity with Meta's ``distributed_shampoo``: every mode side by side, in float64.

Meta's code is imported from a checkout (``--meta-path``, never vendored). Both optimizers
get the same float64 parameters and gradients (shapes with orders 0-3 and several blocks,
``max_preconditioner_dim=16``, ``--steps`` steps, refreshes every 3 steps from step 18);
each case prints the relative error ``max over parameters of ‖W_ours − W_meta‖ /
‖W_meta − W_0‖`` (the parameter movement).
Exit status 1 when a case exceeds its tolerance: ``--tolerance`` (default 1e-6), or the
case's own where it sets one (float16 inverse roots: 1e-5; see ``cases``).

    python -m benchmarks.parity --meta-path ../optimizers
    python -m benchmarks.parity --meta-path ../optimizers \
        --cases soap_qr1_tol0.0 kl_shampoo_graft_adam

``cases(meta)`` is also what ``tests/test_parity_meta.py`` runs (opt-in: it needs
``HF_SHAMPOO_META_PATH``).
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.common import arguments, table_head, table_row

SHAPES = [(6, 4), (5, 3, 3, 3), (7,), (40, 30), (50,), ()]
F64 = torch.float64


@dataclass
class Case:
    name: str
    ours: dict  # DistributedShampoo keywords
    meta: Callable[[], dict]  # Meta's DistributedShampoo keywords (built lazily)
    tolerance: float | None = None  # None: the run's (--tolerance, 1e-6 in the test)
    shapes: list | None = None  # None: SHAPES
    lr_at: Callable[[int], float] | None = None  # a schedule: the lr of step t (0-based)
    # iterate averaging: after these steps both switch to eval() and back to train(); with
    # end_in_eval, both end in eval mode (the averaged weights are compared)
    round_trips: tuple[int, ...] = ()
    end_in_eval: bool = False


def _common(**kw) -> dict:
    # epsilon 1e-6: some factors are rank-deficient after a few steps, and with a tiny
    # epsilon their null-space eigenvalues (rounding noise + ε) amplify last-bit
    # differences of two correct implementations far beyond the tolerance
    # the first refresh at step 18: every factor (at most 16 x 16) is then full rank. A
    # rank-deficient factor has a degenerate eigenvalue ε whose eigenvectors are arbitrary
    # (any basis of the null space is right), and eigenvalue correction pairs D's history
    # with whichever basis eigh returns: two correct implementations then differ at O(1)
    # lr = 2^-7 is exact in float32, the dtype of Meta's lr tensor (see run_case)
    base = dict(lr=2.0**-7, betas=(0.9, 0.99), epsilon=1e-6, max_preconditioner_dim=16,
                precondition_frequency=3, start_preconditioning_step=18)
    base.update(kw)
    return base


KINDS = (("shampoo", "RootInvShampooPreconditionerConfig"),
         ("kl_shampoo", "RootInvKLShampooPreconditionerConfig"))
ADAM = dict(grafting="adam", grafting_beta2=0.99, grafting_epsilon=1e-8)  # ours, as Meta's


def ours_grafting(kind: str | None) -> dict:
    if kind in (None, "sgd"):
        return dict(grafting=kind)
    return dict(ADAM, grafting=kind, grafting_beta2=0.99 if kind != "adagrad" else 0.999)


def meta_grafting(m, kind: str | None):
    return {
        None: lambda: None,
        "sgd": m.SGDPreconditionerConfig,
        "adagrad": lambda: m.AdaGradPreconditionerConfig(epsilon=1e-8),
        "rmsprop": lambda: m.RMSpropPreconditionerConfig(beta2=0.99, epsilon=1e-8),
        "adam": lambda: m.AdamPreconditionerConfig(beta2=0.99, epsilon=1e-8),
    }[kind]()


def root_inv(m, config: str = "RootInvShampooPreconditionerConfig", **kw):
    """Meta's inverse-root preconditioner config ``config``, float64 unless ``kw`` says."""
    return getattr(m, config)(**{"factor_matrix_dtype": F64, "inv_factor_matrix_dtype": F64,
                                 **kw})


def adam_case(m, name: str, ours: dict, meta: Callable[[], dict],
              tolerance: float | None = None) -> Case:
    """A case with Adam grafting on both sides: our keywords ``ours``, Meta's ``meta()``."""
    return Case(name, _common(**ours, **ADAM),
                lambda: _common(grafting_config=meta_grafting(m, "adam"), **meta()), tolerance)


def cases(m) -> list[Case]:
    """Every case; ``m`` is Meta's ``distributed_shampoo`` module."""
    from distributed_shampoo.shampoo_types import ClassicMomentumConfig, WeightDecayType

    m.ClassicMomentumConfig = ClassicMomentumConfig
    out = [Case(f"shampoo_graft_{kind}", _common(**ours_grafting(kind)),
                lambda kind=kind: _common(grafting_config=meta_grafting(m, kind),
                                          preconditioner_config=root_inv(m)))
           for kind in (None, "sgd", "adagrad", "rmsprop", "adam")]
    for name in ("l2", "decoupled", "corrected", "independent"):
        out.append(adam_case(
            m, f"shampoo_wd_{name}", dict(weight_decay=0.05, weight_decay_type=name),
            lambda name=name: dict(weight_decay=0.05, preconditioner_config=root_inv(m),
                                   weight_decay_type=getattr(WeightDecayType, name.upper()))))
    for nesterov in (False, True):
        out.append(adam_case(
            m, f"shampoo_momentum_nesterov_{nesterov}", dict(momentum=0.5, nesterov=nesterov),
            lambda nesterov=nesterov: dict(
                iterate_averaging_config=m.ClassicMomentumConfig(momentum=0.5,
                                                                 use_nesterov=nesterov),
                preconditioner_config=root_inv(m))))
    # inverse roots stored, and the preconditioning products run, in a low precision: the
    # same roundings as Meta's (float64 roots against Meta's bfloat16 ones differ by 7e-4).
    # float16 products accumulate differently in torch's bmm and tensordot on a CPU: 1e-6
    for name, dtype, tolerance in (("bf16", torch.bfloat16, None),
                                   ("fp16", torch.float16, 1e-5)):
        out.append(adam_case(
            m, f"shampoo_inv_factor_matrix_{name}", dict(inv_factor_matrix_dtype=dtype),
            lambda dtype=dtype: dict(preconditioner_config=root_inv(
                m, inv_factor_matrix_dtype=dtype)), tolerance))
    override = {2: {0: 0.0}, 1: 0.3}
    out.append(adam_case(m, "shampoo_exponent_override", dict(inverse_exponent_override=override),
                         lambda: dict(preconditioner_config=root_inv(
                             m, inverse_exponent_override=override))))
    corrected, descent = corrected_cases(m), descent_cases(m)
    out += averaging_cases(m, out + corrected + descent)
    return (out + pseudo_inverse_cases(m) + root_solver_cases(m) + eigendecomposed_cases(m)
            + corrected + descent)


def averaging_cases(m, base: list[Case]) -> list[Case]:
    """``iterate_averaging="gpa"`` / ``"schedule_free"`` (Meta's
    ``GeneralizedPrimalAveragingConfig`` / ``ScheduleFreeConfig``) on top of cases above:
    several kinds, weight decay of each type that shrinks z, a varying lr (schedule-free
    weighs steps by lr^p), eval()/train() round trips during the run, and the averaged
    weights compared at the end."""
    if not hasattr(m, "ScheduleFreeConfig"):
        return []
    by_name = {case.name: case for case in base}

    def lr_at(t: int) -> float:  # a warm-up and a decay, every value exact in float32
        return 2.0**-7 * (min(t + 1, 4) / 4) * (1 - (t // 9) / 8)

    variants = [
        ("shampoo_graft_adam", "gpa", {}, False),
        ("shampoo_graft_None", "gpa", dict(eval_interp_coeff=0.5, train_interp_coeff=1.0),
         False),
        ("shampoo_wd_decoupled", "gpa", {}, True),
        ("shampoo_wd_corrected", "schedule_free", {}, True),
        ("shampoo_wd_independent", "schedule_free", dict(train_interp_coeff=0.9), False),
        ("shampoo_wd_l2", "schedule_free", dict(eval_coeff_lr_power=1), True),
        ("shampoo_graft_adam", "schedule_free", {}, True),
        ("soap_eigh_graft_adam", "schedule_free", {}, True),
        ("soap_eigh_graft_None", "gpa", {}, True),
        ("kl_shampoo_graft_adam", "gpa", {}, True),
        ("spectral_ns_blocks_wd_nesterov", None, {}, True),
        ("sign_descent", "schedule_free", {}, True),
    ]
    out = []
    for base_name, mode, kw, scheduled in variants:
        case = by_name.get(base_name)
        if case is None:
            continue
        ours = {k: v for k, v in case.ours.items() if k not in ("momentum", "nesterov")}
        if mode is None:  # a momentum case: GPA takes momentum's place
            mode = "gpa"
        ours.update(iterate_averaging=mode, **kw)
        defaults = dict(train_interp_coeff=0.8)
        if mode == "gpa":
            defaults["eval_interp_coeff"] = 0.9
        else:
            defaults["eval_coeff_lr_power"] = 2
        config = {k: kw.get(k, v) for k, v in defaults.items()}
        cls = m.GeneralizedPrimalAveragingConfig if mode == "gpa" else m.ScheduleFreeConfig

        def meta(case=case, cls=cls, config=config):
            kwargs = case.meta()
            kwargs["iterate_averaging_config"] = cls(**config)
            return kwargs

        out.append(Case(f"{mode}_{base_name}{'_scheduled' if scheduled else ''}", ours, meta,
                        case.tolerance, case.shapes, lr_at if scheduled else None,
                        round_trips=(5, 20), end_in_eval=True))
    return out


def eigendecomposed_cases(m) -> list[Case]:
    """``preconditioner="eigendecomposed_shampoo"`` / ``"eigendecomposed_kl_shampoo"``
    (Meta's ``Eigendecomposed*PreconditionerConfig``): eigh, eigh with the criterion, QR
    with 1 and 3 iterations and tolerances 0 and > 0, and the pseudo-inverse."""
    out = []
    kinds = (("eigendecomposed_shampoo", "EigendecomposedShampooPreconditionerConfig"),
             ("eigendecomposed_kl_shampoo", "EigendecomposedKLShampooPreconditionerConfig"))
    variants = (
        ("eigh", dict(), lambda: m.EighEigendecompositionConfig()),
        ("eigh_tol0.1", dict(eigenbasis_tolerance=0.1),
         lambda: m.EighEigendecompositionConfig(tolerance=0.1)),
        ("qr1_tol0.0", dict(eigendecomposition="qr", qr_max_iterations=1),
         lambda: m.QREigendecompositionConfig(max_iterations=1)),
        ("qr3_tol0.05", dict(eigendecomposition="qr", qr_max_iterations=3,
                             eigenbasis_tolerance=0.05),
         lambda: m.QREigendecompositionConfig(max_iterations=3, tolerance=0.05)),
        ("pseudo_inverse", dict(epsilon=0.0, rank_deficient="pseudo_inverse", rank_rtol=None,
                                start_preconditioning_step=3),
         lambda: m.EighEigendecompositionConfig(
             rank_deficient_stability_config=m.PseudoInverseConfig(rank_rtol=None))),
    )
    for kind, config in kinds:
        if not hasattr(m, config):
            continue
        for name, ours, theirs in variants:
            extra = {k: v for k, v in ours.items()
                     if k in ("epsilon", "start_preconditioning_step")}
            out.append(adam_case(
                m, f"{kind}_{name}", dict(preconditioner=kind, **ours),
                lambda theirs=theirs, config=config, extra=extra: dict(
                    **extra, preconditioner_config=getattr(m, config)(
                        factor_matrix_dtype=F64, factor_matrix_eigenvectors_dtype=F64,
                        factor_matrix_eigenvalues_dtype=F64,
                        amortized_computation_config=theirs()))))
    return out


def root_solver_cases(m) -> list[Case]:
    """``root_inverse="coupled_newton"`` / ``"coupled_higher_order"`` (Meta's
    ``CoupledNewtonConfig`` / ``CoupledHigherOrderConfig``) at Meta's default tolerances
    and a tight one, for Shampoo and KL-Shampoo; the higher order's ridge as ours by
    default (``abs_epsilon`` = epsilon) and relative."""
    if not hasattr(m, "CoupledNewtonConfig"):
        return []
    newton, higher = dict(root_inverse="coupled_newton"), dict(root_inverse="coupled_higher_order")
    solvers = (
        ("newton", newton, lambda: m.CoupledNewtonConfig()),
        ("newton_tol1e-12", dict(newton, root_tolerance=1e-12, root_max_iterations=200),
         lambda: m.CoupledNewtonConfig(tolerance=1e-12, max_iterations=200)),
        ("higher3", higher, lambda: m.CoupledHigherOrderConfig(rel_epsilon=0.0, abs_epsilon=1e-6)),
        ("higher2_rel", dict(higher, root_order=2, root_rel_epsilon=1e-4, root_abs_epsilon=0.0),
         lambda: m.CoupledHigherOrderConfig(rel_epsilon=1e-4, abs_epsilon=0.0, order=2)),
        ("higher5_tol1e-12", dict(higher, root_order=5, root_tolerance=1e-12),
         lambda: m.CoupledHigherOrderConfig(rel_epsilon=0.0, abs_epsilon=1e-6, order=5,
                                            tolerance=1e-12)),
    )
    return [adam_case(m, f"{kind}_{name}", dict(preconditioner=kind, **ours),
                      lambda theirs=theirs, config=config: dict(preconditioner_config=root_inv(
                          m, config, amortized_computation_config=theirs())))
            for kind, config in KINDS if hasattr(m, config) for name, ours, theirs in solvers]


def pseudo_inverse_cases(m) -> list[Case]:
    """``rank_deficient="pseudo_inverse"`` (Meta's ``PseudoInverseConfig`` in its
    ``EigenConfig``), on purpose while the factors are rank-deficient: preconditioning from
    step 3, when a 16 x 16 factor has seen 3 gradients. The cutoffs drop the null space's
    rounding noise (``rank_rtol=None``: d * eps; or an absolute one), which would otherwise
    be inverted (Meta's default ``rank_rtol=0``, an exact zero only) and differ at O(1)
    between two correct implementations."""
    if not hasattr(m, "PseudoInverseConfig"):
        return []
    early = dict(epsilon=0.0, start_preconditioning_step=3)
    return [adam_case(
        m, f"{kind}_pseudo_inverse_{name}",
        dict(preconditioner=kind, rank_deficient="pseudo_inverse", rank_atol=atol,
             rank_rtol=rtol, **early),
        lambda atol=atol, rtol=rtol, config=config: dict(
            **early, preconditioner_config=root_inv(
                m, config, amortized_computation_config=m.EigenConfig(
                    rank_deficient_stability_config=m.PseudoInverseConfig(
                        rank_atol=atol, rank_rtol=rtol)))))
        for name, atol, rtol in (("rtol_eps", 0.0, None), ("atol", 1e-6, 0.0), ("rtol", 0.0, 1e-9))
        for kind, config in KINDS if hasattr(m, config)]


# spectral descent takes matrices: Meta blocks >2-D parameters by merging dims up to
# max_preconditioner_dim, so whole matrices (dim 0, the rest) need a bound above the rest
MATRIX_SHAPES = [(6, 4), (40, 30), (3, 20), (5, 3, 3, 3)]


def descent_cases(m) -> list[Case]:
    """Spectral descent (Newton–Schulz, SVD; whole matrices and blocks) and sign descent."""
    from distributed_shampoo.preconditioner.matrix_functions_types import (
        NewtonSchulzOrthogonalizationConfig,
        SVDOrthogonalizationConfig,
    )

    def spectral(orthogonalization):
        return m.SpectralDescentPreconditionerConfig(orthogonalization_config=orthogonalization)

    def meta_spectral(**kw):
        # a config of its own: Meta sets target_parameter_dimensionality=2 on the group's
        # distributed config, which would otherwise be its shared default
        return _common(distributed_config=m.SingleDeviceDistributedConfig(
            target_parameter_dimensionality=2), **kw)

    def meta_whole(**kw):
        return meta_spectral(max_preconditioner_dim=64, **kw)

    out: list[Case] = []
    variants = {
        "ns": (dict(), NewtonSchulzOrthogonalizationConfig),
        "ns3_coefficients": (dict(newton_schulz_iterations=3,
                                  newton_schulz_coefficients=(3.0, -3.2, 1.2)),
                             lambda: NewtonSchulzOrthogonalizationConfig(
                                 num_iterations=3, coefficients=(3.0, -3.2, 1.2))),
        "svd": (dict(spectral_orthogonalization="svd"), SVDOrthogonalizationConfig),
    }
    for name, (ours, theirs) in variants.items():
        out.append(Case(f"spectral_{name}_whole",
                        _common(preconditioner="spectral_descent", max_preconditioner_dim=64,
                                **ours),
                        lambda theirs=theirs: meta_whole(
                            preconditioner_config=spectral(theirs())),
                        shapes=MATRIX_SHAPES))
    for rule, scale_fn in (("original", original_scale), ("match_rms_adamw", rms_scale)):
        out.append(Case(f"spectral_ns_whole_{rule}",
                        _common(preconditioner="spectral_descent", max_preconditioner_dim=64,
                                spectral_lr_adjustment=rule),
                        lambda scale_fn=scale_fn: meta_whole(preconditioner_config=spectral(
                            NewtonSchulzOrthogonalizationConfig(scale_by_dims_fn=scale_fn))),
                        shapes=MATRIX_SHAPES))
    out.append(Case("spectral_ns_blocks_wd_nesterov",
                    _common(preconditioner="spectral_descent", weight_decay=0.05,
                            beta3=0.81, use_bias_correction=False),
                    lambda: meta_spectral(weight_decay=0.05, beta3=0.81,
                                          use_bias_correction=False,
                                          preconditioner_config=spectral(
                                        NewtonSchulzOrthogonalizationConfig())),
                    shapes=MATRIX_SHAPES[:3]))
    out.append(Case("spectral_svd_graft_adam",
                    _common(preconditioner="spectral_descent", max_preconditioner_dim=64,
                            spectral_orthogonalization="svd", **ADAM),
                    lambda: meta_whole(grafting_config=meta_grafting(m, "adam"),
                                       preconditioner_config=spectral(
                                           SVDOrthogonalizationConfig())),
                    shapes=MATRIX_SHAPES))
    out.append(Case("sign_descent",
                    _common(preconditioner="sign_descent", momentum=0.5),
                    lambda: _common(preconditioner_config=m.SignDescentPreconditionerConfig(),
                                    iterate_averaging_config=m.ClassicMomentumConfig(
                                        momentum=0.5, use_nesterov=False))))
    out.append(Case("sign_descent_l1",
                    _common(preconditioner="sign_descent", sign_scale="l1",
                            weight_decay=0.05),
                    lambda: _common(weight_decay=0.05,
                                    preconditioner_config=m.SignDescentPreconditionerConfig(
                                        scale_fn=l1_scale))))
    return out


def original_scale(d_in: int, d_out: int) -> float:
    """torch.optim.Muon's "original" rule in Meta's terms (rows = d_out, cols = d_in)."""
    return math.sqrt(max(1.0, d_out / d_in))


def rms_scale(d_in: int, d_out: int) -> float:
    """torch.optim.Muon's "match_rms_adamw" rule in Meta's terms."""
    return 0.2 * math.sqrt(max(d_in, d_out))


def l1_scale(grad: torch.Tensor) -> torch.Tensor:
    """Meta's sign descent scale for steepest descent under the L-infinity norm."""
    return grad.abs().sum()


def corrected_cases(m) -> list[Case]:
    """Eigenvalue-corrected Shampoo (SOAP) with eigh and QR, KL-Shampoo."""
    out: list[Case] = []

    def corrected_cfg(eigen=None, **kw):
        eigen = eigen or m.EighEigendecompositionConfig()
        return m.EigenvalueCorrectedShampooPreconditionerConfig(
            amortized_computation_config=eigen, factor_matrix_dtype=F64,
            factor_matrix_eigenvectors_dtype=F64, corrected_eigenvalues_dtype=F64, **kw)

    def qr(iterations: int, tolerance: float):
        return m.QREigendecompositionConfig(max_iterations=iterations, tolerance=tolerance)

    for graft in (None, "adam"):
        out.append(Case(f"soap_eigh_graft_{graft}",
                        _common(preconditioner="eigenvalue_corrected", **ours_grafting(graft)),
                        lambda graft=graft: _common(grafting_config=meta_grafting(m, graft),
                                                    preconditioner_config=corrected_cfg())))
    for tolerance in (0.05, 0.3):  # adaptive eigh refresh (skips where the basis holds)
        out.append(Case(f"soap_eigh_tol{tolerance}",
                        _common(preconditioner="eigenvalue_corrected",
                                eigenbasis_tolerance=tolerance),
                        lambda t=tolerance: _common(preconditioner_config=corrected_cfg(
                            m.EighEigendecompositionConfig(tolerance=t)))))
    # Householder QR, then the matmul-based orthogonalisation (Meta's numbers for both)
    for iterations, tolerance, cholesky in ((1, 0.0, False), (3, 0.0, False), (3, 0.05, False),
                                            (1, 0.3, False), (1, 0.0, True), (3, 0.05, True)):
        name = f"soap_qr{iterations}_tol{tolerance}" + ("_cholesky_qr" if cholesky else "")
        out.append(Case(name, _common(preconditioner="eigenvalue_corrected",
                                      eigendecomposition="qr", qr_max_iterations=iterations,
                                      eigenbasis_tolerance=tolerance,
                                      **(dict(orthogonalization="cholesky_qr") if cholesky
                                         else {})),
                        lambda i=iterations, t=tolerance: _common(
                            preconditioner_config=corrected_cfg(qr(i, t)))))
    out.append(Case("soap_wd_momentum",
                    _common(preconditioner="eigenvalue_corrected", weight_decay=0.05,
                            momentum=0.5, nesterov=True),
                    lambda: _common(weight_decay=0.05, iterate_averaging_config=(
                        m.ClassicMomentumConfig(momentum=0.5, use_nesterov=True)),
                        preconditioner_config=corrected_cfg())))
    out.append(Case("soap_exponent_override",
                    _common(preconditioner="eigenvalue_corrected",
                            inverse_exponent_override={2: {0: 0.0}, 1: 0.25}),
                    lambda: _common(preconditioner_config=corrected_cfg(
                        ignored_basis_change_dims={2: [0]}, inverse_exponent_override={1: 0.25}))))
    if hasattr(m, "RootInvKLShampooPreconditionerConfig"):
        for graft in (None, "adam"):
            out.append(Case(f"kl_shampoo_graft_{graft}",
                            _common(preconditioner="kl_shampoo", **ours_grafting(graft)),
                            lambda graft=graft: _common(
                                grafting_config=meta_grafting(m, graft),
                                preconditioner_config=root_inv(
                                    m, "RootInvKLShampooPreconditionerConfig"))))
    return out


def run_case(case: Case, steps: int, seed: int = 0, device: str | None = None) -> float:
    """The relative error of our parameters against Meta's after ``steps`` steps, both on
    ``device`` (default: torch's default device; the numbers are drawn on the CPU)."""
    from distributed_shampoo import DistributedShampoo as MetaShampoo

    from hf_shampoo import DistributedShampoo

    device = torch.get_default_device() if device is None else torch.device(device)
    g = torch.Generator().manual_seed(seed)

    def draw(shape):
        return torch.randn(shape, generator=g, dtype=F64, device="cpu").to(device)

    shapes = case.shapes or SHAPES
    initial = [draw(s) for s in shapes]
    grads = [[draw(s) for s in shapes] for _ in range(steps)]
    ours = [torch.nn.Parameter(w.clone()) for w in initial]
    theirs = [torch.nn.Parameter(w.clone()) for w in initial]
    opt_ours = DistributedShampoo(ours, factor_matrix_dtype=F64, **case.ours)
    # Meta computes its bias corrections as tensors of the default dtype: float64 here, so
    # that they are not rounded to float32 (its lr tensor stays float32: lr is exact there)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    try:
        opt_meta = MetaShampoo(theirs, **case.meta())
        _run(opt_meta, theirs, grads, case)
    finally:
        torch.set_default_dtype(previous)
    _run(opt_ours, ours, grads, case)
    error = 0.0
    for p, q, w in zip(ours, theirs, initial):
        movement = (q.detach() - w).norm()
        if movement > 0:
            error = max(error, float((p.detach() - q.detach()).norm() / movement))
    return error


def _run(optimizer, params, grads, case: Case) -> None:
    """The case's steps (its lr schedule, its eval()/train() round trips)."""
    for step, step_grads in enumerate(grads):
        if case.lr_at is not None:
            for group in optimizer.param_groups:
                group["lr"] = case.lr_at(step)
        for p, grad in zip(params, step_grads):
            p.grad = grad.clone()
        optimizer.step()
        if step in case.round_trips:
            optimizer.eval()
            optimizer.train()
    if case.end_in_eval:
        optimizer.eval()


def load_meta(path: str | None):
    if path:
        sys.path.insert(0, os.path.abspath(path))
    import distributed_shampoo

    logging.getLogger("distributed_shampoo").setLevel(logging.ERROR)
    return distributed_shampoo


def main() -> int:
    parser = arguments(__doc__, steps=27)
    parser.add_argument("--meta-path", default=os.environ.get("HF_SHAMPOO_META_PATH"))
    parser.add_argument("--tolerance", type=float, default=1e-6)
    parser.add_argument("--cases", nargs="*", default=None)
    parser.add_argument("--device", default="cpu", help="cpu or cuda: where both run")
    args = parser.parse_args()
    meta = load_meta(args.meta_path)
    failed = 0
    print(table_head("case", "relative error", "within tolerance"))
    for case in cases(meta):
        if args.cases and case.name not in args.cases:
            continue
        error = run_case(case, args.steps, device=args.device)
        ok = error <= (case.tolerance or args.tolerance)
        failed += not ok
        print(table_row(case.name, f"{error:.2e}", "yes" if ok else "**no**"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
