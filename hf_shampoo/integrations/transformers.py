"""Transformers adapter: ``TrainingArguments(optim="distributed_shampoo")`` and ``ShampooTrainer``.

Two routes build the same optimizer from a model and ``TrainingArguments``:

- **by name** — ``register()`` adds ``"distributed_shampoo"`` and ``"distributed_muon"``
  (the same optimizer with the ``"muon"`` module preset) to transformers' optimizer names,
  so that a plain ``Trainer`` (and ``--optim distributed_shampoo`` on the command
  line) uses it, and adds ``ShampooCheckpointCallback`` to every Trainer. ``import hf_shampoo``
  arranges this lazily through ``register_on_import()``: transformers is patched when its
  modules load, never imported by ``hf_shampoo`` itself (``from transformers import Trainer``
  takes seconds). This route touches transformers internals, so it is guarded by version.
- **stable** — ``ShampooTrainer`` (overrides the public ``Trainer.create_optimizer``) or
  ``Trainer(optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(args, model))``; neither
  relies on private transformers API.

Defaults follow the AdamW migration (``trainer_defaults``), ``optim_args="k=v,..."`` takes
the docs/design.md §7 keyword names (``parse_optim_args``), and parameters are grouped by the module
rules of ``modules.py``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.util
import os
import sys
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import DEFAULTS, validate_group
from ..optimizer import DistributedShampoo
from .accelerate import consolidate
from .modules import PRESETS, check_override, hf_no_decay, param_groups, walk

OPTIMIZER_NAME = "distributed_shampoo"
_MEMBER_NAME = "DISTRIBUTED_SHAMPOO"
# Muon by name: the same optimizer with the "muon" module preset (spectral descent on
# hidden matrices, Adam elsewhere; docs/muon.md)
MUON_NAME = "distributed_muon"
_MUON_MEMBER_NAME = "DISTRIBUTED_MUON"
# the names this package registers, and the module preset each implies
OPTIMIZER_NAMES = {OPTIMIZER_NAME: None, MUON_NAME: "muon"}
_MEMBERS = {OPTIMIZER_NAME: _MEMBER_NAME, MUON_NAME: _MUON_MEMBER_NAME}
# Registration by name patches transformers internals; it is tested on 5.23 and written for
# 4.46 <= version < 6 (4.x through a wrapper of Trainer.get_optimizer_cls_and_kwargs).
MIN_TRANSFORMERS_VERSION = "4.46.0"
MAX_TRANSFORMERS_VERSION = "6.0.0"  # exclusive

# Fine-tuning defaults (hundreds to tens of thousands of steps), see docs/transformers.md
# ("What TrainingArguments become"):
# - precondition_frequency=50: the root inverses cost O(d^3) per block; every 50 steps this
#   is a few percent of the step time, and a 300-step run still refreshes 6 times.
# - start_preconditioning_step=None (= 50): Adam steps (the grafting method) until the
#   factor matrices have seen 50 gradients, a warm-up comparable to usual LR warm-ups.
# - max_preconditioner_dim=512: half the memory (8 bytes/parameter for the factors and roots
#   instead of 16) and half the eigendecomposition cost per parameter of 1024, while hidden
#   sizes of 768-4096 are still cut into few, large blocks.
FINE_TUNING_DEFAULTS: dict[str, Any] = {
    "precondition_frequency": 50,
    "start_preconditioning_step": None,
    "max_preconditioner_dim": 512,
}
SHAMPOO_EPSILON = 1e-12

INTEGRATION_KEYS = ("preset",)
_OVERRIDE_SEPARATOR = "@"


# ---------------------------------------------------------------------- optim_args
@dataclass
class OptimArgs:
    """``optim_args`` parsed: docs/design.md §7 keywords, per-pattern overrides, the module
    preset."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    preset: str | None = None


