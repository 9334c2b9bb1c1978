"""timm adapter: the names ``"shampoo"``, ``"soap"``, ``"klshampoo"`` in timm's registry.

After ``register()`` (which ``import hf_shampoo`` arranges), ``timm.optim.create_optimizer_v2(
model, opt="shampoo")`` and timm's ``train.py --device-modules hf_shampoo --opt shampoo`` build
a ``TimmShampoo`` (a ``DistributedShampoo`` subclass with timm's signature; also ``TimmSoap``,
``TimmKLShampoo``) from timm's parameter groups as they are: no weight decay on biases and
norms, layer-decay ``lr_scale`` honoured, and biases / norm weights (tensors with at most one
dim larger than 1) preconditioned by the grafting method alone inside their group
(``vector_preconditioner="diagonal"``).
Defaults are the AdamW migration (docs/hyperparameters.md); docs/timm.md is the user guide.
timm itself is imported only when needed.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import inspect
import warnings
from collections.abc import Iterable
from typing import Any

from torch import Tensor

from ..config import ADAMW_STYLE, adamw_style_refresh_delay
from ..optimizer import DistributedShampoo
from ..optional import require
from ..preconditioners import KINDS
from .after_import import on_import

# timm keeps only the part of `opt` after its last underscore ("lookahead_shampoo" is
# Lookahead around "shampoo"), so these names must not contain one.
TIMM_OPTIMIZER_NAMES = ("shampoo", "soap", "klshampoo")
# The registry (OptimInfo, default_registry) arrived in timm 1.0.12.
MIN_TIMM_VERSION = "1.0.12"
_FACTORY_MODULE = "timm.optim._optim_factory"

# AdamW's defaults in torch and timm; the migration keeps them (docs/hyperparameters.md,
# "Migrating from AdamW").
ADAMW_LR = ADAMW_STYLE["lr"]
ADAMW_BETAS = ADAMW_STYLE["betas"]
ADAMW_EPS = ADAMW_STYLE["grafting_epsilon"]


# ---------------------------------------------------------------------- classes
class _TimmOptimizer(DistributedShampoo):
    """timm's signature (``lr``, ``weight_decay``, ``betas``, ``eps``, ``foreach``) over
    ``DistributedShampoo``; each name's class sets its defaults in ``_defaults``."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | None = ADAMW_LR,
        weight_decay: float = 0.0,
        betas: Iterable[float] = ADAMW_BETAS,
        eps: float | None = None,
        foreach: bool | None = None,
        *,
        diagonal_1d: bool = True,
        apply_lr_scale: bool = True,
        **kwargs: Any,
    ) -> None:
        del foreach  # the stacked implementation is always multi-tensor
        betas = tuple(betas)
        self._defaults(betas, eps, kwargs)
        groups, config = _timm_arguments(params, lr, weight_decay, betas, diagonal_1d,
                                         apply_lr_scale, kwargs)
        super().__init__(groups, **config)

    @staticmethod
    def _defaults(betas: tuple, eps: float | None, kwargs: dict[str, Any]) -> None:
        raise NotImplementedError

    @staticmethod
    def _adamw_defaults(betas: tuple, eps: float, kwargs: dict[str, Any]) -> None:
        """What every name sets alike (``config.ADAMW_STYLE``): the grafting method's
        second moment with AdamW's ``betas[1]`` and ``eps``, decoupled weight decay,
        staggered refreshes, each computed beside the next step and used one step later
        (``refresh_delay=1``; 0 with 4-bit state or ``apply_precision="tf32"``)."""
        kwargs.setdefault("grafting_beta2", betas[1])
        kwargs.setdefault("grafting_epsilon", eps)
        for key in ("weight_decay_type", "refresh_schedule"):
            kwargs.setdefault(key, ADAMW_STYLE[key])
        kwargs.setdefault("refresh_delay", adamw_style_refresh_delay(kwargs))


