"""``make_optimizer(model, preset=...)``: ``DistributedShampoo`` over the groups of the module
rules (``model_rules.py``), the package's entry point; it needs only torch.

Two choices are made here for the whole model: ``defaults`` (``"adamw"``: AdamW's learning
rate, ``ADAMW_DEFAULTS`` over the class's; ``"meta"``: the class's, Meta's) and ``memory``
(``MEMORY``: ``"full"`` d × d factors, or ``"sketch"``, where ``sketch_groups`` turns every
Shampoo group into ``preconditioner="sketchy"``; docs/sketchy.md). The Trainer integration
checks and converts with the same functions (``check_memory``, ``sketch_groups``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from .config import ADAMW_STYLE, DEFAULTS, adamw_style_refresh_delay, did_you_mean
from .model_rules import PRESETS, Preset, param_groups
from .optimizer import DistributedShampoo, ShampooKeywords
from .preconditioners import KINDS

if TYPE_CHECKING:
    from typing_extensions import Unpack

# What make_optimizer(defaults="adamw") sets over the class's (Meta's) defaults, so that
# AdamW's learning rate works (docs/hyperparameters.md; benchmarks/digits_defaults.py), and
# so that no step waits for a refresh: the staggered schedule spreads the refreshes over
# the precondition_frequency window, and each is computed beside the next step and used
# one step later (refresh_delay, except where a delay is refused: delayed_groups;
# docs/performance.md)
ADAMW_DEFAULTS: dict[str, Any] = {key: ADAMW_STYLE[key] for key in
                                  ("grafting", "betas", "refresh_schedule", "refresh_delay")}


def delayed_groups(groups: list[dict[str, Any]], defaults: Mapping[str, Any]
                   ) -> list[dict[str, Any]]:
    """``groups`` with ``refresh_delay=0`` set in those whose own settings refuse the
    default delay (``adamw_style_refresh_delay``: 4-bit state, ``apply_precision="tf32"``)
    and name no ``refresh_delay`` themselves; ``defaults``: the optimizer's keywords."""
    if not defaults.get("refresh_delay"):
        return groups
    return [group if "refresh_delay" in group
            or adamw_style_refresh_delay({**defaults, **group}) else
            {**group, "refresh_delay": 0} for group in groups]


# make_optimizer(memory=...): how the large Kronecker factors of the whole model are stored
MEMORY = ("full", "sketch")


def check_memory(memory: Any, where: str = "make_optimizer memory") -> None:
    """Raise ``ValueError`` for a ``memory`` value that is not one of ``MEMORY``."""
    if memory not in MEMORY:
        raise ValueError(f"hf_shampoo: {where}={memory!r}; expected 'full' (d × d factors, "
                         f"the default) or 'sketch' (Shampoo's large factors as rank-k "
                         f"Frequent-Directions sketches: preconditioner='sketchy')"
                         f"{did_you_mean(str(memory), MEMORY)}")


def sketch_statistics_frequency(memory: str, keywords: dict[str, Any]) -> int | None:
    """With ``memory="sketch"`` (and no 4-bit state), ``statistics_frequency`` says how often
    the sketches take the gradient: taken out of ``keywords`` for the sketched groups alone
    (``sketch_groups``), which the other kinds would refuse."""
    if memory != "sketch" or keywords.get("quantization") is not None:
        return None
    return keywords.pop("statistics_frequency", None)


def sketch_groups(groups: list[dict[str, Any]], defaults: Mapping[str, Any],
                  statistics_frequency: int | None = None) -> list[dict[str, Any]]:
    """``memory="sketch"``: the groups of ``param_groups`` (over the optimizer-level
    ``defaults``) with every Shampoo group turned into ``preconditioner="sketchy"``
    (docs/sketchy.md).

    A Shampoo group whose long side is already diagonal keeps Shampoo, since its factors are
    a small full one and a diagonal, less than a sketch: ``diagonal_aspect`` set by the
    presets' rule (LoRA adapters, matrices whose long side is at least ``ADAPTER_ASPECT``
    times the short one) or by an override; ``diagonal_aspect`` for the whole model is
    refused, as it would leave nothing sketched. The kinds without Kronecker factors
    (``diagonal``, ``spectral_descent``, ``sign_descent``, ``riemannian_lora``) keep theirs.
    The other Kronecker-factored kinds (``eigenvalue_corrected``, ``kl_shampoo``, the
    eigendecomposed ones) have no sketched form: refused with a ``ValueError``. With
    ``quantization="4bit"`` the sketches' bases are kept in 4 bits (and the groups left
    unsketched keep 4-bit factors). ``statistics_frequency`` (how often the sketches take
    the gradient) goes to the sketched groups alone."""
    # the kinds with a sketched form, and that form (the kinds say: ``Sketchy.sketches``)
    sketched = {kind.sketches: name for name, kind in KINDS.items() if kind.sketches}
    base = {**DEFAULTS, **defaults}
    if base.get("diagonal_aspect") is not None:  # every group would keep Shampoo: say so
        raise ValueError(
            f"hf_shampoo: make_optimizer memory='sketch' with diagonal_aspect="
            f"{base['diagonal_aspect']!r} for the whole model: a group whose long side is kept "
            "diagonal keeps Shampoo, so nothing would be sketched; leave diagonal_aspect to "
            "the presets' rule (LoRA adapters) or set it per pattern in overrides")
    out = []
    for group in groups:
        effective = {**base, **group}
        kind = effective["preconditioner"]
        params = list(group.get("params", []))
        names = [p[0] for p in params[:3] if isinstance(p, tuple)]
        where = f" (for {', '.join(names)}{', ...' if len(params) > 3 else ''})" if names else ""
        if kind in sketched and effective.get("diagonal_aspect") is None:
            group = {**group, "preconditioner": sketched[kind]}
            if statistics_frequency is not None:
                group["statistics_frequency"] = statistics_frequency
        elif kind not in sketched and KINDS[kind].statistics and not KINDS[kind].sketches:
            forms = ", ".join(f"{k!r} → {v!r}" for k, v in sketched.items())
            raise ValueError(
                f"hf_shampoo: make_optimizer memory='sketch' with preconditioner={kind!r}"
                f"{where}: this kind's factors have no sketched form (those that have: "
                f"{forms}); use memory='full' for it")
        out.append(group)
    return out


