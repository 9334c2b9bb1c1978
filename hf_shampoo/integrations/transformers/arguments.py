"""``TrainingArguments`` → ``DistributedShampoo``: the optimizer names, ``optim_args`` and
the defaults.

``optim_args="k=v,..."`` takes the docs/design.md §7 keyword names (``parse_optim_args``:
values cast to the keyword's type, ``PATTERN@key`` for matching modules, ``preset``; as
strict as the constructor: closest valid key, no key twice); defaults follow the AdamW
migration, with Shampoo's fine-tuning defaults for the kinds that keep statistics only
(``trainer_defaults``); parameters are grouped by the module rules of ``model_rules.py``, and a
keyword that changes none of the groups is reported. ``create_optimizer`` and
``optimizer_cls_and_kwargs`` build the optimizer; they need nothing of transformers but its
``TrainingArguments``' fields.
"""

from __future__ import annotations

import ast
import types
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...config import (
    ADAMW_STYLE,
    DEFAULTS,
    TABLE,
    adamw_style_refresh_delay,
    did_you_mean,
    inert_keywords,
    validate_group,
)
from ...factory import (
    check_memory,
    delayed_groups,
    sketch_groups,
    sketch_statistics_frequency,
)
from ...model_rules import (
    check_override,
    check_patterns,
    check_preset,
    hf_no_decay,
    param_groups,
    walk,
)
from ...optimizer import DistributedShampoo
from ...preconditioners import KINDS

OPTIMIZER_NAME = "distributed_shampoo"
# Muon by name: the same optimizer with the "muon" module preset (spectral descent on
# hidden matrices, Adam elsewhere; docs/muon.md)
MUON_NAME = "distributed_muon"
# the names this package registers, and the module preset each implies
OPTIMIZER_NAMES = {OPTIMIZER_NAME: None, MUON_NAME: "muon"}

# Fine-tuning defaults (hundreds to tens of thousands of steps), see docs/transformers.md
# ("What TrainingArguments become"):
# - precondition_frequency=50: the root inverses cost O(d^3) per block; every 50 steps this
#   is a few percent of the step time, and a 300-step run still refreshes 6 times.
# - start_preconditioning_step=None (= 50): Adam steps (the grafting method) until the
#   factor matrices have seen 50 gradients, a warm-up comparable to usual LR warm-ups.
# - max_preconditioner_dim=512: half the memory (8 bytes/parameter for the factors and roots
#   instead of 16) and half the eigendecomposition cost per parameter of 1024, while hidden
#   sizes of 768-4096 are still cut into few, large blocks.
# - refresh_schedule="staggered": each block refreshes on its own step of the 50-step window,
#   so no step waits for every eigendecomposition at once (optim_args "refresh_schedule=all"
#   gives Meta's schedule).
# - refresh_delay=1: each refresh is computed beside the next step (a worker thread; on
#   CUDA a side stream) and used one step later, off the step's critical path; 0 where a
#   delay is refused (4-bit state, apply_precision="tf32": adamw_style_refresh_delay).
FINE_TUNING_DEFAULTS: dict[str, Any] = {
    "precondition_frequency": 50,
    "start_preconditioning_step": None,
    "max_preconditioner_dim": 512,
    "refresh_schedule": ADAMW_STYLE["refresh_schedule"],
    "refresh_delay": ADAMW_STYLE["refresh_delay"],
}
SHAMPOO_EPSILON = 1e-12
# Presets whose kinds keep no statistics (spectral descent and Adam): the defaults above and
# Shampoo's epsilon mean nothing to them and are not set (a warm-up of 1 or more is valid)
STATELESS_PRESETS = ("muon",)
DEFAULT_PRESET = "transformer"

# optim_args keys that configure the Trainer integration, not the optimizer: the module
# preset, whether the Trainer's logs carry optimizer.metrics() (docs/metrics.md), and how
# the large factors are stored (make_optimizer's memory=: "full" or "sketch", docs/sketchy.md)
INTEGRATION_KEYS = ("preset", "log_metrics", "memory")
_OVERRIDE_SEPARATOR = "@"


