"""Hyperparameter defaults and validation: the only module that knows them.

Every keyword of ``DistributedShampoo`` (docs/design.md §7) has its default here, and
``validate_group`` checks one parameter group's values before the optimizer changes any
state. Errors name the keyword, the value given and what is allowed.
"""

from __future__ import annotations

import difflib
import math
import numbers
from typing import Any

import torch

from .compiled import compile_parameters

DEFAULTS: dict[str, Any] = {
    "lr": 1e-2,
    "betas": (0.9, 1.0),
    "beta3": None,
    "epsilon": 1e-12,
    "momentum": 0.0,
    "dampening": 0.0,
    "nesterov": False,
    "weight_decay": 0.0,
    "weight_decay_type": "decoupled",
    "use_bias_correction": True,
    "max_preconditioner_dim": 1024,
    "precondition_frequency": 1,
    "start_preconditioning_step": None,
    "preconditioner": "shampoo",
    "eigendecomposition": "eigh",
    "eigenbasis_tolerance": 0.0,
    "qr_max_iterations": 1,
    "eigenbasis_variant": "meta",
    "orthogonalization": "householder",
    "quantization": None,
    "statistics_frequency": None,
    "statistics_warmup": None,
    "inverse_exponent_override": None,
    "grafting": None,
    "grafting_beta2": 0.999,
    "grafting_epsilon": 1e-8,
    "factor_matrix_dtype": torch.float32,
    "inv_factor_matrix_dtype": None,
    "distributed": "auto",
    "fsdp_mode": "lossless",
    "communication_dtype": torch.float32,
    "num_trainers_per_group": -1,
    "assignment_cost": "memory",
    "refresh_schedule": "all",
    "spectral_orthogonalization": "newton_schulz",
    "newton_schulz_iterations": 5,
    "newton_schulz_coefficients": (3.4445, -4.7750, 2.0315),
    "newton_schulz_dtype": None,
    "spectral_lr_adjustment": None,
    "sign_scale": None,
    "check_finite_gradients": True,
    "compile": False,
    "vector_preconditioner": None,
    "diagonal_aspect": None,
    "experts": False,
    "rank_deficient": "perturbation",
    "rank_atol": 0.0,
    "rank_rtol": 0.0,
    "root_inverse": "eigh",
    "root_max_iterations": 100,
    "root_tolerance": None,
    "root_order": 3,
    "root_rel_epsilon": 0.0,
    "root_abs_epsilon": None,
    "iterate_averaging": None,
    "eval_interp_coeff": 0.9,
    "train_interp_coeff": 0.8,
    "eval_coeff_lr_power": 2,
}

WEIGHT_DECAY_TYPES = ("l2", "decoupled", "corrected", "independent")
# "diagonal": no Kronecker factors; the grafting method alone is the update (biases, norms).
# "kl_shampoo": KL-Shampoo (arXiv 2509.03378), Meta's RootInvKLShampooPreconditionerConfig:
# roots as "shampoo", statistics from the gradient preconditioned by the other dims' roots.
# "spectral_descent": the orthogonalized filtered gradient of a matrix block (Muon; Meta's
# SpectralDescentPreconditionerConfig); "sign_descent": its sign (Meta's
# SignDescentPreconditionerConfig). Neither keeps statistics or refreshes anything.
PRECONDITIONERS = ("shampoo", "eigenvalue_corrected", "diagonal", "kl_shampoo",
                   "spectral_descent", "sign_descent", "eigendecomposed_shampoo",
                   "eigendecomposed_kl_shampoo", "riemannian_lora")