_DTYPE_ALIASES = {"fp32": "float32", "fp64": "float64", "bf16": "bfloat16", "fp16": "float16"}
# Keywords whose default is None, and the type they take otherwise.
_OPTIONAL_TYPES = {
    "beta3": float,
    "start_preconditioning_step": int,
    "grafting": str,
    "inverse_exponent_override": dict,
    "quantization": str,
    "statistics_frequency": int,
    "inv_factor_matrix_dtype": torch.dtype,
    "newton_schulz_dtype": torch.dtype,
    "spectral_lr_adjustment": str,
    "sign_scale": str,
    "vector_preconditioner": str,
}


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
    default = DEFAULTS[key]
    kind = _OPTIONAL_TYPES.get(key, type(default))
    if raw.lower() in ("none", "null") and (default is None or key in _OPTIONAL_TYPES):
        return None
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
    if kind is torch.dtype or isinstance(default, torch.dtype):
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


def parse_optim_args(optim_args: str | Mapping[str, Any] | None) -> OptimArgs:
    """Parse ``"k=v,k=v,PATTERN@k=v"`` (or a dict) into typed keywords.

    Keys are the docs/design.md §7 keyword names (plus ``preset``); ``PATTERN@key=value`` sets a
    keyword for the parameters whose name or owning module's name matches the glob
    ``PATTERN``. Inside ``optim_args`` write ``;`` where Python writes ``,`` in a value
    (``betas=(0.9;0.999)``, ``inverse_exponent_override={2:{0:0;1:0.5}}``): transformers
    splits ``optim_args`` on every comma. Unknown keys and bad values raise ``ValueError``
    listing the valid keys.
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
    for key, value in items:
        pattern, sep, name = str(key).rpartition(_OVERRIDE_SEPARATOR)
        if name == "preset" and not sep:
            if value not in PRESETS:
                raise _bad("preset", value, f"one of {', '.join(PRESETS)}")
            parsed.preset = value
            continue
        if name not in DEFAULTS:
            raise ValueError(
                f"hf_shampoo: unknown optim_args key {key!r}; valid keys: "
                f"{', '.join(valid_keys())} (PATTERN@key=value sets a key for the parameters "
                "or modules whose name matches the glob PATTERN)"
            )
        if sep and not pattern:
            raise ValueError(f"hf_shampoo: optim_args key {key!r} has an empty pattern")
        target = parsed.overrides.setdefault(pattern, {}) if sep else parsed.kwargs
        target[name] = cast_value(name, value)
    return parsed


# ---------------------------------------------------------------------- defaults
def trainer_defaults(args: Any) -> dict[str, Any]:
    """The AdamW migration of ``TrainingArguments``: ``learning_rate``, ``adam_beta1/2``,
    Adam grafting with ``adam_beta2`` / ``adam_epsilon``, decoupled ``weight_decay``,
    Shampoo epsilon 1e-12, and ``FINE_TUNING_DEFAULTS``."""
    return {
        "lr": args.learning_rate,
        "betas": (args.adam_beta1, args.adam_beta2),
        "epsilon": SHAMPOO_EPSILON,
        "weight_decay": args.weight_decay,
        "weight_decay_type": "decoupled",
        "grafting": "adam",
        "grafting_beta2": args.adam_beta2,
        "grafting_epsilon": args.adam_epsilon,
        **FINE_TUNING_DEFAULTS,
    }


def resolve_kwargs(args: Any, *chosen: Mapping[str, Any]) -> dict[str, Any]:
    """``trainer_defaults(args)`` updated by the user's keywords (``optim_args``, Python),
    validated. Choosing ``preconditioner="eigenvalue_corrected"`` (SOAP) also switches the
    defaults to no grafting and Adam's epsilon (``adam_epsilon``), unless those are set."""
    user: dict[str, Any] = {}
    for keywords in chosen:
        user.update(keywords)
    kwargs = {**trainer_defaults(args), **user}
    if user.get("preconditioner") == "eigenvalue_corrected":
        if "grafting" not in user:
            kwargs["grafting"] = None
        if "epsilon" not in user:
            kwargs["epsilon"] = args.adam_epsilon
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