def optim_name(args: Any) -> str:
    """``args.optim`` as a plain string (an ``OptimizerNames`` member or a string)."""
    optim = getattr(args, "optim", None)
    return str(getattr(optim, "value", optim))


# ---------------------------------------------------------------------- optim_args
@dataclass
class OptimArgs:
    """``optim_args`` parsed: docs/design.md §7 keywords, per-pattern overrides, the module
    preset."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    preset: str | None = None
    log_metrics: bool = True  # optimizer.metrics() in every training log entry
    memory: str = "full"  # "sketch": Shampoo groups become preconditioner="sketchy"


_DTYPE_ALIASES = {"fp32": "float32", "fp64": "float64", "bf16": "bfloat16", "fp16": "float16"}
def valid_keys() -> list[str]:
    """The keys ``optim_args`` accepts (``PATTERN@key`` sets ``key`` for matching modules)."""
    return list(DEFAULTS) + list(INTEGRATION_KEYS)


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets, so ``betas=(0.9,0.999)`` stays one item."""
    items, depth, current = [], 0, []
    for char in text:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if char == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    items.append("".join(current))
    return [item.strip() for item in items if item.strip()]


def _bad(key: str, text: str, expected: str) -> ValueError:
    return ValueError(f"hf_shampoo: optim_args {key}={text!r}: expected {expected}")


def cast_value(key: str, text: Any) -> Any:
    """Cast an ``optim_args`` string to the type of the keyword ``key`` (docs/design.md §7)."""
    if not isinstance(text, str):
        return text  # already typed (optim_args given as a dict)
    raw = text.strip()
    row = TABLE[key]
    kind = row.type  # the keyword table's (config.TABLE)
    if raw.lower() in ("none", "null") and row.optional:
        return None
    if isinstance(kind, types.UnionType):  # compile: true / false or a dict
        if str in kind.__args__ and raw[:1].isalpha():  # a name (newton_schulz_coefficients)
            return raw
        kind = dict if raw.startswith("{") else next(t for t in kind.__args__ if t is not dict)
    if kind is bool:
        lowered = raw.lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise _bad(key, raw, "true or false")
    if kind is int:
        try:
            number = float(raw)
        except ValueError:
            raise _bad(key, raw, "an integer") from None
        if not number.is_integer():
            raise _bad(key, raw, "an integer")
        return int(number)
    if kind is float:
        try:
            return float(raw)
        except ValueError:
            raise _bad(key, raw, "a number") from None
    if kind is tuple:
        parts = [p for p in raw.strip("()[] ").replace(";", ",").replace(":", ",").split(",") if p]
        try:
            return tuple(float(p) for p in parts)
        except ValueError:
            raise _bad(key, raw, "numbers such as (0.9;0.999)") from None
    if kind is torch.dtype:
        name = raw.removeprefix("torch.")
        dtype = getattr(torch, _DTYPE_ALIASES.get(name, name), None)
        if not isinstance(dtype, torch.dtype):
            raise _bad(key, raw, "a dtype such as float32, bfloat16 or float16")
        return dtype
    if kind is dict:
        try:
            return ast.literal_eval(raw.replace(";", ","))
        except (ValueError, SyntaxError):
            raise _bad(key, raw, "a dict such as {2:{0:0}} (';' between items)") from None
    return raw


def _flag(key: str, value: Any) -> bool:
    """An integration key's true / false (a bool, or its spelling in ``optim_args``)."""
    if isinstance(value, bool):
        return value
    lowered = str(value).strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise _bad(key, str(value).strip(), "true or false")


def logs_metrics(args: Any) -> bool:
    """Whether the Trainer adds ``optimizer.metrics()`` to its training logs: yes unless
    ``optim_args`` says ``log_metrics=false``."""
    return parse_optim_args(getattr(args, "optim_args", None)).log_metrics