def make_optimizer(
    model: nn.Module,
    preset: str | Preset = "transformer",
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    decay_parameter_names: Iterable[str] | None = None,
    vocab_size: int | None = None,
    defaults: str = "adamw",
    memory: str = "full",
    **shampoo_kwargs: Unpack[ShampooKeywords],
) -> DistributedShampoo:
    """``DistributedShampoo`` over ``param_groups(model, ...)``; keywords as in docs/design.md §7
    (typed by ``ShampooKeywords``, generated from the keyword table: type checkers and IDEs
    know each one's type, and flag a keyword no option has).

    ``weight_decay`` among them applies to the decayed parameters only. ``defaults="adamw"``
    (the default) takes AdamW's learning rate: Adam grafting (``grafting="adam"``) and
    AdamW's betas ``(0.9, 0.999)`` unless given, as the Trainer does, staggered
    refreshes (``refresh_schedule="staggered"``: no step refreshes every block at once)
    computed beside the next step and used one step later (``refresh_delay=1``; 0 for
    groups with 4-bit state or ``apply_precision="tf32"``, where a delay is refused)
    (``ADAMW_DEFAULTS``; presets of spectral descent, ``"muon"``, set their own grafting
    and keep the class's defaults); ``defaults="meta"`` keeps the class's, which are Meta's
    (no grafting, ``betas=(0.9, 1.0)``, every block refreshed on the same steps), whose
    learning rate lives on another scale.

    Parameters frozen now (``requires_grad=False``) are left out, as the Trainer leaves
    them out; to train one later (progressive unfreezing), unfreeze it and add it, as torch
    documents: ``optimizer.add_param_group({"params": layer.parameters()})`` (plain tensors
    are accepted beside the named groups and keep their model names;
    docs/accelerate.md#unfreezing-layers-later).

    ``memory`` chooses how the large factors of the whole model are stored: ``"full"`` (the
    default) keeps ``d × d`` factors; ``"sketch"`` turns every Shampoo group into
    ``preconditioner="sketchy"`` (rank-``k`` Frequent-Directions sketches of the dims larger
    than ``sketch_threshold``; ``sketch_rank`` / ``sketch_threshold`` /
    ``sketch_relative_epsilon`` pass through as keywords; docs/sketchy.md). Groups of other
    kinds keep theirs (Adam / ``diagonal``, spectral descent, ``riemannian_lora``), and so
    do LoRA adapters and adapter-like matrices, whose long side the presets keep diagonal
    (``diagonal_aspect``: less than a sketch); ``eigenvalue_corrected``,
    the KL and eigendecomposed kinds and ``quantization="4bit"`` are refused
    (``sketch_groups``).
    """
    check_memory(memory)
    if defaults not in ("adamw", "meta"):
        raise ValueError(f"hf_shampoo: make_optimizer defaults={defaults!r}; expected 'adamw' "
                         f"(AdamW's learning rate) or 'meta' (Meta's defaults)"
                         f"{did_you_mean(defaults, ('adamw', 'meta'))}")
    chosen = PRESETS[preset] if isinstance(preset, str) and preset in PRESETS else preset
    keywords: dict[str, Any] = dict(shampoo_kwargs)  # a plain dict from here
    default_delay = False
    if defaults == "adamw" and not getattr(chosen, "spectral_roles", None):
        default_delay = "refresh_delay" not in keywords
        keywords = {**ADAMW_DEFAULTS, **keywords}
        if default_delay:
            keywords["refresh_delay"] = adamw_style_refresh_delay(keywords)
    weight_decay = keywords.pop("weight_decay", 0.0)
    groups = param_groups(
        model,
        preset,
        overrides,
        weight_decay=weight_decay,
        decay_parameter_names=decay_parameter_names,
        defaults=keywords,
        vocab_size=vocab_size,
    )
    if default_delay:
        groups = delayed_groups(groups, keywords)
    if memory == "sketch":
        every = sketch_statistics_frequency(memory, keywords)
        groups = sketch_groups(groups, keywords, every)
        try:
            optimizer = DistributedShampoo(groups, weight_decay=weight_decay, **keywords)
        except ValueError as error:  # a keyword sketchy refuses, which the user did not name
            raise ValueError(f"{error} (make_optimizer memory='sketch' makes the Shampoo "
                             "groups preconditioner='sketchy')") from None
    else:
        optimizer = DistributedShampoo(groups, weight_decay=weight_decay, **keywords)
    # the names of every parameter, frozen ones too (left out of the groups): a layer
    # unfrozen later and added by add_param_group keeps its name (progressive unfreezing)
    optimizer._known_names = {id(p): name for name, p in
                              model.named_parameters()}
    return optimizer
