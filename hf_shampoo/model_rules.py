"""Module rules: walk a model and map its parameters to ``DistributedShampoo`` group configs.

``param_groups(model, preset=...)`` gives every trainable parameter (tied weights once, under
their first name) a role found from the model itself, by module type and the model's own
accessors (``get_input_embeddings()``, ``get_output_embeddings()``, ``base_model``, timm's
``get_classifier()``), never by comparing sizes in a model that names its parts:

- ``embedding``: embedding tables (``nn.Embedding``: tokens, positions, token types, T5's
  relative attention bias), whatever sits in the model's input embeddings (ViT's patch
  projection) and bare embedding parameters (ViT's ``position_embeddings``, ``cls_token``);
- ``head``: the output projection (``get_output_embeddings()``, tied or not) and the task
  heads outside the model's ``base_model`` (``classifier`` / ``score`` of the
  ``*ForSequenceClassification`` / ``*ForTokenClassification`` / ``*ForImageClassification``
  families);
- ``router``: a mixture of experts' router (``*Router`` modules, a ``gate`` next to experts);
- ``bias``, ``norm``, ``vector`` (any other tensor with at most one dim larger than 1);
- ``matrix`` and ``conv``: hidden weights; ``vocab``: a weight with a vocabulary-sized dim,
  the last resort for models without those accessors (plain ``nn.Module`` models).

Each preset maps roles to a configuration:

- ``"transformer"``: tables and the output projection are not Kronecker-preconditioned along
  the vocabulary dim (``inverse_exponent_override`` ``{2: {d: 0}}``; a table small enough to
  be merged into one dim gets the diagonal method); biases, norms and vectors use the
  grafting method alone (``preconditioner="diagonal"``); everything else full Shampoo,
  kernels merged by docs/design.md §1;
- ``"cnn"``: the same without the vocabulary rule for the head;
- ``"muon"``: hidden matrices and conv kernels (as (out, rest)) by spectral descent on whole
  matrices (docs/muon.md); embeddings of any shape, every head, routers, norms, biases and
  vectors by Adam;
- ``"none"``: the optimizer's keywords for every parameter.

A mixture of experts' fused weights (transformers' experts modules: ``gate_up_proj`` /
``down_proj`` of shape ``(num_experts, out, in)``) are ``E`` matrices, not one tensor: their
group has ``experts=True``, so each expert gets its own blocks, factors and
orthogonalization, and the rules above see one expert's shape. ``overrides`` map glob
patterns over parameter or module names to keywords; ``role_of(param)`` says the role a
parameter got. The groups are plain dicts: ``make_optimizer`` (``factory.py``) builds the
optimizer over them and ``describe(optimizer)`` (``describe_table.py``) prints the result per
parameter; nothing here imports the optimizer.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from .blocking import expert_shape, merged_shape
from .config import DEFAULTS, GLOBAL_KEYS, did_you_mean, validate_group
from .preconditioners import KINDS

# Torch's normalisation layers; classes named "...Norm..." (LlamaRMSNorm, T5LayerNorm,
# timm's LayerNorm2d) count as well.
NORM_TYPES: tuple[type, ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.batchnorm._NormBase,  # BatchNorm*d, SyncBatchNorm, InstanceNorm*d
    nn.LocalResponseNorm,
) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())
EMBEDDING_TYPES: tuple[type, ...] = (nn.Embedding, nn.EmbeddingBag)

ROLES = ("bias", "norm", "embedding", "head", "router", "vector", "vocab", "conv", "matrix")
# the roles a parameter's shape alone gives (what a role found from the model falls back to
# in presets that do not treat that role specially)
SHAPE_ROLES = ("vector", "conv", "matrix")

# Trainer's rule for parameters without weight decay (transformers 5.x
# ``Trainer.get_decay_parameter_names``): inside an ``nn.LayerNorm``, or a name matching these.
HF_NO_DECAY_PATTERNS = (
    r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"
)


@dataclass(frozen=True)
class ParamInfo:
    """One trainable parameter as the model walk sees it."""

    name: str  # first name (as ``named_parameters()`` reports it)
    aliases: tuple[str, ...]  # every name, the first included (tied weights have several)
    module_names: tuple[str, ...]  # names of the modules that own it directly
    modules: tuple[nn.Module, ...]
    param: Tensor
    role: str
    vocab_dims: tuple[int, ...] = ()  # index dims: a table's rows, the output head's vocabulary
    experts: bool = False  # dim 0 indexes the experts of a fused experts module

    @property
    def unit_shape(self) -> tuple[int, ...]:
        """The shape the role rules see: one expert's for fused experts, else the whole."""
        return expert_shape(self.param.shape, self.experts)

    @property
    def shape_role(self) -> str:
        """The role its shape alone gives: ``vector``, ``conv`` or ``matrix``."""
        return shape_role(self.unit_shape)