def _unknown_key(key: str, name: str) -> ValueError:
    return ValueError(
        f"hf_shampoo: unknown optim_args key {key!r}{did_you_mean(name, valid_keys())}; "
        f"valid keys: {', '.join(valid_keys())} (PATTERN@key=value sets a key for the "
        "parameters or modules whose name matches the glob PATTERN)"
    )


def parse_optim_args(optim_args: str | Mapping[str, Any] | None) -> OptimArgs:
    """Parse ``"k=v,k=v,PATTERN@k=v"`` (or a dict) into typed keywords.

    Keys are the docs/design.md §7 keyword names (plus ``preset``, ``log_metrics`` and
    ``memory``, the integration's own: ``INTEGRATION_KEYS``); ``PATTERN@key=value`` sets a
    keyword for the parameters whose name or owning module's name matches the glob
    ``PATTERN``. Inside ``optim_args`` write ``;`` where Python writes ``,`` in a value
    (``betas=(0.9;0.999)``, ``inverse_exponent_override={2:{0:0;1:0.5}}``): transformers
    splits ``optim_args`` on every comma. Spaces around keys, patterns and values are
    ignored. An unknown key or preset (with the closest valid one), a key given twice and a
    bad value raise ``ValueError``.
    """
    parsed = OptimArgs()
    if not optim_args:
        return parsed
    if isinstance(optim_args, Mapping):
        items = list(optim_args.items())
    else:
        items = []
        for item in _split_top_level(str(optim_args)):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(
                    f"hf_shampoo: optim_args item {item!r} is not key=value; valid keys: "
                    f"{', '.join(valid_keys())} (PATTERN@key=value for some modules)"
                )
            items.append((key.strip(), value))
    seen: dict[tuple[str, str], str] = {}
    for key, value in items:
        pattern, sep, name = (part.strip() for part in str(key).rpartition(_OVERRIDE_SEPARATOR))
        if name not in DEFAULTS and not (name in INTEGRATION_KEYS and not sep):
            raise _unknown_key(str(key), name)
        if sep and not pattern:
            raise ValueError(f"hf_shampoo: optim_args key {key!r} has an empty pattern")
        where = f"{pattern}@{name}" if sep else name
        if (pattern, name) in seen:
            raise ValueError(
                f"hf_shampoo: optim_args sets {where!r} twice ({seen[pattern, name]!r} and "
                f"{value!r}); give each key once"
            )
        seen[pattern, name] = value
        if name == "preset":
            preset = value.strip() if isinstance(value, str) else value
            check_preset(preset, "optim_args preset")
            parsed.preset = preset
            continue
        if name == "log_metrics":
            parsed.log_metrics = _flag(name, value)
            continue
        if name == "memory":
            memory = value.strip() if isinstance(value, str) else value
            check_memory(memory, "optim_args memory")
            parsed.memory = memory
            continue
        target = parsed.overrides.setdefault(pattern, {}) if sep else parsed.kwargs
        target[name] = cast_value(name, value)
    return parsed


# ---------------------------------------------------------------------- defaults
def chosen_preset(args: Any, parsed: OptimArgs | None = None, preset: str | None = None) -> str:
    """The module preset a build uses: ``preset`` (Python), else ``optim_args``' ``preset``,
    else the one ``args.optim`` implies (``"muon"`` for ``distributed_muon``), else
    ``"transformer"``."""
    if parsed is None:
        parsed = parse_optim_args(getattr(args, "optim_args", None))
    return preset or parsed.preset or OPTIMIZER_NAMES.get(optim_name(args)) or DEFAULT_PRESET