class TimmShampoo(_TimmOptimizer):
    """timm's ``opt="shampoo"``: Adam-grafted Shampoo, AdamW's hyperparameters.

    ``lr``, ``betas`` and ``weight_decay`` keep their AdamW meaning (decoupled decay);
    ``eps`` (timm's ``--opt-eps``) is Adam's epsilon, i.e. ``grafting_epsilon``. The roots
    of rank-deficient factors are pseudo-inverses at the rounding floor
    (``rank_deficient="pseudo_inverse"``, ``epsilon=0``, ``rank_rtol=None``): float32 and
    float64 copies then move in the same direction, which Meta's ε = 1e-12 perturbation
    does not guarantee while factors are rank-deficient (timm's own test of that fails
    with it); an explicit ``epsilon > 0`` selects the perturbation (Meta's default).
    Refreshes are staggered (``refresh_schedule="staggered"``: each block on its own step of
    the ``precondition_frequency`` window, so no step waits for all of them; ``"all"`` is
    Meta's) and computed beside the next step, used one step later (``refresh_delay=1``;
    Meta's is 0). ``foreach`` is accepted and ignored. Any other
    ``DistributedShampoo`` keyword (``precondition_frequency=...``) passes through, and wins
    over these defaults. See ``timm_param_groups`` for ``diagonal_1d`` / ``apply_lr_scale``.
    A ``DistributedShampoo`` subclass, so timm's registry holds a real optimizer class.
    """

    @staticmethod
    def _defaults(betas: tuple, eps: float | None, kwargs: dict[str, Any]) -> None:
        mode = kwargs.setdefault(
            "rank_deficient", "perturbation" if kwargs.get("epsilon") else "pseudo_inverse")
        if mode == "pseudo_inverse":
            kwargs.setdefault("epsilon", 0.0)
            kwargs.setdefault("rank_rtol", None)
        else:
            kwargs.setdefault("epsilon", 1e-12)
        kwargs.setdefault("grafting", ADAMW_STYLE["grafting"])
        _TimmOptimizer._adamw_defaults(betas, ADAMW_EPS if eps is None else eps, kwargs)


class TimmSoap(_TimmOptimizer):
    """timm's ``opt="soap"``: eigenvalue-corrected Shampoo (SOAP, docs/design.md §3),
    treated like Adam.

    ``eps`` is the epsilon of the corrected second moment (``epsilon``, default 1e-8); no
    grafting for preconditioned tensors. The vector-like tensors (biases, norms) take plain
    Adam steps with the same ``betas[1]`` and ``eps``. Eigenbases are refreshed staggered,
    as ``"shampoo"``'s roots.
    """

    @staticmethod
    def _defaults(betas: tuple, eps: float | None, kwargs: dict[str, Any]) -> None:
        eps = ADAMW_EPS if eps is None else eps
        kwargs.setdefault("preconditioner", "eigenvalue_corrected")
        kwargs.setdefault("epsilon", eps)
        _TimmOptimizer._adamw_defaults(betas, eps, kwargs)


class TimmKLShampoo(TimmShampoo):
    """timm's ``opt="klshampoo"``: KL-Shampoo (docs/design.md §3) with ``"shampoo"``'s
    defaults and arguments (Adam grafting, AdamW's hyperparameters); ``grafting=None`` gives
    Meta's ungrafted form."""

    @staticmethod
    def _defaults(betas: tuple, eps: float | None, kwargs: dict[str, Any]) -> None:
        kwargs.setdefault("preconditioner", "kl_shampoo")
        TimmShampoo._defaults(betas, eps, kwargs)


# The factory names of earlier versions: the classes themselves.
create_shampoo, create_soap, create_kl_shampoo = TimmShampoo, TimmSoap, TimmKLShampoo