@dataclass(frozen=True)
class Preset:
    """Which roles get which configuration, and which parameters are exempt from decay."""

    name: str
    diagonal_roles: frozenset[str]
    vocab_rule: bool  # look for vocabulary-sized dims beyond embedding tables
    no_decay: Callable[[ParamInfo], bool]
    spectral_roles: frozenset[str] = frozenset()  # spectral descent on whole matrices


def hf_no_decay(info: ParamInfo) -> bool:
    """Transformers' Trainer rule: no decay inside ``nn.LayerNorm`` or for bias/norm names."""
    if any(isinstance(m, nn.LayerNorm) for m in info.modules):
        return True
    patterns = [re.compile(p) for p in HF_NO_DECAY_PATTERNS]
    return any(p.search(info.name.lower()) for p in patterns)


def vector_no_decay(info: ParamInfo) -> bool:
    """timm's rule: no decay for biases, norm weights and every other tensor of ndim <= 1."""
    return info.param.ndim <= 1 or info.role in ("bias", "norm")


def muon_no_decay(info: ParamInfo) -> bool:
    """The muon preset's rule: the Trainer's, and every tensor of ndim <= 1 as timm's."""
    return hf_no_decay(info) or vector_no_decay(info)


PRESETS: dict[str, Preset] = {
    "transformer": Preset(
        "transformer", frozenset({"bias", "norm", "vector"}), True, hf_no_decay
    ),
    "cnn": Preset("cnn", frozenset({"bias", "norm", "vector"}), False, vector_no_decay),
    "none": Preset("none", frozenset(), False, lambda info: False),
    # Muon (as its recipes): hidden matrices and conv kernels (as (out, rest)) by spectral
    # descent; embeddings of any shape, every head, routers, norms, biases and vectors by Adam
    "muon": Preset("muon", frozenset({"bias", "norm", "vector", "embedding", "vocab", "head",
                                      "router"}), True,
                   muon_no_decay, spectral_roles=frozenset({"matrix", "conv"})),
}
# the muon preset's matrices are never cut: one block per matrix, whatever its size
WHOLE_MATRIX = 2**31 - 1
# a matrix whose long side is this many times its short side (a LoRA adapter's d × r) keeps
# the long side's factor diagonal in every preset (diagonal_aspect; an override wins)
ADAPTER_ASPECT = 16
# peft's LoRA adapter matrices, by name: their long side is diagonal whatever their aspect
PEFT_ADAPTERS = (".lora_A.", ".lora_B.")
# the role param_groups found for each parameter, for describe() (weak: never keeps a
# parameter alive)
_ROLE_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()


# ---------------------------------------------------------------------- model walk
def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, NORM_TYPES) or "norm" in type(module).__name__.lower()


def is_experts_module(module: nn.Module) -> bool:
    """A module holding a mixture of experts' weights fused along dim 0: what transformers'
    ``@use_experts_implementation`` marks (``MixtralExperts``, ``Qwen3MoeExperts``,
    ``GptOssExperts``, ...: it sets ``is_transposed`` / ``is_concatenated`` / ``has_gate`` on
    the instance), or a class named ``...Experts`` (``Llama4TextExperts``,
    ``JetMoeParallelExperts``). Decided by module, not by ``ndim``: a conv1d kernel is 3-D
    as well."""
    marked = all(hasattr(module, key) for key in ("is_transposed", "is_concatenated",
                                                   "has_gate"))
    return marked or type(module).__name__.endswith("Experts")