def trainer_defaults(args: Any, preset: str | None = None) -> dict[str, Any]:
    """The AdamW migration of ``TrainingArguments``: ``learning_rate``, ``adam_beta1/2``,
    Adam grafting with ``adam_beta2`` / ``adam_epsilon``, decoupled ``weight_decay``, and,
    for presets whose kinds keep statistics (all but ``STATELESS_PRESETS``), Shampoo epsilon
    1e-12 and ``FINE_TUNING_DEFAULTS``."""
    defaults = {
        "lr": args.learning_rate,
        "betas": (args.adam_beta1, args.adam_beta2),
        "weight_decay": args.weight_decay,
        "weight_decay_type": ADAMW_STYLE["weight_decay_type"],
        "grafting": ADAMW_STYLE["grafting"],
        "grafting_beta2": args.adam_beta2,
        "grafting_epsilon": args.adam_epsilon,
    }
    if preset not in STATELESS_PRESETS:
        defaults.update(epsilon=SHAMPOO_EPSILON, **FINE_TUNING_DEFAULTS)
    return defaults


def resolve_kwargs(args: Any, *chosen: Mapping[str, Any], preset: str | None = None
                   ) -> dict[str, Any]:
    """``trainer_defaults(args, preset)`` updated by the user's keywords (``optim_args``,
    Python), validated. Choosing a kind whose epsilon is Adam's (``adam_like``:
    ``preconditioner="eigenvalue_corrected"``, SOAP) also switches the defaults to no
    grafting and Adam's epsilon (``adam_epsilon``), unless those are set."""
    user: dict[str, Any] = {}
    for keywords in chosen:
        user.update(keywords)
    kwargs = {**trainer_defaults(args, preset), **user}
    kind = KINDS.get(user.get("preconditioner"))  # type: ignore[arg-type]
    if kind is not None and kind.adam_like:
        if "grafting" not in user:
            kwargs["grafting"] = None
        if "epsilon" not in user:
            kwargs["epsilon"] = args.adam_epsilon
    if "refresh_delay" in kwargs and "refresh_delay" not in user:
        kwargs["refresh_delay"] = adamw_style_refresh_delay(kwargs)
    group = {**DEFAULTS, **kwargs}
    if isinstance(group["betas"], list):
        group["betas"] = kwargs["betas"] = tuple(group["betas"])
    try:
        validate_group(group)
    except ValueError as error:
        raise ValueError(
            f"{error} (from TrainingArguments / optim_args; valid keys: {', '.join(valid_keys())})"
        ) from None
    return kwargs


def validate_args(args: Any, model: torch.nn.Module | None = None,
                  overrides: Mapping[str, Any] | None = None, preset: str | None = None) -> None:
    """Raise ``ValueError`` now if ``args.optim_args`` would not build a Shampoo optimizer
    through transformers (which splits ``optim_args`` on every comma); with ``model``, also
    if an override pattern (of ``optim_args`` or ``overrides``) matches none of its names."""
    text = getattr(args, "optim_args", None)
    if isinstance(text, str) and any("," in item for item in _split_top_level(text)):
        raise ValueError(
            f"hf_shampoo: optim_args={text!r} has a comma inside a value; transformers splits "
            "optim_args on every comma, so write ';' there, e.g. betas=(0.9;0.999)"
        )
    parsed = parse_optim_args(text)
    user = dict(parsed.kwargs)
    every = sketch_statistics_frequency(parsed.memory, user)
    kwargs = resolve_kwargs(args, user, preset=chosen_preset(args, parsed, preset))
    if parsed.memory == "sketch":  # a model-wide kind or keyword memory=sketch refuses
        sketched = sketch_groups([{}], kwargs, every)[0]
        if every is not None:  # e.g. not a divisor of the refresh period
            validate_group({**DEFAULTS, **kwargs, **sketched})
    for pattern, keywords in parsed.overrides.items():
        check_override(pattern, keywords)
    if model is not None:
        check_patterns(model, [*parsed.overrides, *(overrides or {})])


def trainer_decay_parameter_names(model: torch.nn.Module) -> list[str]:
    """The Trainer's decayed parameters (``Trainer.get_decay_parameter_names`` in 5.x)."""
    return [info.name for info in walk(model) if not hf_no_decay(info)]


