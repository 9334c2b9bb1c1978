"""The keyword rows of the Kronecker-factored kinds (``base.KroneckerFactored.keywords``):
decompositions and refreshes, 4-bit state, exponents, root dtype, rank-deficient factors and
the coupled root iterations. Their cross-keyword rules are the kinds' ``check`` methods.
"""

from __future__ import annotations

import numbers
from typing import Any

from ..keywords import Keyword, choice, fail, integer, is_real, real, scoped, working_dtype


def check_exponent_override(key: str, value: Any) -> None:
    """``{order: exponent}`` or ``{order: {dim: exponent}}``, exponents >= 0."""
    if not isinstance(value, dict):
        fail(key, value, "expected None or a dict {order: exponent} / {order: {dim: exponent}}")
    for order, entry in value.items():
        if not isinstance(order, numbers.Integral) or isinstance(order, bool) or order < 0:
            fail(key, value, f"order keys must be integers >= 0, got {order!r}")
        per_dim = entry if isinstance(entry, dict) else {None: entry}
        for dim, exponent in per_dim.items():
            if dim is not None and (
                not isinstance(dim, numbers.Integral)
                or isinstance(dim, bool)
                or not 0 <= dim < order
            ):
                fail(key, value, f"dim keys of order {order} must be integers in [0, {order})")
            if not is_real(exponent) or exponent < 0:
                fail(key, value, f"exponents must be real numbers >= 0, got {exponent!r}")