def _is_fused_experts(param: Tensor, modules: list[nn.Module]) -> bool:
    """A parameter of an experts module whose dim 0 is the experts (``num_experts`` when
    the module says it): its weights ``(E, out, in)`` and biases ``(E, out)``."""
    for module in modules:
        if not is_experts_module(module) or param.ndim < 2:
            continue
        count = getattr(module, "num_experts", None)
        if not isinstance(count, int) or param.shape[0] == count:
            return True
    return False


def guess_vocab_size(model: nn.Module) -> int | None:
    """``model.config.vocab_size`` when there is one, else the largest embedding table."""
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None)
    if isinstance(size, int) and size > 1:
        return size
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, EMBEDDING_TYPES)]
    return max(sizes) if sizes else None


def shape_role(shape: tuple[int, ...]) -> str:
    """``vector`` (at most one dim larger than 1), ``conv`` (3 dims or more) or ``matrix``."""
    if sum(d > 1 for d in shape) <= 1:
        return "vector"
    return "conv" if len(shape) >= 3 else "matrix"


def _accessor(model: nn.Module, name: str) -> tuple[bool, nn.Module | None]:
    """Whether ``model`` has the accessor ``name`` (transformers' ``get_output_embeddings``,
    timm's ``get_classifier``, ...), and the module it returns (None if none)."""
    getter = getattr(model, name, None)
    if not callable(getter):
        return False, None
    try:
        module = getter()
    except (AttributeError, NotImplementedError, TypeError):
        return True, None
    return True, module if isinstance(module, nn.Module) else None


def _task_head_params(model: nn.Module) -> set[int]:
    """Ids of the parameters outside a transformers model's ``base_model``: its task heads
    (``classifier``, ``score``, ``lm_head``, ...). A peft model is looked through
    (``get_base_model()``); a model that is its own base (T5ForConditionalGeneration, plain
    modules) has none by this rule."""
    _, inner = _accessor(model, "get_base_model")
    inner = inner if inner is not None else model
    base = getattr(inner, "base_model", None)
    if not isinstance(base, nn.Module) or base is inner:
        return set()
    inside = {id(p) for p in base.parameters()}
    return {id(p) for p in inner.parameters() if id(p) not in inside}


def _is_router(module: nn.Module) -> bool:
    return "router" in type(module).__name__.lower()


def _router_modules(model: nn.Module) -> set[int]:
    """Ids of the routers of mixtures of experts: ``*Router`` modules (transformers 5's
    ``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``, ...) and a ``gate`` / ``router`` child next
    to an experts module (older sparse-MoE blocks with an ``nn.Linear`` gate)."""
    found = {id(m) for m in model.modules() if _is_router(m)}
    for module in model.modules():
        children = dict(module.named_children())
        experts = children.get("experts")
        if experts is None or not (is_experts_module(experts)
                                   or isinstance(experts, nn.ModuleList)):
            continue
        found.update(id(children[n]) for n in ("gate", "router") if n in children)
    return found


def _is_embedding_parameter(leaf: str, owner: nn.Module) -> bool:
    """A bare parameter of an embeddings module (ViT's ``position_embeddings`` and
    ``cls_token`` of ``ViTEmbeddings``; timm's ``pos_embed``, ``reg_token``)."""
    if isinstance(owner, (nn.Linear, nn.modules.conv._ConvNd, *EMBEDDING_TYPES)):
        return False
    if leaf in ("weight", "bias"):
        return False
    lowered = leaf.lower()
    owner_name = type(owner).__name__.lower()
    return ("embed" in lowered or "position" in lowered or lowered.endswith("_token")
            or owner_name.endswith(("embeddings", "embedding")))


@dataclass(frozen=True)
class ModelParts:
    """What the model says about its parts (ids of modules and parameters)."""

    named: bool  # the model has transformers' accessors: no vocabulary-size guessing
    input_modules: frozenset[int]  # the input embeddings and everything inside them
    output_module: nn.Module | None  # get_output_embeddings()
    head_modules: frozenset[int]  # the output embeddings and timm's get_classifier()
    head_params: frozenset[int]  # parameters outside base_model
    routers: frozenset[int]

    @classmethod
    def of(cls, model: nn.Module) -> ModelParts:
        has_output, output = _accessor(model, "get_output_embeddings")
        has_input, inputs = _accessor(model, "get_input_embeddings")
        _, classifier = _accessor(model, "get_classifier")
        heads = {id(m) for head in (output, classifier) if head is not None
                 for m in head.modules()}
        return cls(
            named=has_output or has_input,
            input_modules=frozenset(id(m) for m in inputs.modules()) if inputs else frozenset(),
            output_module=output,
            head_modules=frozenset(heads),
            head_params=frozenset(_task_head_params(model)),
            routers=frozenset(_router_modules(model)),
        )