# ---------------------------------------------------------------------- building
def _build(
    args: Any,
    model: torch.nn.Module | None,
    *,
    decay_parameter_names: list[str] | None = None,
    shampoo_kwargs: Mapping[str, Any] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    preset: str | None = None,
) -> dict[str, Any]:
    """Optimizer keywords, with ``params`` (named groups) when a model is given. Keywords the
    user set that change none of the groups (``newton_schulz_dtype`` with Shampoo,
    ``precondition_frequency`` with Muon) are reported with a warning."""
    parsed = parse_optim_args(getattr(args, "optim_args", None))
    preset = chosen_preset(args, parsed, preset)
    user = {**parsed.kwargs, **(shampoo_kwargs or {})}
    every = sketch_statistics_frequency(parsed.memory, user)
    kwargs = resolve_kwargs(args, user, preset=preset)
    groups: list[dict[str, Any]] = [{}]  # the Trainer's groups: the optimizer's keywords
    if model is not None:
        if decay_parameter_names is None:
            decay_parameter_names = trainer_decay_parameter_names(model)
        groups_defaults = dict(kwargs)
        weight_decay = groups_defaults.pop("weight_decay")
        groups = kwargs["params"] = param_groups(
            model,
            preset,
            {**parsed.overrides, **(overrides or {})},
            weight_decay=weight_decay,
            decay_parameter_names=decay_parameter_names,
            defaults=groups_defaults,
        )
        if "refresh_delay" not in user:  # the default delay, not where a group refuses it
            groups = kwargs["params"] = delayed_groups(groups, groups_defaults)
        if parsed.memory == "sketch":
            groups = kwargs["params"] = sketch_groups(groups, groups_defaults, every)
    elif parsed.memory == "sketch":  # the Trainer's two groups: the optimizer's keywords
        kwargs.update(sketch_groups([{}], kwargs, every)[0])
    base = {k: v for k, v in kwargs.items() if k != "params"}
    inert = inert_keywords(user, [{**DEFAULTS, **base, **g} for g in groups])
    if inert:
        default = base.get("preconditioner", DEFAULTS["preconditioner"])
        kinds = sorted({g.get("preconditioner", default) for g in groups})
        warnings.warn(
            f"hf_shampoo: {', '.join(map(repr, inert))} (optim_args / shampoo_kwargs) change "
            f"nothing here: no parameter group's kind uses them (preset {preset!r}, kinds: "
            f"{', '.join(kinds)})",
            UserWarning, stacklevel=3,
        )
    return kwargs


def create_optimizer(model: torch.nn.Module, args: Any, **options: Any) -> DistributedShampoo:
    """``DistributedShampoo`` for ``model`` configured from ``TrainingArguments``.

    ``options``: ``decay_parameter_names`` (default: the Trainer's rule), ``shampoo_kwargs``
    (docs/design.md §7 keywords over ``optim_args``), ``overrides`` ({pattern: keywords}),
    ``preset``, ``process_group`` (the data-parallel group the blocks are spread over, for a
    pipeline stage's part of the model: docs/parallelism.md#pipeline-parallel).
    """
    process_group = options.pop("process_group", None)
    kwargs = _build(args, model, **options)
    return DistributedShampoo(kwargs.pop("params"), **kwargs, process_group=process_group)


def optimizer_cls_and_kwargs(
    args: Any, model: torch.nn.Module | None = None, **options: Any
) -> tuple[type[DistributedShampoo], dict[str, Any]]:
    """For ``Trainer(optimizer_cls_and_kwargs=...)``: ``(DistributedShampoo, kwargs)``.

    With ``model`` the keywords carry the module-rule groups as ``params`` (the Trainer uses
    them instead of its own two groups); without it, the Trainer's decay / no-decay groups
    get the Shampoo keywords. Add ``ShampooCheckpointCallback`` for multi-rank checkpoints
    (``register()`` or ``ShampooTrainer`` do that for you).
    """
    return DistributedShampoo, _build(args, model, **options)