FACTORED_KEYWORDS = (
    Keyword("eigendecomposition", "eigh", str, choice("eigh", "qr"), scope=scoped('layout'), doc=(
            "`\"eigh\"` or `\"qr\"` (warm-started QR iterations; eigenvalue-corrected: Meta's "
            "`qr_algorithm`)")),
    Keyword("eigenbasis_tolerance", 0.0, float, real(0.0, 1.0), doc=(
            "adaptive refresh: skip a refresh while the basis' off-diagonal ratio is `<=` "
            "this")),
    Keyword("qr_max_iterations", 1, int, integer(1), doc=(
            "QR iterations per refresh with `eigendecomposition=\"qr\"`")),
    Keyword("eigenbasis_variant", "meta", str, choice("meta", "descending"), doc=(
            "eigenvalue-corrected refreshes: `\"meta\"` (Meta's numbers) or `\"descending\"` "
            "(bases kept by descending eigenvalue, first refresh by eigh, QR steps "
            "`qr(AQ)`, `D` permuted with the basis: with a tolerance, more bases stay "
            "valid; see "
            "[convergence](benchmarks/convergence.md#convergence-w"
            "ith-metas-eigenvalue-corrected-semantics-kl-shampoo))")),
    Keyword("orthogonalization", "householder", str, choice("householder", "cholesky_qr"), doc=(
            "how QR refreshes orthogonalise: `\"householder\"` (LAPACK, Meta's) or "
            "`\"cholesky_qr\"` (shifted Cholesky-QR3: matrix products, a Cholesky "
            "factorization and a triangular solve per pass; the same basis up to column "
            "signs, Householder for matrices it cannot do; see "
            "[Performance](performance.md))")),
    Keyword("quantization", None, str, choice(None, "4bit"), scope=scoped('layout'), doc=(
            "`\"4bit\"`: keep each Kronecker factor of at least 4096 elements as float32 "
            "eigenvalues + 4-bit eigenvectors, Shampoo's inverse roots as a float32 "
            "diagonal + 4-bit off-diagonal ([design §5](design.md), arXiv 2405.18144); "
            "factors are then sampled, not updated every step (see [4-bit "
            "state](memory.md)). For `\"shampoo\"`, `\"eigendecomposed_shampoo\"` (its "
            "criterion then decides at each sample whether the kept, dequantised basis "
            "stays) and `\"eigenvalue_corrected\"` (no effect with `\"diagonal\"`; refused for "
            "the KL kinds, whose statistics take every step's preconditioned gradient). With "
            "`\"sketchy\"`: the sketches' and roots' `d × k` bases in 4 bits, every size "
            "(the sketches still take every gradient; [Sketchy](sketchy.md))")),
    Keyword("statistics_frequency", None, int, integer(1), doc=(
            "with `quantization=\"4bit\"`: take a gradient sample into the 4-bit factors "
            "every this many steps (a divisor of `precondition_frequency`; `None` → at "
            "refresh steps only; required with `\"eigenvalue_corrected\"`, where 1 is what "
            "was measured to work); with `preconditioner=\"sketchy\"`: the sketches take "
            "the gradient every this many steps and at refreshes (the reference's "
            "`update_freq`; `None` → every step; the full factors take every gradient)")),
    Keyword("statistics_warmup", None, int, integer(0), doc=(
            "with `quantization=\"4bit\"`: the first this many steps of each block's schedule"
            " take every gradient into the 4-bit factors (a decomposition each, once); "
            "`None` → up to the first refresh (`start_preconditioning_step`, by default "
            "`precondition_frequency`), so the first roots are those of 32 bits; `0` → no "
            "warm-up (one sample per refresh from the start)")),
    Keyword("inverse_exponent_override", None, dict, check_exponent_override,
            scope=scoped('layout'), annotation="dict[int, float | dict[int, float]]", doc=(
            "`{order: e}` or `{order: {dim: e}}` root exponents; `e = 0` leaves a dim "
            "unpreconditioned (default: `1/(2·order)` for `\"shampoo\"`; with "
            "`\"eigenvalue_corrected\"`, `{order: e}` is the exponent of the corrected "
            "eigenvalues, default 0.5, and per-dim entries may only be 0)")),
    working_dtype("inv_factor_matrix_dtype", scope=scoped('layout'), doc=(
            "dtype of Shampoo's inverse roots and of the steady step's preconditioning "
            "products (Meta's option of that name; `None` = `factor_matrix_dtype`; "
            "`torch.bfloat16` / `torch.float16` halve the roots' memory and use the GPU's "
            "fast matmuls; `preconditioner=\"shampoo\"` without quantization only)")),
    Keyword("diagonal_aspect", None, float, real(1.0), scope=scoped('layout'), doc=(
            "a matrix whose long side is at least this many times its short side (a LoRA "
            "adapter's `d × r`) is blocked as a matrix and keeps the long side's factor and"
            " root as their diagonal (`d` numbers instead of `d × d`), the short side's in "
            "full: `diag(L)^(-1/4) · G · R^(-1/4)`. `preconditioner=\"shampoo\"` without "
            "quantization. `None`: every factor full (Meta's). The module presets "
            "(`make_optimizer`, the Trainer) set it for peft's `lora_A` / `lora_B` (any "
            "aspect) and for matrices 16× longer than wide; an override wins")),
    Keyword("rank_deficient", "perturbation", str, choice("perturbation", "pseudo_inverse"), doc=(
            "how the inverse roots of rank-deficient factors stay finite (Meta's "
            "`RankDeficientStabilityConfig`): `\"perturbation\"` (`(A + εI)^(-e)`, "
            "eigenvalues below ε lifted to ε; Meta's default) or `\"pseudo_inverse\"` (Meta's"
            " `PseudoInverseConfig`: an eigenvalue at or below `max(rank_rtol · λ_max, "
            "rank_atol)` contributes 0 instead of `λ^(-e)`; `epsilon` must be `0.0`). "
            "`preconditioner=\"shampoo\"` and `\"kl_shampoo\"` (4-bit included); see [design "
            "§2](design.md)")),
    Keyword("rank_atol", 0.0, float, real(0.0), doc=(
            "pseudo-inverse: absolute eigenvalue cutoff")),
    Keyword("rank_rtol", 0.0, float, real(0.0), nullable=True, doc=(
            "pseudo-inverse: cutoff relative to the largest eigenvalue; `None` = `d ·` "
            "machine epsilon of the factors' dtype (`torch.linalg.matrix_rank`'s rule: "
            "drops what rounding cannot resolve; what timm's `\"shampoo\"` uses)")),
    Keyword("root_inverse", "eigh", str, choice("eigh", "coupled_newton", "coupled_higher_order"),
            doc=(
            "how Shampoo's inverse roots are computed at refreshes (Meta's "
            "`RootInvConfig`): `\"eigh\"` (a symmetric eigendecomposition, `EigenConfig`), "
            "`\"coupled_newton\"` (`CoupledNewtonConfig`: `(A + εI)^(-1/p)` by the coupled "
            "Newton iteration, matrix products only) or `\"coupled_higher_order\"` "
            "(`CoupledHigherOrderConfig`: Lakić's iteration of order `root_order`). Each "
            "matrix iterates until its own error test stops it, batched with the others; a "
            "failed one keeps its previous root. `preconditioner=\"shampoo\"` / "
            "`\"kl_shampoo\"`, without QR, the adaptive criterion, 4-bit state or the "
            "pseudo-inverse (they need eigenvectors), every exponent `1/p` with `p` an "
            "integer. See [Performance](performance.md) for their cost")),
    Keyword("root_max_iterations", 100, int, integer(1), doc=(
            "coupled iterations: the most steps per refresh")),
    Keyword("root_tolerance", None, float, real(0.0), doc=(
            "coupled iterations: stop once `max|M − I|` is at most this (`None`: Meta's "
            "1e-6 for Newton, 1e-8 for higher order)")),
    Keyword("root_order", 3, int, integer(2), doc=(
            "`\"coupled_higher_order\"`: the order (2 = Newton's step)")),
    Keyword("root_rel_epsilon", 0.0, float, real(0.0), doc=(
            "`\"coupled_higher_order\"`: ridge relative to `‖A‖_∞`")),
    Keyword("root_abs_epsilon", None, float, real(0.0), doc=(
            "`\"coupled_higher_order\"`: absolute ridge (`None`: `epsilon`); the ridge is "
            "`max(root_rel_epsilon · ‖A‖_∞, root_abs_epsilon)` and replaces `epsilon` "
            "there, as in Meta's config")),
)