# "riemannian_lora": peft's LoRA factor pairs, each gradient preconditioned by the other
# factor's r x r Gram matrix (+ epsilon, relative), then the grafting method
# (preconditioners/riemannian_lora.py, docs/lora.md); no statistics, nothing to refresh
# Shampoo / KL-Shampoo whose refreshes keep each factor's eigendecomposition (Meta's
# Eigendecomposed*PreconditionerConfig): Meta's eigh with the criterion, or its QR algorithm
EIGENDECOMPOSED_KINDS = ("eigendecomposed_shampoo", "eigendecomposed_kl_shampoo")
# kinds without statistics or amortized computation: precondition_frequency has no effect
# and preconditioning starts at step 1 unless start_preconditioning_step says otherwise
DESCENT_KINDS = ("spectral_descent", "sign_descent", "riemannian_lora")
# kinds that block every parameter as a matrix (dim 0, the rest) instead of merging dims
MATRIX_KINDS = ("spectral_descent", "riemannian_lora")
SPECTRAL_ORTHOGONALIZATIONS = ("newton_schulz", "svd")
NEWTON_SCHULZ_DTYPES = (None, torch.float32, torch.float64, torch.bfloat16, torch.float16)
# torch.optim.Muon's adjust_lr_fn rules on a block of (rows, cols); None: scale 1 (Meta)
SPECTRAL_LR_ADJUSTMENTS = (None, "original", "match_rms_adamw", "spectral_unclamped")
# sign descent's scale: None = 1 (Meta's default); "l1" = the block's ‖Ĝ‖₁ (steepest
# descent under the L∞ norm)
SIGN_SCALES = (None, "l1")
# kinds whose preconditioner is a product of per-dim inverse roots (docs/design.md §2)
ROOT_INVERSE_KINDS = ("shampoo", "kl_shampoo")
# How the inverse roots of rank-deficient factors are made finite (Meta's
# RankDeficientStabilityConfig): "perturbation" = (A + εI)^(-e), eigenvalues below ε lifted
# to ε; "pseudo_inverse" = eigenvalues at or below max(rank_rtol * λ_max, rank_atol) give 0
# (epsilon must be 0; rank_rtol=None: d * eps of the factors' dtype).
RANK_DEFICIENT_MODES = ("perturbation", "pseudo_inverse")
# How Shampoo's inverse roots are computed (Meta's RootInvConfig): "eigh" (EigenConfig);
# "coupled_newton" / "coupled_higher_order" (CoupledNewtonConfig / CoupledHigherOrderConfig:
# matrix products only, root_solvers.py). root_tolerance None: Meta's 1e-6 / 1e-8;
# root_abs_epsilon None: the group's epsilon.
ROOT_INVERSES = ("eigh", "coupled_newton", "coupled_higher_order")
# Iterate averaging (averaging.py; Meta's GeneralizedPrimalAveragingConfig / ScheduleFreeConfig):
# the parameters hold y (where gradients are taken) in train mode, the average x in eval mode.
ITERATE_AVERAGINGS = (None, "gpa", "schedule_free")
EIGENDECOMPOSITIONS = ("eigh", "qr")
# Eigenvalue-corrected refreshes (docs/design.md §3): "meta" = Meta's numbers (eigh's
# ascending basis, QR in the rotated frame from the kept basis, D never permuted);
# "descending" = bases sorted by descending eigenvalue, first refresh by eigh, QR steps
# qr(A Q), D permuted with the basis (warm-started QR keeps more bases valid:
# docs/benchmarks/convergence.md).
EIGENBASIS_VARIANTS = ("meta", "descending")
# How QR refreshes orthogonalise (eigenbasis.orthonormal_basis): LAPACK's Householder QR, or
# shifted Cholesky-QR3 (matrix products; Householder where it cannot do a matrix).
ORTHOGONALIZATIONS = ("householder", "cholesky_qr")
# State storage of the Kronecker factors (docs/design.md §5): None = float32; "4bit" = 4-bit
# eigenvectors with float32 eigenvalues (preconditioners/quantized.py).
QUANTIZATIONS = (None, "4bit")
GRAFTING_TYPES = (None, "sgd", "adagrad", "rmsprop", "adam")
FACTOR_MATRIX_DTYPES = (torch.float32, torch.float64)
# Storage of Shampoo's inverse roots and the dtype of the preconditioning products (Meta's
# inv_factor_matrix_dtype): None = factor_matrix_dtype; bfloat16 / float16 halve the roots'
# memory and run the steady step's products in that dtype (computed in factor dtype, cast).
INV_FACTOR_MATRIX_DTYPES = (None, torch.float32, torch.float64, torch.bfloat16, torch.float16)
DISTRIBUTED_MODES = ("auto", "none", "ddp", "fsdp")
# FSDP2 / HSDP parameters (docs/design.md §8): "lossless" blocks the full parameter (one-process
# numbers); "local" blocks each rank's local shard (no extra communication).
FSDP_MODES = ("lossless", "local")
COMMUNICATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# How blocks are weighed when spread over ranks (distributed.block_cost).
ASSIGNMENT_COSTS = ("memory", "compute")
# "all": every block's amortized computation on the same steps (docs/design.md §2); "staggered":
# each block's schedule delayed by its own offset in [0, precondition_frequency).
REFRESH_SCHEDULES = ("all", "staggered")