def validate_args(args: Any) -> None:
    """Raise ``ValueError`` now if ``args.optim_args`` would not build a Shampoo optimizer
    through transformers (which splits ``optim_args`` on every comma)."""
    text = getattr(args, "optim_args", None)
    if isinstance(text, str) and any("," in item for item in _split_top_level(text)):
        raise ValueError(
            f"hf_shampoo: optim_args={text!r} has a comma inside a value; transformers splits "
            "optim_args on every comma, so write ';' there, e.g. betas=(0.9;0.999)"
        )
    parsed = parse_optim_args(text)
    resolve_kwargs(args, parsed.kwargs)
    for pattern, keywords in parsed.overrides.items():
        check_override(pattern, keywords)


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
    """Optimizer keywords, with ``params`` (named groups) when a model is given."""
    parsed = parse_optim_args(getattr(args, "optim_args", None))
    kwargs = resolve_kwargs(args, parsed.kwargs, shampoo_kwargs or {})
    if model is None:
        return kwargs
    if decay_parameter_names is None:
        decay_parameter_names = trainer_decay_parameter_names(model)
    all_overrides = {**parsed.overrides, **(overrides or {})}
    groups_defaults = dict(kwargs)
    weight_decay = groups_defaults.pop("weight_decay")
    kwargs["params"] = param_groups(
        model,
        preset or parsed.preset or OPTIMIZER_NAMES.get(_optim_name(args)) or "transformer",
        all_overrides,
        weight_decay=weight_decay,
        decay_parameter_names=decay_parameter_names,
        defaults=groups_defaults,
    )
    return kwargs


def create_optimizer(model: torch.nn.Module, args: Any, **options: Any) -> DistributedShampoo:
    """``DistributedShampoo`` for ``model`` configured from ``TrainingArguments``.

    ``options``: ``decay_parameter_names`` (default: the Trainer's rule), ``shampoo_kwargs``
    (docs/design.md §7 keywords over ``optim_args``), ``overrides`` ({pattern: keywords}),
    ``preset``.
    """
    kwargs = _build(args, model, **options)
    return DistributedShampoo(kwargs.pop("params"), **kwargs)


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


# ---------------------------------------------------------------------- callback & trainer
def _optim_name(args: Any) -> str:
    optim = getattr(args, "optim", None)
    return str(getattr(optim, "value", optim))


def _uses_shampoo(args: Any) -> bool:
    """Whether ``args.optim`` is one of this package's names."""
    return _optim_name(args) in OPTIMIZER_NAMES


def _will_save_optimizer(args: Any, control: Any) -> bool:
    if getattr(args, "save_only_model", False):
        return False
    best = str(getattr(args.save_strategy, "value", args.save_strategy)) == "best"
    return bool(control.should_save or (best and control.should_evaluate))


def save_ranks(args: Any) -> list[int]:
    """Global ranks that write ``optimizer.pt``: rank 0, or with ``save_on_each_node`` the
    first rank of every node (each receives the consolidated state)."""
    world = int(getattr(args, "world_size", 1) or 1)
    if getattr(args, "save_on_each_node", False):
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return list(range(0, world, max(local, 1)))
    return [0]


_classes: dict[str, type] = {}