def _output_vocab_dims(output: nn.Module, shape: tuple[int, ...],
                       vocab_size: int | None) -> tuple[int, ...]:
    """The vocabulary dims of the output projection: dim 0 of an ``nn.Linear(hidden, vocab)``
    or a tied table; else the dims of ``vocab_size``."""
    if isinstance(output, (nn.Linear, *EMBEDDING_TYPES)) and len(shape) == 2:
        return (0,)
    if vocab_size is not None and len(shape) == 2:
        return tuple(j for j, d in enumerate(shape) if d == vocab_size)
    return ()


def _role(
    leaf: str,
    leaves: list[str],
    param: Tensor,
    shape: tuple[int, ...],
    modules: list[nn.Module],
    parts: ModelParts,
    vocab_size: int | None,
) -> tuple[str, tuple[int, ...]]:
    """The role of a parameter (of this shape: one expert's, for fused experts) and its
    index dims, from the modules that own it and what the model says about them."""
    if leaf == "bias":
        return "bias", ()
    if any(_is_norm(m) for m in modules):
        return "norm", ()
    if any(isinstance(m, EMBEDDING_TYPES) for m in modules) and len(shape) == 2:
        return "embedding", (0,)
    if (any(id(m) in parts.input_modules for m in modules)
            or any(_is_embedding_parameter(own, m) for own, m in zip(leaves, modules))):
        return "embedding", ()
    output = parts.output_module
    if output is not None and any(m is output for m in modules):
        return "head", _output_vocab_dims(output, shape, vocab_size)
    if id(param) in parts.head_params or any(id(m) in parts.head_modules for m in modules):
        return "head", ()
    if any(id(m) in parts.routers for m in modules):
        return "router", ()
    by_shape = shape_role(shape)
    if by_shape != "vector" and not parts.named and vocab_size is not None \
            and len(shape) == 2 and vocab_size in shape:
        # last resort, for a model that names nothing: a dim of the vocabulary's size
        return "vocab", tuple(j for j, d in enumerate(shape) if d == vocab_size)
    return by_shape, ()


