"""The keyword table, and everything generated from it (docs/design.md §7).

``TABLE`` is every keyword of ``DistributedShampoo``: the common rows below, then the rows
each preconditioner kind declares (``Preconditioner.keywords``). From it come ``DEFAULTS``,
the scope sets (``GLOBAL_KEYS``, ``RUNTIME_KEYS``, ``LAYOUT_KEYS``), the constructor's
signature (``signature``, and its annotated source generated into optimizer.py,
``signature_source``), ``validate_group`` (each row's check, the common cross-keyword
rules here, then the group's kind's ``check``), which kinds a keyword acts on
(``keyword_acts``), the types ``optim_args`` casts to, and the table of docs/keywords.md
(``keyword_reference``; tests compare the generated files with them; ``python -m
hf_shampoo.config`` rewrites both). Errors name the keyword, the value given and
what is allowed. Nothing here branches on a kind's name: the kinds say what they are.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

import torch

from .compiled import compile_parameters
from .keywords import (
    Keyword,
    boolean,
    check_int,
    choice,
    did_you_mean,
    fail,
    integer,
    is_real,
    real,
    render_source,
    render_table,
    scoped,
)
from .preconditioners import KINDS
from .preconditioners.shampoo import diagonal_dims, is_elongated

_EXPERTS = (" (dim 0 of every parameter of the group indexes independent experts, each "
            "blocked, preconditioned and orthogonalized on its own)")


def _check_lr(key: str, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            fail(key, value, "Tensor lr must be 1-element: expected a finite real number >= 0 "
                 "or a one-element tensor")
        return
    real(0.0)(key, value)


def _check_betas(key: str, value: Any) -> None:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        fail(key, value, "expected a pair (beta1, beta2)")
    real(0.0, 1.0, high_open=True)("betas[0]", value[0])
    real(0.0, 1.0, low_open=True)("betas[1]", value[1])


def _check_start(key: str, value: Any) -> None:
    try:
        check_int(key, value, 1)
    except ValueError:
        fail(key, value, "expected None or an integer >= 1 (at least precondition_frequency "
             "for a kind that refreshes)")


def _check_trainers(key: str, value: Any) -> None:
    try:
        check_int(key, value, -1)
        ok = value == -1 or value >= 1
    except ValueError:
        ok = False
    if not ok:
        fail(key, value, "expected -1 (the whole world) or an integer >= 1")


def _check_compile(key: str, value: Any) -> None:
    """A bool, or a dict of ``torch.compile`` keyword arguments."""
    if isinstance(value, bool):
        return
    if not isinstance(value, dict):
        fail(key, value, "expected True, False or a dict of torch.compile keyword "
             "arguments such as {'backend': 'aot_eager'} or {'mode': 'max-autotune'}")
    allowed = compile_parameters()
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        fail(key, value, f"unknown torch.compile keyword(s) {', '.join(unknown)}; "
             f"torch.compile takes {', '.join(allowed)}")


# The keywords every kind has (in the constructor's order); ``POSITIONAL`` may be passed
# by position, the others by name only (as torch's optimizers do).
def _epsilon_check(key: str, value: Any) -> None:
    """ε: a finite real number > 0, or 0.0 (the pseudo-inverse's; its rule is the kind's)."""
    if not is_real(value) or value < 0:
        fail(key, value, "expected a finite real number > 0.0 (or 0.0 with "
                         "rank_deficient='pseudo_inverse')")


COMMON_KEYWORDS: tuple[Keyword, ...] = (
    Keyword("lr", 1e-2, float, _check_lr, annotation="float | torch.Tensor", doc=(
            "learning rate")),
    Keyword("betas", (0.9, 1.0), tuple, _check_betas, annotation="tuple[float, float]", doc=(
            "`(beta1, beta2)`: gradient momentum (0 disables the filter); factor-matrix EMA"
            " (1.0 = sum, AdaGrad-style)")),
    Keyword("beta3", None, float, real(0.0, 1.0, high_open=True), doc=(
            "coefficient that forms the filtered gradient, `beta3·M_prev + (1−beta3)·G` "
            "(`None` → `beta1`; differing from `beta1` gives a Nesterov-style look-ahead)")),
    Keyword("epsilon", 1e-12, float, _epsilon_check, doc=(
            "regularisation added before the root inverse / eigendecomposition (must be "
            "`0.0` with `rank_deficient=\"pseudo_inverse\"`); a tiny one (the default) "
            "amplifies rounding while factors are rank-deficient, so setups that round "
            "differently move apart by percents: 1e-8..1e-6 in float32 where runs must "
            "reproduce across setups ([hyperparameter guide](hyperparameters.md))")),
    Keyword("momentum", 0.0, float, real(0.0, 1.0, high_open=True), doc=(
            "classic (heavy-ball) momentum applied to the search direction")),
    Keyword("dampening", 0.0, float, real(0.0, 1.0), doc=(
            "dampening of that momentum")),
    Keyword("nesterov", False, bool, boolean(), doc=(
            "Nesterov variant of that momentum")),
    Keyword("weight_decay", 0.0, float, real(0.0), doc=(
            "weight-decay coefficient")),
    Keyword("weight_decay_type", "decoupled", str,
            choice("l2", "decoupled", "corrected", "independent"),
            doc=(
            "`\"l2\"` (added to the gradient), `\"decoupled\"` (AdamW-style), `\"corrected\"` "
            "(`wd·lr/peak_lr`), `\"independent\"` (`wd/peak_lr`)")),
    Keyword("use_bias_correction", True, bool, boolean(), doc=(
            "bias-correct the momentum and factor-matrix EMAs")),
    Keyword("max_preconditioner_dim", 1024, int, integer(1), scope=scoped('layout'), doc=(
            "largest factor dimension (merge-and-split blocking)")),
    Keyword("precondition_frequency", 1, int, integer(1), doc=(
            "recompute root inverses / eigenbases every this many steps")),
    Keyword("start_preconditioning_step", None, int, _check_start, doc=(
            "first step with a Shampoo direction (`None` → `precondition_frequency`); "
            "grafting-only before")),
    Keyword("preconditioner", "shampoo", str, choice(*KINDS), scope=scoped('layout'), doc=(
            "`\"shampoo\"`, `\"eigenvalue_corrected\"` (SOAP), `\"kl_shampoo\"` (KL-Shampoo), "
            "`\"diagonal\"` (no Kronecker factors: the grafting method alone, e.g. Adam for "
            "biases and norms), `\"spectral_descent\"` (Muon: the orthogonalized filtered "
            "gradient of each matrix block; parameters of ≥ 2 dims, as `(dim 0, rest)`) or "
            "`\"sign_descent\"` (its sign); see [Muon](muon.md); `\"eigendecomposed_shampoo\"` "
            "/ `\"eigendecomposed_kl_shampoo\"` (Meta's eigendecomposed kinds: Shampoo's / "
            "KL-Shampoo's roots taken from each factor's kept eigendecomposition, refreshed"
            " by Meta's eigh with the criterion `eigenbasis_tolerance`, or by Meta's QR "
            "algorithm, `eigendecomposition=\"qr\"`; with eigh and no tolerance they are "
            "`\"shampoo\"` / `\"kl_shampoo\"`. Meta's QR sorts the basis by ascending "
            "eigenvalue after each refresh, which keeps one QR step per refresh from "
            "converging across refreshes: give it `qr_max_iterations` or a tolerance); "
            "`\"sketchy\"` (Shampoo with rank-`sketch_rank` Frequent-Directions sketches of "
            "the large dims' factors, arXiv 2302.03764; see [Sketchy](sketchy.md))")),
    Keyword("grafting", None, str, choice(None, "sgd", "adagrad", "rmsprop", "adam"),
            scope=scoped('layout'), doc=(
            "`None`, `\"sgd\"`, `\"adagrad\"`, `\"rmsprop\"` or `\"adam\"`: whose per-block step "
            "size to use")),
    Keyword("grafting_beta2", 0.999, float, real(0.0, 1.0), doc=(
            "second-moment EMA of `\"rmsprop\"` / `\"adam\"` grafting")),
    Keyword("grafting_epsilon", 1e-8, float, real(0.0, low_open=True), doc=(
            "epsilon of the grafting method")),
    Keyword("factor_matrix_dtype", torch.float32, torch.dtype, choice(torch.float32, torch.float64),
            scope=scoped('layout'), doc=(
            "dtype of the factor matrices (`torch.float32` or `torch.float64`)")),
    Keyword("distributed", "auto", str, choice("auto", "none", "ddp", "fsdp"),
            scope=scoped('global'), doc=(
            "`\"auto\"`, `\"none\"`, `\"ddp\"` or `\"fsdp\"` (see [Distributed data-parallel "
            "training](distributed.md) and [Sharded training](sharded.md))")),
    Keyword("fsdp_mode", "lossless", str, choice("lossless", "local"), scope=scoped('global'), doc=(
            "with FSDP2 parameters: `\"lossless\"` (full-parameter blocks, one-process "
            "numbers) or `\"local\"` (blocks of each rank's shard, no extra communication)")),
    Keyword("communication_dtype", torch.float32, torch.dtype,
            choice(torch.float32, torch.bfloat16, torch.float16),
            scope=scoped('global'), doc=(
            "dtype of the all-gathered updates (`float32`, `bfloat16`, `float16`; float32 "
            "is bit-identical to one process)")),
    Keyword("num_trainers_per_group", -1, int, _check_trainers, scope=scoped('global'), doc=(
            "ranks per group that share the blocks (`-1` = whole world)")),
    Keyword("assignment_cost", "memory", str, choice("memory", "compute"),
            scope=scoped('global'), doc=(
            "how blocks are weighed when spread over ranks: `\"memory\"` (the state bytes the"
            " block's kind keeps) or `\"compute\"` (its kind's flops per step)")),
    Keyword("apply_precision", "ieee", str, choice("ieee", "tf32"), doc=(
            "precision of the steady step's products that apply the roots or eigenbases: "
            "`\"ieee\"` (float32, Meta's) or `\"tf32\"` (their float32 operands rounded "
            "to TF32's 10-bit mantissa, accumulated in float32: on CUDA torch's TF32 switch "
            "for those calls, not with `refresh_delay >= 1` there; elsewhere emulated, "
            "slower, for measuring accuracy). Statistics and refreshes stay float32. "
            "bfloat16 products: `inv_factor_matrix_dtype=torch.bfloat16`. See "
            "[performance](performance.md#apply_precision)")),
    Keyword("stacking", "balanced", str, choice("balanced", "fused"), scope=scoped('layout'),
            doc=(
            "how same-shape blocks are batched into stacks (one call per operation and "
            "stack): `\"balanced\"` cuts each kind of blocks into at least 8 stacks of at "
            "most 2^24 elements, so that ranks can share a kind's work; `\"fused\"` keeps one "
            "stack per kind, so a step dispatches the same number of kernels whatever the "
            "model's depth (fewest launches: for one GPU or few ranks). Either way the cut "
            "reads only the blocks, never the world size, so every layout and world size "
            "gives one process's numbers bit for bit; the two settings differ from each other "
            "by round-off. See [performance](performance.md#stacking)")),
    Keyword("refresh_schedule", "all", str, choice("all", "staggered"), doc=(
            "`\"all\"`: every block refreshes on the same steps; `\"staggered\"`: each block on"
            " its own offset within the `precondition_frequency` window, so no step spikes "
            "(see [Performance](performance.md#refresh_schedulestaggered)); `make_optimizer`,"
            " the Trainer and timm default to `\"staggered\"`")),
    Keyword("refresh_delay", 0, int, integer(0), scope=scoped('layout'), doc=(
            "`0`: a block's refresh (roots, eigenbases, the adaptive criterion, Sketchy's "
            "low-rank roots) runs in the step that schedules it, as Meta's. `d >= 1`: it is "
            "computed from the block's statistics of that step in a worker thread (on CUDA "
            "a side stream) while training goes on, and used from `d` steps later on; the "
            "steps between use the previous result. The numbers depend on `d` only, not on "
            "timing; at most the steps between two refreshes (`precondition_frequency`); "
            "not with `quantization=\"4bit\"`. Checkpoints hold the pending results (a "
            "save with a refresh pending resumes exactly); between steps the state keeps "
            "only when each applies. `make_optimizer`, the Trainer and timm default to 1 "
            "(0 where a group refuses a delay); a checkpoint resumes with its own. See "
            "[performance](performance.md#refresh_delay)")),
    Keyword("iterate_averaging", None, str, choice(None, "gpa", "schedule_free"),
            scope=scoped('layout'), doc=(
            "`None`, `\"gpa\"` (generalized primal averaging, arXiv 2512.17131; Meta's "
            "`GeneralizedPrimalAveragingConfig`) or `\"schedule_free\"` (arXiv 2405.15682; "
            "Meta's `ScheduleFreeConfig`): the parameters hold the sequence gradients are "
            "taken at in train mode and the averaged weights after `optimizer.eval()` "
            "(`optimizer.train()` goes back; `step()` in eval mode raises). Replaces "
            "`momentum` (must be 0 with it); decoupled weight decay then shrinks the "
            "plain-step sequence `z`, as in Meta. Any kind. See [design "
            "§2](design.md#2-one-optimizer-step) and [iterate "
            "averaging](hyperparameters.md#iterate-averaging-gpa-and-schedule-free)")),
    Keyword("eval_interp_coeff", 0.9, float, real(0.0, 1.0, high_open=True), doc=(
            "`\"gpa\"`: `μ_x` in `[0, 1)`, how slowly the averaged weights follow `z` (the "
            "momentum β for SGD-momentum equivalence)")),
    Keyword("train_interp_coeff", 0.8, float, real(0.0, 1.0, low_open=True), doc=(
            "`\"gpa\"` / `\"schedule_free\"`: `μ_y` in `(0, 1]`, where gradients are taken "
            "between the average (`1`) and `z`; `1.0` with `\"gpa\"` is heavy ball, `= "
            "eval_interp_coeff` Nesterov")),
    Keyword("eval_coeff_lr_power", 2, float, real(0.0), doc=(
            "`\"schedule_free\"`: `p` of the weights `lr_t^p` of the running average (`μ_x = "
            "1 − lr_t^p / Σ lr_i^p`)")),
    Keyword("vector_preconditioner", None, str,
            choice(*(k for k in KINDS if not KINDS[k].matrix_blocks)),
            scope=scoped('layout'), doc=(
            "the kind for the group's *vector-like* parameters (at most one dim larger than"
            " 1: biases, norm weights), chosen inside the group: `None` (the group's "
            "`preconditioner`) or any kind but `\"spectral_descent\"`; `\"diagonal\"` gives "
            "them the grafting method alone (Adam grafting where the group has none), e.g. "
            "Muon in one group: `preconditioner=\"spectral_descent\", "
            "vector_preconditioner=\"diagonal\"`")),
    Keyword("experts", False, bool, boolean(_EXPERTS), scope=scoped('layout'), doc=(
            "`True`: dim 0 of every parameter of the group indexes independent experts (a "
            "mixture of experts' fused `(num_experts, out, in)` weight): each expert is "
            "blocked as its own `(out, in)` (merged, cut, or as a matrix for spectral "
            "descent, exactly as a parameter of that shape would be), so no factor, "
            "eigenbasis, grafting norm or orthogonalization couples two experts; same-shape"
            " blocks of all experts share one stack. The per-matrix rules "
            "(`vector_preconditioner`, `diagonal_aspect`) look at one expert's shape. A "
            "fused parameter with `experts=True` moves exactly as `num_experts` separate "
            "parameters. The module presets (`make_optimizer`, the Trainer) set it for "
            "transformers' experts modules ([Mixture of "
            "experts](transformers.md#mixture-of-experts))")),
    Keyword("compile", False, bool | dict, _check_compile, scope=scoped('global', 'runtime'),
            annotation="bool | dict[str, Any]", doc=(
            "`True`: grafting state, grafting, weight decay, momentum and `-lr` (the "
            "elementwise lines 3 and 5–8 of [design §2](design.md)) run as `torch.compile`d"
            " kernels, one pass over memory each; a dict passes `torch.compile`'s keyword "
            "arguments, e.g. `{\"backend\": \"aot_eager\"}` or `{\"mode\": \"max-autotune\"}` "
            "(Meta's `ShampooPT2CompileConfig`). Statistics, refreshes, preconditioning and"
            " the filtered gradient (which the preconditioner amplifies: it must be eager's"
            " to the bit, [performance](performance.md#compiletrue)) stay eager. The first "
            "steps compile (about 20–40 s on ResNet-50 shapes on a 2-core CPU); a changing "
            "learning rate does not recompile. Each step's direction within 1e-6 of eager's"
            " per block in float32, 1e-12 in float64. Not loaded from a checkpoint: the "
            "optimizer's own value stays. On a 2-core CPU: 0.95× eager's steady step on "
            "ResNet-50 shapes but 2.3× on GPT-2 small's, after 10–15 s of compilation "
            "([benchmarks](../BENCHMARKS.md)): off by default")),
    Keyword("check_finite_gradients", True, bool, boolean(), scope=scoped('global'), doc=(
            "refuse a step whose gradients hold a nan or an inf, before any state or weight"
            " changes, with the parameter's name (`ShampooNumericalError`); one fused check"
            " over all gradients and one host synchronisation per step on a GPU (see "
            "[GPU](gpu.md)); `False` leaves the check to your code (AMP's `GradScaler` "
            "already skips such steps)")),
)
POSITIONAL = ("lr", "betas", "beta3", "epsilon", "momentum", "dampening", "nesterov",
              "weight_decay")


def _join(common: tuple[Keyword, ...]) -> dict[str, Keyword]:
    """The common rows, then each registered kind's own rows (a row two kinds share, e.g.
    through a base class, once)."""
    table = {row.name: row for row in common}
    declared: dict[str, str] = {}
    for name, kind in KINDS.items():
        for row in kind.own_keywords():
            if row.name in table and table[row.name] is not row:
                raise ValueError(f"keyword {row.name!r} of kind {name!r} is declared twice "
                                 f"(also by {declared.get(row.name, 'the common rows')!r})")
            table[row.name] = row
            declared.setdefault(row.name, name)
    return table


TABLE: dict[str, Keyword] = _join(COMMON_KEYWORDS)
DEFAULTS: dict[str, Any] = {name: row.default for name, row in TABLE.items()}
# AdamW's hyperparameters as the integrations set them over the table's (Meta's) defaults,
# the one source of them: make_optimizer(defaults="adamw") (grafting, betas,
# refresh_schedule), the Trainer (weight_decay_type, grafting, refresh_schedule; the rest
# from TrainingArguments) and timm (all of them; lr, betas and eps as its signature's
# defaults). Adam grafting with AdamW's betas and epsilon, decoupled weight decay, and
# staggered refreshes, so that no step waits for every block's refresh at once
# (docs/hyperparameters.md, docs/performance.md).
ADAMW_STYLE: dict[str, Any] = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "grafting": "adam",
    "grafting_epsilon": 1e-8,
    "weight_decay_type": "decoupled",
    "refresh_schedule": "staggered",
    # each refresh computed beside the next step and used one step later (docs/performance.md
    # #refresh_delay: no cost in convergence or memory); see adamw_style_refresh_delay
    "refresh_delay": 1,
}


def adamw_style_refresh_delay(settings: Mapping[str, Any]) -> int:
    """The ``refresh_delay`` that ``make_optimizer``, the Trainer and timm give a group (or
    the optimizer) with these settings when the user names none: ``ADAMW_STYLE``'s, and 0
    where a delay is refused: 4-bit state (its refresh rebuilds the statistics) and
    ``apply_precision="tf32"`` (whose switch is the process's on CUDA)."""
    if settings.get("quantization") == "4bit" or settings.get("apply_precision") == "tf32":
        return 0
    return ADAMW_STYLE["refresh_delay"]
# Keywords that describe the whole optimizer, not one group: they must agree across groups.
GLOBAL_KEYS = tuple(name for name, row in TABLE.items() if "global" in row.scope)
# Keywords that say how this process runs the step, not what it computes: a checkpoint's
# values of them are not loaded (the optimizer's own stay).
RUNTIME_KEYS = tuple(name for name, row in TABLE.items() if "runtime" in row.scope)
# Keywords that decide which state tensors exist and how parameters are blocked. They are
# fixed once state exists, and a checkpoint must agree with them to be loaded (except
# refresh_delay, whose saved value the load takes: checkpoint/layout.py ADOPTED).
LAYOUT_KEYS = tuple(name for name, row in TABLE.items() if "layout" in row.scope)
PRECONDITIONERS = tuple(KINDS)
# The keywords some kind declares (the rest are common), and the kinds that read each.
KIND_KEYWORDS: dict[str, tuple[str, ...]] = {
    name: tuple(k for k, kind in KINDS.items() if name in {r.name for r in kind.own_keywords()})
    for name in TABLE if name not in {row.name for row in COMMON_KEYWORDS}
}
_KIND_SPECIFIC = frozenset(KIND_KEYWORDS)

# Entries other tools put into param groups (torch schedulers, timm, transformers): allowed.
FOREIGN_GROUP_KEYS = frozenset(
    {"params", "param_names", "initial_lr", "lr_scale", "name", "layer_id", "step", "peak_lr",
     "train_mode", "lr_sum"}
)


def signature() -> inspect.Signature:
    """The constructor's signature from the table: ``params``, the ``POSITIONAL`` keywords,
    then every other keyword by name only, each with its row's default and annotation (as
    source text: ``DistributedShampoo.__init__``'s, generated from here, are strings too)."""
    parameters = [inspect.Parameter("params", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                    annotation="Iterable[Any]")]
    for name, row in TABLE.items():
        kind = (inspect.Parameter.POSITIONAL_OR_KEYWORD if name in POSITIONAL
                else inspect.Parameter.KEYWORD_ONLY)
        parameters.append(inspect.Parameter(name, kind, default=row.default,
                                            annotation=row.hint))
    return inspect.Signature(parameters, return_annotation="None")


def signature_source() -> dict[str, list[str]]:
    """The lines generated into hf_shampoo/optimizer.py, by block: ``"parameters"``, the
    keywords of ``DistributedShampoo.__init__`` (annotated, with their defaults; a bare
    ``*`` after the ``POSITIONAL`` ones), and ``"fields"``, those of ``ShampooKeywords``
    (the ``TypedDict`` that ``make_optimizer``'s ``**keywords`` are typed with)."""
    parameters, fields = [], []
    for name, row in TABLE.items():
        if name not in POSITIONAL and "*," not in parameters:
            parameters.append("*,")
        parameters.append(f"{name}: {row.hint} = {render_source(row.default)},")
        fields.append(f"{name}: {row.hint}")
    return {"parameters": parameters, "fields": fields}


def _source_markers(block: str) -> tuple[str, str]:
    return f"# <{block}: generated from config.TABLE by python -m hf_shampoo.config>", \
        f"# </{block}>"


def update_signature_source(path: str | None = None) -> bool:
    """Rewrite the generated blocks of hf_shampoo/optimizer.py (``signature_source``) from
    ``TABLE``; whether it changed. Each block's lines are indented as its markers are."""
    path = path or os.path.join(os.path.dirname(__file__), "optimizer.py")
    with open(path, encoding="utf-8") as file:
        text = file.read()
    new = generated_source(text)
    if new != text:
        with open(path, "w", encoding="utf-8") as file:
            file.write(new)
    return new != text


def generated_source(text: str) -> str:
    """``text`` (hf_shampoo/optimizer.py's) with its generated blocks rendered afresh."""
    lines = text.split("\n")
    for block, rendered in signature_source().items():
        begin, end = _source_markers(block)
        starts = [i for i, line in enumerate(lines) if line.strip() == begin]
        if len(starts) != 1:
            raise ValueError(f"expected one line {begin!r}, found {len(starts)}")
        start = starts[0]
        stop = next(i for i in range(start, len(lines)) if lines[i].strip() == end)
        indent = lines[start][:len(lines[start]) - len(lines[start].lstrip())]
        lines[start + 1:stop] = [indent + line for line in rendered]
    return "\n".join(lines)


def keyword_reference() -> str:
    """The table of docs/keywords.md, and the sentence on the scopes under it."""
    def names(keys: tuple[str, ...]) -> str:
        quoted = [f"`{k}`" for k in keys]
        return ", ".join(quoted[:-1]) + f" and {quoted[-1]}"

    return (render_table(TABLE.values()) + "\n" + names(GLOBAL_KEYS) + " describe the whole "
            "optimizer and cannot differ between groups. Keywords that decide the state "
            f"layout ({names(LAYOUT_KEYS)}) are fixed once the optimizer has state.\n")


def refuse_unknown_keywords(unknown: dict[str, Any], where: str) -> None:
    """Raise ``TypeError`` for keywords no option has, with the closest valid names and the
    list of every valid keyword (Python's own error lists none)."""
    hints = [f"{name!r}{did_you_mean(name, DEFAULTS)}" for name in sorted(unknown)]
    raise TypeError(
        f"{where}: unknown keyword argument(s) {', '.join(hints)}; valid keywords are "
        f"params, {', '.join(DEFAULTS)}"
    )


def vector_settings(group: dict[str, Any]) -> dict[str, Any]:
    """What ``vector_preconditioner`` changes for a group's vector-like parameters (at most
    one dim larger than 1: biases, norm weights): that kind, and Adam grafting where the
    group has none and the kind needs a step size to graft onto. Empty when the group has
    no ``vector_preconditioner``."""
    kind = group.get("vector_preconditioner")
    if kind is None:
        return {}
    settings: dict[str, Any] = {"preconditioner": kind, "vector_preconditioner": None}
    if KINDS[kind].needs_grafting and group["grafting"] is None:
        settings["grafting"] = "adam"
    return settings


def keyword_acts(key: str, group: dict[str, Any]) -> bool:
    """Whether ``key`` changes anything in a (fully defaulted) group: its kind, or the kind
    of its vector-like parameters, uses it (``Preconditioner.acts``)."""
    kinds = {group["preconditioner"], group.get("vector_preconditioner")} - {None}
    return any(KINDS[k].acts(key, group, _KIND_SPECIFIC) for k in kinds)


def inert_keywords(keys: Any, groups: list[dict[str, Any]]) -> list[str]:
    """The keys among ``keys`` that change nothing in any of ``groups`` (fully defaulted)."""
    return [key for key in keys if not any(keyword_acts(key, g) for g in groups)]


def validate_group(group: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the first invalid keyword of a fully defaulted group:
    each row's check, the common cross-keyword rules, then the kind's ``check``."""
    unknown = sorted(k for k in group if k not in DEFAULTS and k not in FOREIGN_GROUP_KEYS)
    if unknown:
        hints = [f"{k!r}{did_you_mean(k, DEFAULTS)}" for k in unknown]
        raise ValueError(
            f"DistributedShampoo: unknown keyword(s) {', '.join(hints)}; "
            f"valid keywords are {', '.join(DEFAULTS)}"
        )
    for name, row in TABLE.items():
        row.validate(group[name])
    if group["grafting"] in ("rmsprop", "adam") and group["grafting_beta2"] >= 1.0:
        fail("grafting_beta2", group["grafting_beta2"], f"expected < 1 for {group['grafting']!r}")
    if group["iterate_averaging"] is not None and group["momentum"] > 0:
        fail("momentum", group["momentum"], f"iterate_averaging={group['iterate_averaging']!r} "
             "is the momentum of the averaged sequences (train_interp_coeff=1.0 with 'gpa' is "
             "heavy ball): expected 0.0 with it")
    KINDS[group["preconditioner"]].check(group)
    if group["vector_preconditioner"] is not None:
        try:  # the settings vector-like parameters get must be valid too
            validate_group({**group, **vector_settings(group)})
        except ValueError as error:
            raise ValueError(f"{error} (for the vector-like parameters of a group with "
                             f"vector_preconditioner={group['vector_preconditioner']!r})"
                             ) from None


# ------------------------------------------------------------- schedules, from the kinds
def start_step(group: dict[str, Any]) -> int:
    """The first preconditioned step ``s`` (the group's kind's ``start_step``)."""
    return KINDS[group["preconditioner"]].start_step(group)


def is_refresh_step(group: dict[str, Any], step: int, offset: int = 0) -> bool:
    """docs/design.md §2: ``(t % f == 0 and t > s) or t == s``, with ``t`` the step minus
    the block's schedule offset (0 unless ``refresh_schedule="staggered"``); never for a
    kind that refreshes nothing."""
    if not KINDS[group["preconditioner"]].refreshes:
        return False
    f, s, t = group["precondition_frequency"], start_step(group), step - offset
    return (t % f == 0 and t > s) or t == s


def is_preconditioning(group: dict[str, Any], step: int, offset: int = 0) -> bool:
    """Whether a block with this schedule offset is past its start: ``t - offset >= s``."""
    return step - offset >= start_step(group)


def dim_exponents(group: dict[str, Any], order: int) -> list[float]:
    """Exponent ``e_j`` of each dim of a block of this order (the kind's ``exponents``)."""
    return KINDS[group["preconditioner"]].exponents(group, order)


def update_keyword_docs(path: str = "docs/keywords.md") -> bool:
    """Rewrite the generated table of docs/keywords.md from ``TABLE``; whether it changed."""
    with open(path, encoding="utf-8") as file:
        text = file.read()
    start = text.index(_DOCS_BEGIN)
    end = text.index(_DOCS_END, start)
    new = text[:start] + _DOCS_BEGIN + "\n" + keyword_reference() + text[end:]
    if new != text:
        with open(path, "w", encoding="utf-8") as file:
            file.write(new)
    return new != text


_DOCS_BEGIN = ("<!-- generated from hf_shampoo/config.py's keyword table "
               "(config.keyword_reference()); edit the rows there, then run "
               "`python -m hf_shampoo.config` -->")
_DOCS_END = "<!-- end of the generated table -->"

if __name__ == "__main__":
    print("docs/keywords.md " + ("updated" if update_keyword_docs() else "already agrees"))
    print("hf_shampoo/optimizer.py's signature "
          + ("updated" if update_signature_source() else "already agrees"))

__all__ = ["ADAMW_STYLE", "DEFAULTS", "GLOBAL_KEYS", "KIND_KEYWORDS", "LAYOUT_KEYS", "RUNTIME_KEYS",
           "TABLE", "adamw_style_refresh_delay", "diagonal_dims", "did_you_mean", "is_elongated",
           "keyword_acts", "validate_group"]