def _make_classes() -> dict[str, type]:
    """Define the classes that subclass transformers' (imported on first use)."""
    if _classes:
        return _classes
    from transformers import Trainer, TrainerCallback

    if _classes:  # importing the Trainer ran the import hook, which defined them
        return _classes

    class ShampooCheckpointCallback(TrainerCallback):
        """Consolidates ``DistributedShampoo``'s sharded state on rank 0 before a save.

        The Trainer writes ``optimizer.pt`` from rank 0 only; this callback runs on every
        rank at ``on_step_end`` / ``on_epoch_end``, after ``DefaultFlowCallback`` has set
        ``control.should_save`` (and before the save itself), and calls the collective
        ``consolidate_state_dict()`` onto every rank that writes the checkpoint (rank 0, or
        each node's first rank with ``save_on_each_node``). With ``save_strategy="best"``
        it consolidates at every
        evaluation, since whether to save is decided after it. It also validates
        ``optim_args`` when the Trainer is built. Other optimizers are left alone.
        """

        def on_init_end(self, args, state, control, **kwargs):
            if _uses_shampoo(args):
                validate_args(args)

        def _consolidate_if_saving(self, args, control, optimizer):
            if optimizer is not None and _will_save_optimizer(args, control):
                consolidate(optimizer, to=save_ranks(args))

        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            self._consolidate_if_saving(args, control, optimizer)

        def on_epoch_end(self, args, state, control, optimizer=None, **kwargs):
            self._consolidate_if_saving(args, control, optimizer)

    class ShampooTrainer(Trainer):
        """A ``Trainer`` that always trains with ``DistributedShampoo``.

        Uses only public Trainer API (``create_optimizer``, ``get_decay_parameter_names``,
        ``pop_callback`` / ``add_callback``: the checkpoint callback goes last).
        ``args.optim_args`` is read as Shampoo keywords whatever
        ``args.optim`` says; ``shampoo_kwargs`` (docs/design.md §7 keywords), ``module_overrides``
        ({pattern: keywords}) and ``preset`` ("transformer", "cnn", "none") win over it.
        """

        def __init__(
            self,
            *args,
            shampoo_kwargs: Mapping[str, Any] | None = None,
            module_overrides: Mapping[str, Mapping[str, Any]] | None = None,
            preset: str | None = None,
            **kwargs,
        ):
            self.shampoo_kwargs = dict(shampoo_kwargs or {})
            self.module_overrides = dict(module_overrides or {})
            self.shampoo_preset = preset
            super().__init__(*args, **kwargs)
            parsed = parse_optim_args(self.args.optim_args)
            resolve_kwargs(self.args, parsed.kwargs, self.shampoo_kwargs)  # fail early
            if preset is not None and preset not in PRESETS:
                raise ValueError(f"hf_shampoo: unknown preset {preset!r}; valid: {list(PRESETS)}")
            # last, so that it sees should_save as every other callback left it
            callback = self.pop_callback(ShampooCheckpointCallback) or ShampooCheckpointCallback
            self.add_callback(callback)

        def create_optimizer(self, model=None):
            opt_model = self.model if model is None else model
            if self.optimizer is None:
                self.optimizer = create_optimizer(
                    opt_model,
                    self.args,
                    decay_parameter_names=self.get_decay_parameter_names(opt_model),
                    shampoo_kwargs=self.shampoo_kwargs,
                    overrides=self.module_overrides,
                    preset=self.shampoo_preset,
                )
            return self.optimizer

    _classes.update(
        ShampooCheckpointCallback=ShampooCheckpointCallback, ShampooTrainer=ShampooTrainer
    )
    return _classes


def __getattr__(name: str) -> Any:
    # ShampooTrainer / ShampooCheckpointCallback subclass transformers' classes: define them
    # on first access so that importing this module does not import transformers.
    if name in ("ShampooTrainer", "ShampooCheckpointCallback"):
        return _make_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------- registration
_version_ok: list[bool] = []


def _version_supported() -> bool:
    """Whether registration by name supports the installed transformers (warns once if not)."""
    if _version_ok:
        return _version_ok[0]
    import transformers
    from packaging.version import Version

    version = Version(transformers.__version__)
    ok = Version(MIN_TRANSFORMERS_VERSION) <= version < Version(MAX_TRANSFORMERS_VERSION)
    _version_ok.append(ok)
    if not ok:
        warnings.warn(
            f"hf_shampoo: transformers {transformers.__version__} is outside the versions "
            f"optim={OPTIMIZER_NAME!r} supports ({MIN_TRANSFORMERS_VERSION} <= v < "
            f"{MAX_TRANSFORMERS_VERSION}); not registering it. Use "
            "hf_shampoo.integrations.transformers.ShampooTrainer instead.",
            stacklevel=3,
        )
    return ok


def _add_enum_member(enum_cls: type, name: str, value: str) -> Any:
    """Add ``name = value`` to a ``(str, Enum)`` class (idempotent)."""
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = str.__new__(enum_cls, value)
    member._name_ = name
    member._value_ = value
    member._sort_order_ = len(enum_cls._member_names_)
    member.__objclass__ = enum_cls
    setattr(enum_cls, name, member)
    enum_cls._member_names_.append(name)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    return member


def _handler(ctx: Any) -> tuple[type, dict[str, Any]]:
    """transformers 5.x optimizer handler: ``OptimizerContext`` → (class, kwargs)."""
    return optimizer_cls_and_kwargs(ctx.args, ctx.model)


def _patch_training_args(module: Any) -> None:
    for name, member in _MEMBERS.items():
        _add_enum_member(module.OptimizerNames, member, name)