# Keywords that describe the whole optimizer, not one group: they must agree across groups.
GLOBAL_KEYS = ("distributed", "fsdp_mode", "communication_dtype", "num_trainers_per_group",
               "assignment_cost", "check_finite_gradients", "compile")
# Keywords that say how this process runs the step, not what it computes: a checkpoint's
# values of them are not loaded (the optimizer's own stay).
RUNTIME_KEYS = ("compile",)

# Keywords that decide which state tensors exist and how parameters are blocked. They are
# fixed once state exists, and a checkpoint must agree with them to be loaded.
LAYOUT_KEYS = (
    "max_preconditioner_dim",
    "preconditioner",
    "eigendecomposition",
    "inverse_exponent_override",
    "grafting",
    "factor_matrix_dtype",
    "inv_factor_matrix_dtype",
    "quantization",
    "vector_preconditioner",
    "diagonal_aspect",
    "experts",
    "iterate_averaging",
)

# Entries other tools put into param groups (torch schedulers, timm, transformers): allowed.
FOREIGN_GROUP_KEYS = frozenset(
    {"params", "param_names", "initial_lr", "lr_scale", "name", "layer_id", "step", "peak_lr",
     "train_mode", "lr_sum"}
)


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ValueError(f"DistributedShampoo: invalid {key}={value!r}; {allowed}")


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _check_real(key: str, value: Any, low: float, high: float, low_open=False, high_open=False):
    ok = _is_real(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (
            value < high if high_open else value <= high
        )
    if not ok:
        if high == math.inf:
            _fail(key, value, f"expected a finite real number {'>' if low_open else '>='} {low}")
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        _fail(key, value, f"expected a finite real number in {lo}{low}, {high}{hi}")


def _check_int(key: str, value: Any, low: int) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
        _fail(key, value, f"expected an integer >= {low}")


def _check_choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        _fail(key, value, f"expected one of {', '.join(repr(c) for c in choices)}")


def _check_exponent_override(value: Any) -> None:
    key = "inverse_exponent_override"
    if value is None:
        return
    if not isinstance(value, dict):
        _fail(key, value, "expected None or a dict {order: exponent} / {order: {dim: exponent}}")
    for order, entry in value.items():
        if not isinstance(order, numbers.Integral) or isinstance(order, bool) or order < 0:
            _fail(key, value, f"order keys must be integers >= 0, got {order!r}")
        per_dim = entry if isinstance(entry, dict) else {None: entry}
        for dim, exponent in per_dim.items():
            if dim is not None and (
                not isinstance(dim, numbers.Integral)
                or isinstance(dim, bool)
                or not 0 <= dim < order
            ):
                _fail(key, value, f"dim keys of order {order} must be integers in [0, {order})")
            if not _is_real(exponent) or exponent < 0:
                _fail(key, value, f"exponents must be real numbers >= 0, got {exponent!r}")


def is_elongated(shape: tuple[int, ...], group: Any) -> bool:
    """A matrix whose long side is at least ``diagonal_aspect`` times the short one: it is
    blocked as a matrix (never merged into one dim), so that its long side can be diagonal."""
    aspect = group.get("diagonal_aspect")
    if aspect is None or len(shape) != 2 or min(shape) == 0:
        return False
    return max(shape) >= aspect * min(shape)


def diagonal_dims(shape: tuple[int, ...], group: Any) -> list[int]:
    """The dim of a matrix block whose factor is kept diagonal (``diagonal_aspect``): the
    long side, where it is at least ``diagonal_aspect`` times the short one (a LoRA
    adapter's ``d × r``); none for other blocks or without ``diagonal_aspect``."""
    aspect = group.get("diagonal_aspect")
    if aspect is None or len(shape) != 2:
        return []
    long = 0 if shape[0] >= shape[1] else 1
    return [long] if shape[long] >= aspect * shape[1 - long] else []


def vector_settings(group: dict[str, Any]) -> dict[str, Any]:
    """What ``vector_preconditioner`` changes for a group's vector-like parameters (at most
    one dim larger than 1: biases, norm weights): that kind, and Adam grafting where the
    group has none and the kind needs a step size to graft onto ("diagonal"). Empty when
    the group has no ``vector_preconditioner``."""
    kind = group.get("vector_preconditioner")
    if kind is None:
        return {}
    settings: dict[str, Any] = {"preconditioner": kind, "vector_preconditioner": None}
    if kind == "diagonal" and group["grafting"] is None:
        settings["grafting"] = "adam"
    return settings


def did_you_mean(name: Any, choices: Any) -> str:
    """`` (did you mean 'x'?)`` with the closest of ``choices`` to ``name``, or ``""``."""
    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def refuse_unknown_keywords(unknown: dict[str, Any], where: str) -> None:
    """Raise ``TypeError`` for keywords no option has, with the closest valid names and the
    list of every valid keyword (Python's own error lists none)."""
    hints = [f"{name!r}{did_you_mean(name, DEFAULTS)}" for name in sorted(unknown)]
    raise TypeError(
        f"{where}: unknown keyword argument(s) {', '.join(hints)}; valid keywords are "
        f"params, {', '.join(DEFAULTS)}"
    )


# Keywords that act on some preconditioner kinds only (the others ignore them); every
# keyword not listed acts on every kind. Used to report a keyword set for an optimizer
# none of whose groups it changes (``inert_keywords``).
STATISTICS_KINDS = tuple(k for k in PRECONDITIONERS if k not in ("diagonal",) + DESCENT_KINDS)
_STATISTICS_ONLY = (
    "epsilon", "precondition_frequency", "eigendecomposition", "eigenbasis_tolerance",
    "qr_max_iterations", "eigenbasis_variant", "orthogonalization", "quantization",
    "statistics_frequency", "statistics_warmup", "inverse_exponent_override",
    "inv_factor_matrix_dtype", "refresh_schedule", "diagonal_aspect", "rank_deficient",
    "rank_atol", "rank_rtol", "root_inverse", "root_max_iterations", "root_tolerance",
    "root_order", "root_rel_epsilon", "root_abs_epsilon",
)
KIND_KEYWORDS: dict[str, tuple[str, ...]] = {
    **{key: STATISTICS_KINDS for key in _STATISTICS_ONLY},
    "epsilon": STATISTICS_KINDS + ("riemannian_lora",),  # its Gram matrices' delta
    **{key: ("spectral_descent",) for key in (
        "spectral_orthogonalization", "newton_schulz_iterations", "newton_schulz_coefficients",
        "newton_schulz_dtype", "spectral_lr_adjustment")},
    "sign_scale": ("sign_descent",),
}


def keyword_acts(key: str, group: dict[str, Any]) -> bool:
    """Whether ``key`` changes anything in a (fully defaulted) group: its kind, or the kind
    of its vector-like parameters, uses it. ``start_preconditioning_step`` acts on the kinds
    with statistics, and on the descent kinds only with a grafting method (their warm-up is
    the grafting method alone)."""
    kinds = {group["preconditioner"], group.get("vector_preconditioner")} - {None}
    if key == "start_preconditioning_step":
        return any(k in STATISTICS_KINDS or (k in DESCENT_KINDS and group["grafting"] is not None)
                   for k in kinds)
    allowed = KIND_KEYWORDS.get(key)
    return allowed is None or bool(kinds & set(allowed))


def inert_keywords(keys: Any, groups: list[dict[str, Any]]) -> list[str]:
    """The keys among ``keys`` that change nothing in any of ``groups`` (fully defaulted)."""
    return [key for key in keys if not any(keyword_acts(key, g) for g in groups)]


def validate_group(group: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the first invalid keyword of a fully defaulted group."""
    unknown = sorted(k for k in group if k not in DEFAULTS and k not in FOREIGN_GROUP_KEYS)
    if unknown:
        raise ValueError(
            f"DistributedShampoo: unknown keyword(s) {', '.join(map(repr, unknown))}; "
            f"valid keywords are {', '.join(DEFAULTS)}"
        )
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            _fail("lr", lr, "Tensor lr must be 1-element: expected a finite real number >= 0 "
                  "or a one-element tensor")
    else:
        _check_real("lr", lr, 0.0, math.inf)
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        _fail("betas", betas, "expected a pair (beta1, beta2)")
    _check_real("betas[0]", betas[0], 0.0, 1.0, high_open=True)
    _check_real("betas[1]", betas[1], 0.0, 1.0, low_open=True)
    if group["beta3"] is not None:
        _check_real("beta3", group["beta3"], 0.0, 1.0, high_open=True)
    _check_rank_deficient(group)
    _check_root_inverse(group)
    _check_real("momentum", group["momentum"], 0.0, 1.0, high_open=True)
    _check_iterate_averaging(group)
    _check_real("dampening", group["dampening"], 0.0, 1.0)
    if not isinstance(group["nesterov"], bool):
        _fail("nesterov", group["nesterov"], "expected True or False")
    _check_real("weight_decay", group["weight_decay"], 0.0, math.inf)
    _check_choice("weight_decay_type", group["weight_decay_type"], WEIGHT_DECAY_TYPES)
    if not isinstance(group["use_bias_correction"], bool):
        _fail("use_bias_correction", group["use_bias_correction"], "expected True or False")
    if not isinstance(group["check_finite_gradients"], bool):
        _fail("check_finite_gradients", group["check_finite_gradients"], "expected True or False")
    _check_compile(group["compile"])
    _check_int("max_preconditioner_dim", group["max_preconditioner_dim"], 1)
    _check_int("precondition_frequency", group["precondition_frequency"], 1)
    _check_choice("preconditioner", group["preconditioner"], PRECONDITIONERS)
    vector_kind = group["vector_preconditioner"]
    if vector_kind is not None:
        _check_choice("vector_preconditioner", vector_kind,
                      tuple(k for k in PRECONDITIONERS if k not in MATRIX_KINDS))
    start = group["start_preconditioning_step"]
    if start is not None:
        descent = group["preconditioner"] in DESCENT_KINDS
        f = 1 if descent else group["precondition_frequency"]
        if not isinstance(start, numbers.Integral) or isinstance(start, bool) or start < f:
            _fail(
                "start_preconditioning_step",
                start,
                "expected None or an integer >= 1 (preconditioner="
                f"{group['preconditioner']!r} refreshes nothing)" if descent else
                f"expected None or an integer >= precondition_frequency ({f})",
            )
    _check_choice("eigendecomposition", group["eigendecomposition"], EIGENDECOMPOSITIONS)
    _check_real("eigenbasis_tolerance", group["eigenbasis_tolerance"], 0.0, 1.0)
    _check_int("qr_max_iterations", group["qr_max_iterations"], 1)
    _check_choice("eigenbasis_variant", group["eigenbasis_variant"], EIGENBASIS_VARIANTS)
    _check_choice("orthogonalization", group["orthogonalization"], ORTHOGONALIZATIONS)
    _check_choice("quantization", group["quantization"], QUANTIZATIONS)
    if group["quantization"] is None and group["statistics_frequency"] is not None:
        _fail("statistics_frequency", group["statistics_frequency"], "it sets how often "
              "4-bit factors are sampled: expected None unless quantization='4bit' (32-bit "
              "factors take every gradient)")
    if group["quantization"] is None and group["statistics_warmup"] is not None:
        _fail("statistics_warmup", group["statistics_warmup"], "it sets how many first "
              "steps sample every gradient into 4-bit factors: expected None unless "
              "quantization='4bit' (32-bit factors take every gradient)")
    if group["quantization"] == "4bit":
        if group["preconditioner"] in ("kl_shampoo", "eigendecomposed_kl_shampoo"):
            _fail("quantization", "4bit", "4-bit state exists for preconditioner 'shampoo', "
                  "'eigendecomposed_shampoo' and 'eigenvalue_corrected' (and has no effect "
                  f"with 'diagonal'), not for {group['preconditioner']!r}: 4-bit factors "
                  "are rebuilt from sampled raw gradients, KL-Shampoo's take every step's "
                  "gradient preconditioned by the current roots")
        every = group["statistics_frequency"]
        if group["statistics_warmup"] is not None:
            _check_int("statistics_warmup", group["statistics_warmup"], 0)
        if (every is None and group["statistics_warmup"] == 0
                and group["preconditioner"] == "eigenvalue_corrected"):
            _fail("statistics_frequency", None, "4-bit eigenvalue-corrected Shampoo without "
                  "a warm-up (statistics_warmup=0) needs an explicit sample cadence: with "
                  "samples at refresh steps only, one sampled gradient gives rank-deficient "
                  "factors whose arbitrary eigenbasis meets D's zero entries (it diverged on "
                  "a small CNN; docs/benchmarks/memory.md)")
        if every is not None:
            _check_int("statistics_frequency", every, 1)
            if group["precondition_frequency"] % every != 0:
                _fail("statistics_frequency", every, "expected None or a divisor of "
                      f"precondition_frequency ({group['precondition_frequency']})")
        if group["factor_matrix_dtype"] != torch.float32:
            _fail("quantization", "4bit", "4-bit state keeps its eigenvalues in float32: "
                  "factor_matrix_dtype must be torch.float32")
    _check_exponent_override(group["inverse_exponent_override"])
    if group["preconditioner"] == "eigenvalue_corrected":
        _check_corrected_override(group["inverse_exponent_override"])
    _check_choice("grafting", group["grafting"], GRAFTING_TYPES)
    _check_real("grafting_beta2", group["grafting_beta2"], 0.0, 1.0)
    if group["grafting"] in ("rmsprop", "adam") and group["grafting_beta2"] >= 1.0:
        _fail("grafting_beta2", group["grafting_beta2"], f"expected < 1 for {group['grafting']!r}")
    _check_real("grafting_epsilon", group["grafting_epsilon"], 0.0, math.inf, low_open=True)
    _check_choice("factor_matrix_dtype", group["factor_matrix_dtype"], FACTOR_MATRIX_DTYPES)
    _check_choice("inv_factor_matrix_dtype", group["inv_factor_matrix_dtype"],
                  INV_FACTOR_MATRIX_DTYPES)
    kind = group["preconditioner"]
    has_roots = kind == "shampoo" and group["quantization"] is None
    rootless = ("diagonal",) + DESCENT_KINDS
    if group["inv_factor_matrix_dtype"] is not None and not (has_roots or kind in rootless):
        _fail("inv_factor_matrix_dtype", group["inv_factor_matrix_dtype"],
              "it sets the dtype of the inverse roots of preconditioner='shampoo' without "
              "quantization (and has no effect with 'diagonal', 'spectral_descent' and "
              "'sign_descent'): expected None here "
              f"(preconditioner={kind!r}, quantization={group['quantization']!r})")
    _check_descent(group)
    _check_choice("distributed", group["distributed"], DISTRIBUTED_MODES)
    _check_choice("fsdp_mode", group["fsdp_mode"], FSDP_MODES)
    _check_choice("communication_dtype", group["communication_dtype"], COMMUNICATION_DTYPES)
    _check_choice("assignment_cost", group["assignment_cost"], ASSIGNMENT_COSTS)
    _check_choice("refresh_schedule", group["refresh_schedule"], REFRESH_SCHEDULES)
    n = group["num_trainers_per_group"]
    if not isinstance(n, numbers.Integral) or isinstance(n, bool) or not (n == -1 or n >= 1):
        _fail("num_trainers_per_group", n, "expected -1 (the whole world) or an integer >= 1")
    if not isinstance(group["experts"], bool):
        _fail("experts", group["experts"], "expected True (dim 0 of every parameter of the "
              "group indexes independent experts, each blocked, preconditioned and "
              "orthogonalized on its own) or False")
    aspect = group["diagonal_aspect"]
    if aspect is not None:
        _check_real("diagonal_aspect", aspect, 1.0, math.inf)
        if group["preconditioner"] != "shampoo" or group["quantization"] is not None:
            _fail("diagonal_aspect", aspect, "a diagonal long side exists for "
                  "preconditioner='shampoo' without quantization: expected None here "
                  f"(preconditioner={group['preconditioner']!r}, "
                  f"quantization={group['quantization']!r})")
    if group["vector_preconditioner"] is not None:
        try:  # the settings vector-like parameters get must be valid too
            validate_group({**group, **vector_settings(group)})
        except ValueError as error:
            raise ValueError(f"{error} (for the vector-like parameters of a group with "
                             f"vector_preconditioner={group['vector_preconditioner']!r})"
                             ) from None


def _check_compile(value: Any) -> None:
    """``compile``: a bool, or a dict of ``torch.compile`` keyword arguments."""
    if isinstance(value, bool):
        return
    if not isinstance(value, dict):
        _fail("compile", value, "expected True, False or a dict of torch.compile keyword "
              "arguments such as {'backend': 'aot_eager'} or {'mode': 'max-autotune'}")
    allowed = compile_parameters()
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        _fail("compile", value, f"unknown torch.compile keyword(s) {', '.join(unknown)}; "
              f"torch.compile takes {', '.join(allowed)}")


def _check_rank_deficient(group: dict[str, Any]) -> None:
    """``epsilon`` with ``rank_deficient``, ``rank_atol``, ``rank_rtol`` (Meta's rule: the
    pseudo-inverse takes ``epsilon=0``; the perturbation needs ``epsilon > 0``)."""
    mode = group["rank_deficient"]
    _check_choice("rank_deficient", mode, RANK_DEFICIENT_MODES)
    _check_real("rank_atol", group["rank_atol"], 0.0, math.inf)
    if group["rank_rtol"] is not None:
        _check_real("rank_rtol", group["rank_rtol"], 0.0, math.inf)
    if mode == "perturbation":
        _check_real("epsilon", group["epsilon"], 0.0, math.inf, low_open=True)
        return
    epsilon = group["epsilon"]
    if not _is_real(epsilon) or epsilon != 0:
        _fail("epsilon", epsilon, "expected 0.0 with rank_deficient='pseudo_inverse' (the "
              "pseudo-inverse drops the directions at or below the rank cutoff instead of "
              "adding epsilon)")
    roots = ROOT_INVERSE_KINDS + EIGENDECOMPOSED_KINDS
    if group["preconditioner"] not in roots + ("diagonal",) + DESCENT_KINDS:
        _fail("rank_deficient", mode, "the pseudo-inverse is for the inverse roots of "
              f"preconditioner {', '.join(map(repr, roots))}: with "
              f"{group['preconditioner']!r}, epsilon is the corrected second moment's and "
              "must be > 0; expected 'perturbation' here")


def _check_iterate_averaging(group: dict[str, Any]) -> None:
    """``iterate_averaging`` and its coefficients (Meta's ranges); it replaces momentum, as
    Meta's one ``iterate_averaging_config`` holds either classic momentum or averaging."""
    mode = group["iterate_averaging"]
    _check_choice("iterate_averaging", mode, ITERATE_AVERAGINGS)
    _check_real("eval_interp_coeff", group["eval_interp_coeff"], 0.0, 1.0, high_open=True)
    _check_real("train_interp_coeff", group["train_interp_coeff"], 0.0, 1.0, low_open=True)
    _check_real("eval_coeff_lr_power", group["eval_coeff_lr_power"], 0.0, math.inf)
    if mode is not None and group["momentum"] > 0:
        _fail("momentum", group["momentum"], f"iterate_averaging={mode!r} is the momentum of "
              "the averaged sequences (train_interp_coeff=1.0 with 'gpa' is heavy ball): "
              "expected 0.0 with it")


def _check_root_inverse(group: dict[str, Any]) -> None:
    """``root_inverse`` and its keywords; the coupled iterations need integer roots and
    compute the roots alone (no eigenvectors: no QR, criterion, 4-bit or pseudo-inverse)."""
    solver = group["root_inverse"]
    _check_choice("root_inverse", solver, ROOT_INVERSES)
    _check_int("root_max_iterations", group["root_max_iterations"], 1)
    if group["root_tolerance"] is not None:
        _check_real("root_tolerance", group["root_tolerance"], 0.0, math.inf)
    _check_int("root_order", group["root_order"], 2)
    _check_real("root_rel_epsilon", group["root_rel_epsilon"], 0.0, math.inf)
    if group["root_abs_epsilon"] is not None:
        _check_real("root_abs_epsilon", group["root_abs_epsilon"], 0.0, math.inf)
    if solver == "eigh" or group["preconditioner"] in ("diagonal",) + DESCENT_KINDS:
        return
    where = f"root_inverse={solver!r} computes inverse roots by matrix products"
    if group["preconditioner"] not in ROOT_INVERSE_KINDS:
        _fail("root_inverse", solver, f"{where}, for preconditioner "
              f"{' or '.join(map(repr, ROOT_INVERSE_KINDS))}: expected 'eigh' with "
              f"{group['preconditioner']!r}")
    for key, plain in (("quantization", None), ("eigendecomposition", "eigh"),
                       ("eigenbasis_tolerance", 0.0), ("rank_deficient", "perturbation")):
        if group[key] != plain:
            _fail(key, group[key], f"{where} and keeps no eigenvectors or eigenvalues: "
                  f"expected {plain!r} with it")
    for order, entry in (group["inverse_exponent_override"] or {}).items():
        exponents = entry.values() if isinstance(entry, dict) else [entry]
        for e in exponents:
            if e != 0 and abs(1 / e - round(1 / e)) > 1e-9:
                _fail("inverse_exponent_override", group["inverse_exponent_override"],
                      f"{where}: every exponent must be 1/p for an integer p (or 0), "
                      f"got {e} for order {order}")


def _check_descent(group: dict[str, Any]) -> None:
    """The keywords of spectral and sign descent (valid in every group; used by those)."""
    _check_choice("spectral_orthogonalization", group["spectral_orthogonalization"],
                  SPECTRAL_ORTHOGONALIZATIONS)
    _check_int("newton_schulz_iterations", group["newton_schulz_iterations"], 1)
    coefficients = group["newton_schulz_coefficients"]
    if not (isinstance(coefficients, (tuple, list)) and len(coefficients) == 3
            and all(_is_real(c) for c in coefficients)):
        _fail("newton_schulz_coefficients", coefficients,
              "expected three finite real numbers (a, b, c) of the quintic iteration "
              "X <- aX + b(XX^T)X + c(XX^T)^2 X")
    _check_choice("newton_schulz_dtype", group["newton_schulz_dtype"], NEWTON_SCHULZ_DTYPES)
    _check_choice("spectral_lr_adjustment", group["spectral_lr_adjustment"],
                  SPECTRAL_LR_ADJUSTMENTS)
    _check_choice("sign_scale", group["sign_scale"], SIGN_SCALES)


def _check_corrected_override(value: Any) -> None:
    """Eigenvalue-corrected mode: per-dim entries may only be 0 (keep that dim's basis)."""
    for entry in (value or {}).values():
        if isinstance(entry, dict) and any(e != 0 for e in entry.values()):
            _fail(
                "inverse_exponent_override",
                value,
                "with preconditioner='eigenvalue_corrected' a per-dim entry may only be 0 "
                "(that dim keeps the identity basis); {order: e} sets the exponent of the "
                "corrected eigenvalues (default 0.5)",
            )


def start_step(group: dict[str, Any]) -> int:
    """The first preconditioned step ``s`` (None means precondition_frequency; 1 for the
    descent kinds, which have nothing to accumulate first)."""
    start = group["start_preconditioning_step"]
    if start is None:
        return 1 if group["preconditioner"] in DESCENT_KINDS else group["precondition_frequency"]
    return int(start)


def is_refresh_step(group: dict[str, Any], step: int, offset: int = 0) -> bool:
    """docs/design.md §2: ``(t % f == 0 and t > s) or t == s``, with ``t`` the step minus
    the block's schedule offset (0 unless ``refresh_schedule="staggered"``)."""
    if group["preconditioner"] in DESCENT_KINDS:
        return False  # nothing to refresh
    f, s, t = group["precondition_frequency"], start_step(group), step - offset
    return (t % f == 0 and t > s) or t == s


def is_preconditioning(group: dict[str, Any], step: int, offset: int = 0) -> bool:
    """Whether a block with this schedule offset is past its start: ``t - offset >= s``."""
    return step - offset >= start_step(group)


def dim_exponents(group: dict[str, Any], order: int) -> list[float]:
    """Exponent ``e_j`` of each dim of a block of this order (0 leaves the dim alone).

    Shampoo: ``1/(2k)`` unless ``inverse_exponent_override`` says otherwise. Eigenvalue-
    corrected: 1.0 marks a rotated dim, 0 a dim that keeps the identity basis.
    """
    if group["preconditioner"] in ("diagonal",) + DESCENT_KINDS:
        return [0.0] * order
    override = (group["inverse_exponent_override"] or {}).get(order)
    corrected = group["preconditioner"] == "eigenvalue_corrected"
    default = 1.0 if corrected else 1.0 / (2 * order)
    if isinstance(override, dict):
        return [float(override.get(j, default)) for j in range(order)]
    if override is not None and not corrected:
        return [float(override)] * order
    return [default] * order


def corrected_exponent(group: dict[str, Any], order: int) -> float:
    """Eigenvalue-corrected mode: exponent applied to ``D / bc2`` (0.5 unless overridden)."""
    override = (group["inverse_exponent_override"] or {}).get(order)
    return 0.5 if override is None or isinstance(override, dict) else float(override)