def walk(model: nn.Module, vocab_size: int | None = None) -> list[ParamInfo]:
    """Every trainable parameter once (tied weights under their first name), with its role.

    Roles come from the model (see the module docstring). ``vocab_size`` is the last
    resort for a model without transformers' accessors (a plain ``nn.Module``): there, a
    2-D weight with a dim of that size gets the ``vocab`` role (pass
    ``guess_vocab_size(model)``); in a transformers model it only helps find the vocabulary
    dim of an output projection that is neither an ``nn.Linear`` nor a table.
    """
    parts = ModelParts.of(model)
    owners: dict[int, list[tuple[str, str, str, nn.Module]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for leaf, param in module.named_parameters(recurse=False, remove_duplicate=False):
            full = f"{module_name}.{leaf}" if module_name else leaf
            owners.setdefault(id(param), []).append((full, module_name, leaf, module))
    infos = []
    for name, param in model.named_parameters():  # deduplicated: tied weights once
        if not param.requires_grad:
            continue
        entries = owners.get(
            id(param), [(name, name.rpartition(".")[0], name.rpartition(".")[2], model)])
        aliases = tuple(dict.fromkeys([name] + [full for full, _, _, _ in entries]))
        modules = [m for _, _, _, m in entries]
        experts = _is_fused_experts(param, modules)
        role, vocab_dims = _role(
            name.rpartition(".")[2], [leaf for _, _, leaf, _ in entries], param,
            expert_shape(param.shape, experts), modules, parts, vocab_size,
        )
        infos.append(
            ParamInfo(
                name=name,
                aliases=aliases,
                module_names=tuple(dict.fromkeys(mn for _, mn, _, _ in entries)),
                modules=tuple(modules),
                param=param,
                role=role,
                vocab_dims=vocab_dims,
                experts=experts,
            )
        )
    return infos


# ---------------------------------------------------------------------- rules → groups
def _matches(pattern: str, info: ParamInfo) -> bool:
    """Glob over parameter names and owning module names; ``re:`` prefixes a regex."""
    names = info.aliases + tuple(n for n in info.module_names if n)
    if pattern.startswith("re:"):
        regex = re.compile(pattern[3:])
        return any(regex.search(n) for n in names)
    return any(fnmatch.fnmatchcase(n, pattern) for n in names)


def check_override(pattern: str, keywords: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` if ``keywords`` cannot configure a parameter group."""
    for key in keywords:
        if key in GLOBAL_KEYS:
            raise ValueError(
                f"hf_shampoo: override {pattern!r} sets {key!r}, which applies to the whole "
                "optimizer; set it as an optimizer keyword instead"
            )
        if key not in DEFAULTS:
            raise ValueError(
                f"hf_shampoo: override {pattern!r} has unknown keyword {key!r}"
                f"{did_you_mean(key, DEFAULTS)}; valid keywords "
                f"are {', '.join(k for k in DEFAULTS if k not in GLOBAL_KEYS)}"
            )
    group = {**DEFAULTS, **keywords}
    if isinstance(group["betas"], list):
        group["betas"] = tuple(group["betas"])
    try:
        validate_group(group)
    except ValueError as error:
        raise ValueError(f"hf_shampoo: override {pattern!r}: {error}") from None


def check_preset(preset: Any, where: str = "preset") -> None:
    """Raise ``ValueError`` for a preset name that is not one of ``PRESETS``."""
    if isinstance(preset, Preset):
        return
    if preset not in PRESETS:
        raise ValueError(f"hf_shampoo: unknown {where} {preset!r}{did_you_mean(preset, PRESETS)}; "
                         f"valid: {', '.join(PRESETS)}")


def check_patterns(model: nn.Module, patterns: Iterable[str]) -> None:
    """Raise ``ValueError`` naming the override patterns that match no parameter or module
    name of ``model`` (what ``param_groups`` refuses), before any optimizer is built."""
    infos = walk(model)
    _refuse_unmatched([p for p in patterns if not any(_matches(p, i) for i in infos)], infos)


def _refuse_unmatched(unused: list[str], infos: list[ParamInfo]) -> None:
    if unused:
        examples = ", ".join(info.name for info in infos[:4])
        raise ValueError(
            f"hf_shampoo: override pattern(s) {', '.join(map(repr, unused))} matched no "
            f"parameter or module name (names look like: {examples}, ...)"
        )


def _role_keywords(info: ParamInfo, preset: Preset, effective: Mapping[str, Any]) -> dict:
    """The preset's keywords for one parameter, given the keywords that will apply to it.
    A role the preset does not name falls back to its shape's (``info.shape_role``)."""
    own = KINDS[effective["preconditioner"]].rule_keywords(info.shape_role, effective)
    if own is not None:  # a kind with rules of its own (riemannian_lora, docs/lora.md)
        return own
    vector = info.shape_role == "vector" and "vector" in preset.diagonal_roles
    if info.role in preset.diagonal_roles or vector:
        return _diagonal(effective)
    if info.role in preset.spectral_roles:
        return _spectral(effective)
    if info.vocab_dims and (info.role == "embedding" or preset.vocab_rule):
        merged = merged_shape(info.param.shape, effective["max_preconditioner_dim"])
        if len(merged) != info.param.ndim:  # small table merged into one dim: no vocab factor
            return _diagonal(effective)
        return {"inverse_exponent_override": {2: {d: 0 for d in info.vocab_dims}}}
    shape = info.unit_shape
    if (info.shape_role == "matrix" and len(shape) == 2 and min(shape) > 0
            and KINDS[effective["preconditioner"]].diagonal_factors
            and effective["quantization"] is None
            and effective.get("diagonal_aspect") is None):
        # an adapter (peft's lora_A / lora_B, any aspect) or an adapter-like matrix (long
        # side >= 16x the short one): a full factor on the short side only
        if any(key in info.name for key in PEFT_ADAPTERS):
            return {"diagonal_aspect": 1.0}
        if max(shape) >= ADAPTER_ASPECT * min(shape):
            return {"diagonal_aspect": float(ADAPTER_ASPECT)}
    return {}


def _diagonal(effective: Mapping[str, Any]) -> dict:
    keywords: dict[str, Any] = {"preconditioner": "diagonal"}
    if effective.get("grafting") is None:  # e.g. SOAP without grafting: Adam for vectors
        keywords["grafting"] = "adam"
    return keywords


def _spectral(effective: Mapping[str, Any]) -> dict:
    """Muon on a whole matrix: no grafting (its own scale), Nesterov momentum from
    ``betas[0]`` unless ``beta3`` is set, and AdamW's update RMS unless
    ``spectral_lr_adjustment`` is set, so one learning rate serves both kinds."""
    keywords: dict[str, Any] = {"preconditioner": "spectral_descent",
                                "max_preconditioner_dim": WHOLE_MATRIX, "grafting": None}
    if effective.get("beta3") is None:
        keywords["beta3"] = effective["betas"][0] ** 2
    if effective.get("spectral_lr_adjustment") is None:
        keywords["spectral_lr_adjustment"] = "match_rms_adamw"
    return keywords


def _group_key(keywords: Mapping[str, Any]) -> str:
    return repr(sorted(keywords.items()))


def param_groups(
    model: nn.Module,
    preset: str | Preset = "transformer",
    overrides: Mapping[str, Mapping[str, Any]] | Iterable[tuple[str, Mapping]] | None = None,
    *,
    weight_decay: float = 0.0,
    decay_parameter_names: Iterable[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    vocab_size: int | None = None,
) -> list[dict[str, Any]]:
    """Named parameter groups for ``DistributedShampoo`` (``params`` as ``(name, tensor)``).

    ``preset`` picks the rules (see the module docstring); ``overrides`` maps patterns to
    keywords, applied in order after the preset, a later pattern winning (a pattern that
    matches nothing raises). ``weight_decay`` goes to every parameter not exempt from decay:
    those in ``decay_parameter_names`` when given (e.g. from the Trainer), else the
    preset's rule; overrides may still set ``weight_decay``. ``defaults`` are the
    optimizer-level keywords (needed to decide how a vocabulary-sized table is blocked);
    ``vocab_size`` defaults to ``guess_vocab_size(model)`` when the preset wants it.
    """
    check_preset(preset)
    rules = PRESETS[preset] if isinstance(preset, str) else preset
    base = {**DEFAULTS, **(defaults or {})}
    override_items = list(overrides.items() if isinstance(overrides, Mapping) else overrides or [])
    for pattern, keywords in override_items:
        check_override(pattern, keywords)
    if vocab_size is None and rules.vocab_rule:
        vocab_size = guess_vocab_size(model)
    decay_names = set(decay_parameter_names) if decay_parameter_names is not None else None

    infos = walk(model, vocab_size if rules.vocab_rule else None)
    used = [False] * len(override_items)
    groups: dict[str, dict[str, Any]] = {}
    for info in infos:
        user: dict[str, Any] = {}
        for k, (pattern, keywords) in enumerate(override_items):
            if _matches(pattern, info):
                user.update(keywords)
                used[k] = True
        exempt = info.name not in decay_names if decay_names is not None else rules.no_decay(info)
        keywords = {"weight_decay": 0.0 if exempt else weight_decay}
        if info.experts:  # one expert's blocks, factors and orthogonalization each
            keywords["experts"] = True
        keywords.update(_role_keywords(info, rules, {**base, **user}))
        keywords.update(user)
        _ROLE_OF[info.param] = info.role
        key = _group_key(keywords)
        if key not in groups:
            groups[key] = {"params": [], **keywords}
        groups[key]["params"].append((info.name, info.param))
    _refuse_unmatched([pattern for (pattern, _), hit in zip(override_items, used) if not hit],
                      infos)
    return list(groups.values())


def role_of(param: Tensor) -> str:
    """The role ``param_groups`` found for ``param`` ("-" for one it did not group)."""
    return _ROLE_OF.get(param, "-")