def _timm_arguments(params, lr, weight_decay, betas, diagonal_1d, apply_lr_scale, kwargs
                    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """timm's arguments as ``DistributedShampoo``'s: the param groups and the keywords."""
    valid = [name for name in inspect.signature(DistributedShampoo).parameters
             if name not in ("params", "unknown")]
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise ValueError(
            f"DistributedShampoo (timm): unknown keyword(s) {', '.join(map(repr, unknown))}; "
            f"valid keywords are {', '.join(valid)}, and timm's eps, foreach, diagonal_1d, "
            "apply_lr_scale"
        )
    lr = ADAMW_LR if lr is None else lr
    # A tensor without its own step size has none to be grafted onto: Adam for those groups.
    diagonal_grafting = kwargs.get("grafting") or "adam"
    groups = timm_param_groups(
        params,
        lr=lr,
        diagonal_1d=diagonal_1d,
        apply_lr_scale=apply_lr_scale,
        diagonal_grafting=diagonal_grafting,
    )
    return groups, dict(lr=lr, betas=betas, weight_decay=weight_decay, **kwargs)


# ---------------------------------------------------------------------- parameter groups
def timm_param_groups(
    params: Iterable[Any],
    *,
    lr: float = ADAMW_LR,
    diagonal_1d: bool = True,
    apply_lr_scale: bool = True,
    diagonal_grafting: str = "adam",
) -> list[dict[str, Any]]:
    """timm's parameter groups, made ready for ``DistributedShampoo``.

    - ``diagonal_1d``: every group gets ``vector_preconditioner="diagonal"``: its
      vector-like tensors (``is_vector_like``: biases, norm weights) are preconditioned by
      the grafting method alone (Adam where the group has no grafting), inside the group,
      so that the group's ``lr`` still governs all of them: a full-matrix factor for a bias
      buys little and costs ``d²`` memory and ``d³`` work. A group that already names a
      ``preconditioner`` or a ``vector_preconditioner`` keeps it.
    - ``use_fallback`` groups (timm's ``fallback_list``, e.g. Muon's AdamW fallback) become
      diagonal groups; the key itself is dropped.
    - ``apply_lr_scale``: a group with timm's layer-decay ``lr_scale`` gets
      ``lr = base_lr * lr_scale`` now and ``initial_lr = base_lr``. timm's schedulers read
      ``initial_lr`` as the base and multiply by ``lr_scale`` themselves, so the scale is
      applied exactly once with a timm scheduler and also without any scheduler. (torch's
      schedulers also read ``initial_lr`` and know no ``lr_scale``: with them the scale is
      lost, as it is for timm's own optimizers.)
    """
    out = []
    for group in _as_groups(params):
        group = dict(group)
        if group.pop("use_fallback", False):
            group.setdefault("preconditioner", "diagonal")
        if apply_lr_scale and "lr_scale" in group and "initial_lr" not in group:
            base = group.get("lr", lr)
            group["initial_lr"] = base
            group["lr"] = base * group["lr_scale"]
        kind = KINDS.get(group.get("preconditioner"))  # type: ignore[arg-type]
        if kind is not None and kind.needs_grafting:  # "diagonal": grafting is its direction
            group.setdefault("grafting", diagonal_grafting)
        params = group["params"]
        group["params"] = [params] if isinstance(params, Tensor) else list(params)
        if diagonal_1d and "preconditioner" not in group:
            group.setdefault("vector_preconditioner", "diagonal")
        out.append(group)
    return out


def _as_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    if isinstance(params, Tensor):
        return [{"params": [params]}]
    params = list(params)
    if params and isinstance(params[0], dict):
        return params
    return [{"params": params}]


# ---------------------------------------------------------------------- registration
def _optim_infos(optim_info: type) -> list:
    common = {"has_eps": True, "has_betas": True, "has_momentum": False}
    return [
        optim_info(
            name="shampoo",
            opt_class=TimmShampoo,
            description="hf_shampoo DistributedShampoo, Adam grafting, decoupled weight decay",
            **common,
        ),
        optim_info(
            name="soap",
            opt_class=TimmSoap,
            description="hf_shampoo eigenvalue-corrected Shampoo (SOAP), decoupled weight decay",
            **common,
        ),
        optim_info(
            name="klshampoo",
            opt_class=TimmKLShampoo,
            description="hf_shampoo KL-Shampoo, Adam grafting, decoupled weight decay",
            **common,
        ),
    ]


def _is_ours(info: Any) -> bool:
    return getattr(info.opt_class, "__module__", None) == __name__


def register(registry: Any = None, force: bool = False) -> bool:
    """Add ``"shampoo"``, ``"soap"`` and ``"klshampoo"`` to timm's registry (idempotent).

    ``registry`` defaults to timm's ``default_registry``. A name that timm (or someone else)
    already uses for another optimizer is left alone with a warning unless ``force``.
    Returns False, with no effect, when timm is older than 1.0.12 (no registry); raises
    ``ImportError`` naming the extra (``pip install 'hf_shampoo[timm]'``) when timm is not
    installed.
    """
    require("timm", "hf_shampoo.integrations.timm.register (opt='shampoo' in timm)")
    try:
        factory = importlib.import_module(_FACTORY_MODULE)
    except ImportError:
        return False
    optim_info = getattr(factory, "OptimInfo", None)
    registry = registry if registry is not None else getattr(factory, "default_registry", None)
    if optim_info is None or registry is None:
        warnings.warn(
            f"hf_shampoo: timm's optimizer registry needs timm >= {MIN_TIMM_VERSION}; "
            "'shampoo' is not registered (build hf_shampoo.DistributedShampoo directly)",
            stacklevel=2,
        )
        return False
    for info in _optim_infos(optim_info):
        try:
            existing = registry.get_optimizer_info(info.name)
        except ValueError:
            existing = None
        if existing is not None and _is_ours(existing) and not force:
            continue
        if existing is not None and not force:
            warnings.warn(
                f"hf_shampoo: timm already has an optimizer named {info.name!r} "
                f"({existing.opt_class}); leaving it (register(force=True) replaces it)",
                stacklevel=2,
            )
            continue
        registry.register(info)
    return True


def register_on_import() -> None:
    """Register with timm now if timm's optimizer factory is loaded, else right after it is.

    This keeps ``import hf_shampoo`` from importing timm (about 1.5 s) while still making
    ``opt="shampoo"`` work whichever of the two is imported first.
    """
    on_import("timm", (_FACTORY_MODULE,), lambda fullname, module: register())