def _patch_trainer_optimizer(module: Any) -> None:
    handlers = getattr(module, "_OPTIMIZER_HANDLERS", None)
    if handlers is None:
        return  # transformers 4.x: _patch_trainer wraps get_optimizer_cls_and_kwargs instead
    names = importlib.import_module("transformers.training_args").OptimizerNames
    for name, member_name in _MEMBERS.items():
        handlers.setdefault(_add_enum_member(names, member_name, name), _handler)


def _patch_trainer(module: Any) -> None:
    callback = _make_classes()["ShampooCheckpointCallback"]
    if callback not in module.DEFAULT_CALLBACKS:
        module.DEFAULT_CALLBACKS.append(callback)
    trainer_optimizer = sys.modules.get("transformers.trainer_optimizer")
    if getattr(trainer_optimizer, "_OPTIMIZER_HANDLERS", None) is not None:
        return
    # 4.x: no handler registry; wrap the static method that maps args.optim to a class.
    trainer_cls = module.Trainer
    original = trainer_cls.__dict__["get_optimizer_cls_and_kwargs"]
    if getattr(original, "_hf_shampoo", False):
        return

    def get_optimizer_cls_and_kwargs(args, model=None):
        if _uses_shampoo(args):
            return optimizer_cls_and_kwargs(args, model)
        return original.__func__(args, model)

    wrapped = staticmethod(get_optimizer_cls_and_kwargs)
    get_optimizer_cls_and_kwargs._hf_shampoo = True
    wrapped._hf_shampoo = True
    trainer_cls.get_optimizer_cls_and_kwargs = wrapped


_PATCHES: dict[str, Callable[[Any], None]] = {
    "transformers.training_args": _patch_training_args,
    "transformers.trainer_optimizer": _patch_trainer_optimizer,
    "transformers.trainer": _patch_trainer,
}
_patched: set[str] = set()
_lock = threading.RLock()


def _apply(fullname: str, module: Any) -> None:
    with _lock:
        if fullname in _patched:
            return
        _patched.add(fullname)
        if not _version_supported():
            return
        _PATCHES[fullname](module)


def register() -> bool:
    """Register ``optim="distributed_shampoo"`` with transformers now (imports the Trainer).

    Idempotent. Returns False (with a warning) for transformers versions outside
    ``MIN_TRANSFORMERS_VERSION <= v < MAX_TRANSFORMERS_VERSION``.
    """
    if not _version_supported():
        return False
    for fullname in _PATCHES:
        try:
            module = importlib.import_module(fullname)
        except ModuleNotFoundError:  # transformers.trainer_optimizer is 5.x only
            continue
        _apply(fullname, module)
    return True


def is_registered() -> bool:
    """Whether ``TrainingArguments(optim="distributed_shampoo")`` and ``"distributed_muon"``
    are accepted (so far)."""
    module = sys.modules.get("transformers.training_args")
    return module is not None and all(
        name in module.OptimizerNames._value2member_map_ for name in OPTIMIZER_NAMES)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Import hook: patches each of ``_PATCHES``' modules right after it has executed."""

    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname not in _PATCHES or fullname in _patched or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.on = False
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            try:
                _apply(fullname, module)
            except Exception as error:  # noqa: BLE001 - never break `import transformers`
                warnings.warn(
                    f"hf_shampoo: could not register with transformers: {error}", stacklevel=2
                )
            if all(name in _patched for name in _PATCHES) and self in sys.meta_path:
                sys.meta_path.remove(self)

        loader.exec_module = exec_then_patch  # this module's loader instance only
        return spec


def register_on_import() -> None:
    """Register with transformers lazily: patch its modules already loaded now, the others
    right after they load. Costs nothing when transformers is never imported; this is what
    ``import hf_shampoo`` calls."""
    if importlib.util.find_spec("transformers") is None:
        return
    pending = False
    for fullname in _PATCHES:
        module = sys.modules.get(fullname)
        if module is not None:
            try:
                _apply(fullname, module)
            except Exception as error:  # noqa: BLE001 - never break `import hf_shampoo`
                warnings.warn(
                    f"hf_shampoo: could not register with transformers: {error}", stacklevel=2
                )
        else:
            pending = True
    if pending and not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
