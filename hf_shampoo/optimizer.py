"""``DistributedShampoo``: the public optimizer class.

The class validates hyperparameters and param groups, lays parameters out as blocks and
stacks owned by ranks on first use (``layout.py`` builds them), keeps torch's optimizer
API (``step``, ``state_dict`` / ``load_state_dict`` in ``checkpoint/``'s layout) and
runs a step as the named stages of ``step.py``, so that nothing is half-done.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ParamSpec, TypedDict, overload

import torch
import torch.distributed as dist
from torch import Tensor

from . import averaging, health, step
from .blocking import expert_shape, is_vector_like
from .checkpoint import state_dict as saving
from .checkpoint.consolidate import ranks_accelerate_saves_on
from .config import (
    DEFAULTS,
    GLOBAL_KEYS,
    refuse_unknown_keywords,
    validate_group,
)
from .delayed_refresh import Refresher, is_pending
from .distributors import Distributor, make_distributor
from .distributors.collectives import collective_device
from .distributors.groups import group_over, ranks_of
from .distributors.zero import (
    ZeroPartitions,
    find_zero_partitions,
    refuse_deepspeed_fp16_stage0,
)
from .layout import LayoutBuilder, trainable
from .preconditioners import kind_of
from .stack import BlockStack, Workspace
from .state_view import StateView
from .step import Layout

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

P = ParamSpec("P")


def _refusing_unknown_keywords(init: Callable[P, None]) -> Callable[P, None]:
    """``init``, raising the package's ``TypeError`` (the closest valid names, and every
    valid keyword) for a keyword it does not take, where Python's own would name none. The
    signature stays ``init``'s (``functools.wraps``; ``ParamSpec`` for type checkers), so
    that type checkers flag an unknown keyword too."""
    known = set(inspect.signature(init).parameters)

    @functools.wraps(init)
    def checked(*args: P.args, **kwargs: P.kwargs) -> None:
        unknown = {key: value for key, value in kwargs.items() if key not in known}
        if unknown:
            refuse_unknown_keywords(unknown, "DistributedShampoo()")
        init(*args, **kwargs)

    return checked


class ShampooKeywords(TypedDict, total=False):
    """Every keyword of ``DistributedShampoo`` but ``params``, with its type: what
    ``make_optimizer``'s ``**keywords`` are typed with (``Unpack[ShampooKeywords]``), so
    that type checkers and IDEs know them there too. Generated from the keyword table."""

    # <fields: generated from config.TABLE by python -m hf_shampoo.config>
    lr: float | torch.Tensor
    betas: tuple[float, float]
    beta3: float | None
    epsilon: float
    momentum: float
    dampening: float
    nesterov: bool
    weight_decay: float
    weight_decay_type: str
    use_bias_correction: bool
    max_preconditioner_dim: int
    precondition_frequency: int
    start_preconditioning_step: int | None
    preconditioner: str
    grafting: str | None
    grafting_beta2: float
    grafting_epsilon: float
    factor_matrix_dtype: torch.dtype
    distributed: str
    fsdp_mode: str
    communication_dtype: torch.dtype
    num_trainers_per_group: int
    assignment_cost: str
    apply_precision: str
    stacking: str
    refresh_schedule: str
    refresh_delay: int
    iterate_averaging: str | None
    eval_interp_coeff: float
    train_interp_coeff: float
    eval_coeff_lr_power: float
    vector_preconditioner: str | None
    experts: bool
    compile: bool | dict[str, Any]
    check_finite_gradients: bool
    eigendecomposition: str
    eigenbasis_tolerance: float
    qr_max_iterations: int
    eigenbasis_variant: str
    orthogonalization: str
    quantization: str | None
    statistics_frequency: int | None
    statistics_warmup: int | None
    inverse_exponent_override: dict[int, float | dict[int, float]] | None
    inv_factor_matrix_dtype: torch.dtype | None
    diagonal_aspect: float | None
    rank_deficient: str
    rank_atol: float
    rank_rtol: float | None
    root_inverse: str
    root_max_iterations: int
    root_tolerance: float | None
    root_order: int
    root_rel_epsilon: float
    root_abs_epsilon: float | None
    spectral_orthogonalization: str
    newton_schulz_iterations: int
    newton_schulz_coefficients: tuple | str
    newton_schulz_dtype: torch.dtype | None
    spectral_lr_adjustment: str | None
    sign_scale: str | None
    sketch_rank: int
    sketch_threshold: int | None
    sketch_relative_epsilon: bool
    # </fields>
    process_group: ProcessGroup | DeviceMesh | None


class DistributedShampoo(torch.optim.Optimizer):
    """Shampoo with Kronecker-factored blocks, grafting and data-parallel distribution.

    Every keyword may also be set per parameter group. See docs/hyperparameters.md for a
    guide, docs/keywords.md for every keyword and docs/design.md for the exact
    algorithm.
    """

    @_refusing_unknown_keywords
    def __init__(
        self,
        params: Iterable[Any],
        # <parameters: generated from config.TABLE by python -m hf_shampoo.config>
        lr: float | torch.Tensor = 0.01,
        betas: tuple[float, float] = (0.9, 1.0),
        beta3: float | None = None,
        epsilon: float = 1e-12,
        momentum: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        *,
        weight_decay_type: str = "decoupled",
        use_bias_correction: bool = True,
        max_preconditioner_dim: int = 1024,
        precondition_frequency: int = 1,
        start_preconditioning_step: int | None = None,
        preconditioner: str = "shampoo",
        grafting: str | None = None,
        grafting_beta2: float = 0.999,
        grafting_epsilon: float = 1e-8,
        factor_matrix_dtype: torch.dtype = torch.float32,
        distributed: str = "auto",
        fsdp_mode: str = "lossless",
        communication_dtype: torch.dtype = torch.float32,
        num_trainers_per_group: int = -1,
        assignment_cost: str = "memory",
        apply_precision: str = "ieee",
        stacking: str = "balanced",
        refresh_schedule: str = "all",
        refresh_delay: int = 0,
        iterate_averaging: str | None = None,
        eval_interp_coeff: float = 0.9,
        train_interp_coeff: float = 0.8,
        eval_coeff_lr_power: float = 2,
        vector_preconditioner: str | None = None,
        experts: bool = False,
        compile: bool | dict[str, Any] = False,
        check_finite_gradients: bool = True,
        eigendecomposition: str = "eigh",
        eigenbasis_tolerance: float = 0.0,
        qr_max_iterations: int = 1,
        eigenbasis_variant: str = "meta",
        orthogonalization: str = "householder",
        quantization: str | None = None,
        statistics_frequency: int | None = None,
        statistics_warmup: int | None = None,
        inverse_exponent_override: dict[int, float | dict[int, float]] | None = None,
        inv_factor_matrix_dtype: torch.dtype | None = None,
        diagonal_aspect: float | None = None,
        rank_deficient: str = "perturbation",
        rank_atol: float = 0.0,
        rank_rtol: float | None = 0.0,
        root_inverse: str = "eigh",
        root_max_iterations: int = 100,
        root_tolerance: float | None = None,
        root_order: int = 3,
        root_rel_epsilon: float = 0.0,
        root_abs_epsilon: float | None = None,
        spectral_orthogonalization: str = "newton_schulz",
        newton_schulz_iterations: int = 5,
        newton_schulz_coefficients: tuple | str = (3.4445, -4.775, 2.0315),
        newton_schulz_dtype: torch.dtype | None = None,
        spectral_lr_adjustment: str | None = None,
        sign_scale: str | None = None,
        sketch_rank: int = 128,
        sketch_threshold: int | None = None,
        sketch_relative_epsilon: bool = True,
        # </parameters>
        process_group: ProcessGroup | DeviceMesh | None = None,
    ) -> None:
        """The common keywords by position or name, every other keyword of the table
        (``config.TABLE``, docs/keywords.md) by name only. ``process_group`` (not a
        hyperparameter: it is not saved with the groups) is the data-parallel group the
        blocks are spread over, a ``ProcessGroup`` or a 1-D ``DeviceMesh`` (torch's name, as
        ``ZeroRedundancyOptimizer`` and DDP take it; a pipeline stage's group:
        docs/parallelism.md#pipeline-parallel); without it, the world, or the ranks of the
        DTensor parameters' meshes. The keywords are generated from the table
        (docs/design.md §7), so that type checkers and IDEs see each one's type and default;
        an unknown keyword raises ``TypeError`` naming the closest valid ones."""
        given = locals()  # first: the arguments, by name
        defaults = {name: given[name] for name in DEFAULTS}
        for key in ("betas", "newton_schulz_coefficients"):
            if isinstance(defaults[key], list):
                defaults[key] = tuple(defaults[key])
        validate_group(defaults)
        self._layout: Layout | None = None
        self._consolidation = saving.Consolidation()
        self._workspace = Workspace()
        self._refresher = Refresher()  # refresh_delay's worker (delayed_refresh.py)
        self._health = health.StepHealth()  # the last refresh, for metrics()
        self._schedules: dict[int, tuple] = {}  # group index → (schedule, f) of its offsets
        self._distributor: Distributor | None = None
        self._chosen: Distributor | None = None  # set through the ``distributor`` property
        self._constructed: list[list[Tensor]] | None = None
        self._checked: list[list[Tensor]] = []  # the groups' lists _zero was found for
        self._process_group = process_group
        super().__init__(params, defaults)
        # DeepSpeed ZeRO 1/2 replaces the groups' parameters by flat partitions and shows
        # step() one group at a time (distributors/zero.py): what the groups held, and the
        # list of all of them, recognise that
        self._groups = self.param_groups
        self._constructed = [list(group["params"]) for group in self.param_groups]
        self._zero: ZeroPartitions | None = None
        self._in_own_view = False
        self.state = StateView(self)
        self._distributor = self._pick_distributor(final=False)

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validate the group completely, then add it (nothing changes on error).

        Progressive unfreezing as torch documents it: ``add_param_group({"params":
        layer.parameters(), ...})`` with bare tensors also where the other groups are named
        (``make_optimizer``'s are), which torch's own rule refuses. The tensors are named
        after the model's parameters where the optimizer knows them (``make_optimizer``
        remembers every name of its model, frozen ones too), else ``param_groups[g][k]``."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        if (self.param_groups and "param_names" in self.param_groups[0]
                and "param_names" not in group
                and not any(isinstance(p, tuple) for p in params)):
            known = getattr(self, "_known_names", {})
            index = len(self.param_groups)
            params = [(known.get(id(p)) or f"param_groups[{index}][{k}]", p)
                      for k, p in enumerate(params)]
        group["params"] = params
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
        merged = {**self.defaults, **{k: v for k, v in group.items() if k != "params"}}
        if isinstance(merged["betas"], list):
            merged["betas"] = group["betas"] = tuple(merged["betas"])
        validate_group(merged)
        for key in GLOBAL_KEYS:
            if merged[key] != self.defaults[key]:
                raise ValueError(
                    f"DistributedShampoo: {key}={merged[key]!r} differs from the optimizer's "
                    f"{self.defaults[key]!r}; {key} applies to the whole optimizer and cannot "
                    "be set per parameter group"
                )
        if merged["weight_decay"] > 0 and merged["weight_decay_type"] in (
            "corrected",
            "independent",
        ):
            peak = merged.get("peak_lr", merged["lr"])
            if not float(peak) > 0:
                raise ValueError(
                    f"DistributedShampoo: weight_decay_type={merged['weight_decay_type']!r} "
                    f"divides by the peak learning rate, so lr must be > 0 (got {peak!r})"
                )
        for index, tensor in enumerate(tensors):
            if not isinstance(tensor, Tensor):
                continue  # torch's add_param_group reports this
            if tensor.is_complex():
                raise ValueError(
                    f"DistributedShampoo does not support complex parameters (parameter "
                    f"{index} has dtype {tensor.dtype}); optimize torch.view_as_real(p) instead"
                )
            if not tensor.is_floating_point():
                raise ValueError(
                    f"DistributedShampoo: parameter {index} has dtype {tensor.dtype}; "
                    "only floating-point parameters can be optimized"
                )
            names = group.get("param_names")
            name = params[index][0] if isinstance(params[index], tuple) else \
                names[index] if names else f"parameter {index} of the group"
            if merged["experts"] and tensor.dim() == 0:
                raise ValueError(
                    f"DistributedShampoo: invalid experts=True for {name!r}, a 0-d tensor; "
                    "expected a parameter whose dim 0 indexes experts, e.g. (E, out, in)"
                )
            unit = expert_shape(tensor.shape, merged["experts"])
            if kind_of(merged).matrix_blocks and len(unit) < 2 and not (
                    merged["vector_preconditioner"] and is_vector_like(unit)):
                each = " per expert (experts=True)" if merged["experts"] else ""
                raise ValueError(
                    f"DistributedShampoo: preconditioner={merged['preconditioner']!r} "
                    f"orthogonalizes matrices, but {name!r} has shape {tuple(tensor.shape)} "
                    f"(fewer than 2 dims{each}); give vectors and scalars another kind, e.g. "
                    "'diagonal' with grafting='adam', or build the optimizer with "
                    "hf_shampoo.make_optimizer(model, preset='muon'), which does that"
                )
        group.setdefault("peak_lr", float(merged["lr"]))
        group.setdefault("step", 0)
        if merged["iterate_averaging"] is not None:  # saved with the groups (averaging.py)
            group.setdefault("train_mode", True)
            group.setdefault("lr_sum", 0.0)
        super().add_param_group(group)
        if self._constructed is not None:
            self._constructed.append(list(self.param_groups[-1]["params"]))
        if self._layout is not None:
            try:
                self._layout = None if not any(s.state for s in self._layout.owned) else \
                    self._layout_builder().extend(self._layout, trainable(self._all_params()))
            except BaseException:  # e.g. ranks that added different groups: none added
                self.param_groups.pop()
                if self._constructed is not None:
                    self._constructed.pop()
                raise

    # ------------------------------------------------------------------ layout
    def _all_params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _deepspeed_zero(self) -> ZeroPartitions | None:
        """DeepSpeed ZeRO 1/2's view of this optimizer, when it has one (see ``__init__``):
        looked for again only when a group's parameter list is another list than when it
        was last looked for (DeepSpeed, Accelerate and FSDP2 replace the lists)."""
        if self._in_own_view or self._constructed is None:
            return self._zero
        lists = [group["params"] for group in self._groups]
        if len(lists) != len(self._checked) or any(
                a is not b for a, b in zip(lists, self._checked)):
            self._zero = find_zero_partitions(self._groups, self._constructed)
            self._checked = lists
        return self._zero

    @contextmanager
    def _own_view(self) -> Iterator[ZeroPartitions | None]:
        """Under DeepSpeed ZeRO 1/2: every group, holding its original parameters, for the
        duration (DeepSpeed's flat partitions and its one-group view restored after)."""
        zero = self._deepspeed_zero()
        if zero is None or self._in_own_view:
            yield zero
            return
        shown, flats = self.param_groups, [group["params"] for group in zero.groups]
        self.param_groups = zero.groups
        for group, originals in zip(zero.groups, zero.originals):
            group["params"] = originals
        self._in_own_view = True
        try:
            yield zero
        finally:
            self._in_own_view = False
            for group, params in zip(zero.groups, flats):
                group["params"] = params
            self.param_groups = shown

    def _pick_distributor(self, final: bool = True) -> Distributor:
        if self._in_own_view and self._zero is not None:
            if self._process_group is not None and \
                    sorted(ranks_of(self._process_group)) != list(range(dist.get_world_size())):
                raise ValueError(
                    "DistributedShampoo: process_group is not supported under DeepSpeed ZeRO "
                    "(its partitions span DeepSpeed's own data-parallel group, which must be "
                    "the world here: docs/deepspeed.md); leave process_group out, or use "
                    "FSDP2 / DDP stages for pipeline parallelism")
            return self._zero.distributor
        if self._chosen is not None:
            return self._chosen
        d = self.defaults
        params = self._all_params()
        return make_distributor(
            d["distributed"], params, d["num_trainers_per_group"],
            d["communication_dtype"], d["assignment_cost"], d["fsdp_mode"],
            current=self._distributor, final=final, process_group=self._process_group,
            names=self._param_names(),
        )

    def _param_names(self) -> list[str]:
        """``param_name`` of every parameter, in ``param_index`` order (for errors)."""
        return [self._name_in(gi, k, p) for gi, k, p in self._param_refs()]

    def _param_refs(self) -> list[tuple[int, int, Tensor]]:
        """``(group index, position in the group, parameter)`` of every parameter, in the
        order of its ``param_index`` (torch's numbering over all groups)."""
        return [(gi, k, p) for gi, group in enumerate(self.param_groups)
                for k, p in enumerate(group["params"])]

    def param_name(self, index: int) -> str:
        """The name of parameter ``param_index`` in errors and ``describe()``: its name in
        the group's ``param_names``, else its group, position and shape."""
        return self._name_in(*self._param_refs()[index])

    def _name_in(self, gi: int, k: int, param: Tensor) -> str:
        """``param_name`` of the ``k``-th parameter of group ``gi``."""
        names = self.param_groups[gi].get("param_names")
        return names[k] if names else f"group {gi} param {k} (shape {tuple(param.shape)})"

    def _layout_builder(self) -> LayoutBuilder:
        """What lays the parameters out (``layout.py``), reading the groups, the
        distributor and the parameters as they are now."""
        return LayoutBuilder(self.param_groups, self._distributor,
                             self.defaults["assignment_cost"], self._param_refs(),
                             self._param_names(), self._schedules)

    def _agree(self, layout: Layout) -> None:
        """Before a layout's first collective (a step, ``train()`` / ``eval()``): its plan
        checked across the ranks, once per layout (nothing per step after)."""
        if not layout.plan.agreed:
            layout.plan = self._layout_builder().agreed(layout.plan)

    def _ensure_layout(self, also: Iterable[int] = ()) -> Layout:
        """The layout of every trainable parameter (``layout.trainable``) and of ``also`` (a
        checkpoint's parameters), built on first use and extended when one is added."""
        params = [id(p) for p in self._all_params()]
        carried = None
        rebuild = self._layout is None
        if self._layout is not None and self._layout.params != params:
            # Accelerate's FSDP2 prepare swaps in the sharded parameters after construction
            # (having called state_dict() / load_state_dict() on the unsharded ones). State
            # that training or a load put there moves to the new layout by block identity.
            rebuild = True
            if any(group["step"] > 0 for group in self.param_groups):
                carried = saving.pack_state(self.param_groups, self._layout.owned,
                                            self._distributor, self._layout.blockings)
                also = {*also, *self._layout.blockings}
        wanted = sorted({*trainable(self._all_params()), *also})
        if rebuild:  # the old layout and distributor stay until the new one is complete
            previous = self._distributor
            self._distributor = self._pick_distributor()
            try:
                layout = self._layout_builder().build(wanted)
            except BaseException:
                self._distributor = previous
                raise
            self._layout = layout
            if carried is not None:
                saving.unpack_state(carried, self.param_groups, self._layout.owned,
                                    self._distributor, self._layout.blockings)
        elif not set(wanted) <= self._layout.blockings.keys():
            self._layout_builder().extend(self._layout, wanted)
        return self._layout

    # ------------------------------------------------------------------ step
    @overload  # as torch.optim.Optimizer.step: None without a closure, its loss with one
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One optimizer step (docs/design.md §2); returns the closure's loss if one is given.

        Under DeepSpeed ZeRO 1/2, which calls it once per group, the step is taken at the
        last group's call, for every group (distributors/zero.py).
        """
        zero = self._deepspeed_zero()
        if zero is None:
            if closure is None and self._initialising_under_deepspeed():
                return None
            return self._step(closure)
        ready, index = zero.collect(self.param_groups)
        if not ready:
            return None
        with self._own_view():
            loss = self._step(closure)
        if index is not None:  # DeepSpeed copied the earlier groups before they stepped
            zero.write_model_copies(index)
        return loss

    def _initialising_under_deepspeed(self) -> bool:
        """DeepSpeed's bf16 wrapper without ZeRO (``FP16_UnfusedOptimizer``) calls ``step()``
        once with zero gradients while it is built, on fp32 copies of the parameters, to
        make the state exist: a step of nothing that would count as the first (bias
        correction, weight decay). It is recognised (no step taken yet, parameters that
        are not those the optimizer was built with, every gradient exactly zero) and
        skipped. The same wrapper over float16 parameters (fp16 under ZeRO stage 0) is
        refused there, inside ``deepspeed.initialize`` on every rank, before anything
        changes (``refuse_deepspeed_fp16_stage0``)."""
        if self._constructed is None or any(group["step"] for group in self.param_groups):
            return False
        built = {id(p) for params in self._constructed for p in params}
        params = self._all_params()
        if not params or any(id(p) in built for p in params):
            return False
        grads = [p.grad for p in params]
        if not all(g is not None for g in grads) or any(bool(g.any()) for g in grads):
            return False
        refuse_deepspeed_fp16_stage0(self._constructed)
        return True

    def _step(self, closure=None):
        """The step itself (``step``'s stages).

        The stages, each a function of ``step.py``, run so that nothing is half-done:
        refuse non-finite gradients (``check_finite_gradients``); gather the owned stacks'
        gradients and plan each block's step; check the refreshed
        factors before any state or parameter changes; compute every owned block's
        direction ``-lr * P``; the distributor shares the directions and applies them.
        """
        averaging.refuse_eval_mode(self.param_groups)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        layout = self._ensure_layout()
        self._agree(layout)  # once per layout: ranks that hold other parameters raise here
        self._consolidation.forget()
        distributor, groups = self._distributor, self.param_groups
        if distributor.needs_reallocation(layout.stacks):
            distributor.allocate_directions(layout.stacks)
        self._update_refresh_offsets(layout)
        steps = [group["step"] + 1 for group in groups]

        active, nonfinite = distributor.active_members(
            layout.stacks, self.defaults["check_finite_gradients"])
        step.refuse_nonfinite_gradients(nonfinite, layout, max(steps, default=0))
        step.before_step(layout, groups, distributor)  # kinds' per-step hook, every rank
        distributor.prepare_step(layout, active, self._needs_params)
        jobs = step.gather_gradients(layout, groups, steps, active, distributor,
                                     self._param_rows)
        step.check_refreshed_factors(jobs, layout, groups, steps, active, distributor)
        step.apply_delayed_refreshes(jobs, layout, groups, steps, self._refresher)
        averaged = [averaging.step_coefficients(group) for group in groups]
        for stack, job in jobs:
            job.averaging = averaged[stack.group_index][0]
        step.compute_directions(jobs, self._workspace, self._param_rows)
        self._health.record(jobs, max(steps, default=0))
        distributor.finish_step(layout, active)
        for group, t, (_, lr_sum) in zip(groups, steps, averaged):
            group["step"] = t
            if lr_sum is not None:
                group["lr_sum"] = lr_sum
        return loss

    # ------------------------------------------------------------------ averaging modes
    @torch.no_grad()
    def train(self) -> None:
        """Parameters to the sequence gradients are taken at (``y``), for the groups with
        ``iterate_averaging``; nothing for the others or if already there. Under DDP / FSDP
        every rank calls it (a collective, as a step). The Trainer calls it before every
        training step."""
        self._switch_mode(to_train=True)

    @torch.no_grad()
    def eval(self) -> None:
        """Parameters to the averaged sequence (``x``) for evaluation and saving, for the
        groups with ``iterate_averaging``; ``train()`` goes back (the Trainer calls this
        before evaluating). A ``step()`` in eval mode raises. Every rank calls it."""
        self._switch_mode(to_train=False)

    def _switch_mode(self, to_train: bool) -> None:
        """Move the parameters of the groups whose mode differs (``averaging.switch``), then
        record the mode."""
        groups = averaging.groups_to_switch(self.param_groups, to_train)
        layout = self._layout  # None before the first step: z = y = x, nothing moves
        if groups and layout is not None and (self._distributor.world_size > 1
                                              or any(s.state for s in layout.owned)):
            layout = self._ensure_layout()
            self._agree(layout)
            averaging.switch(layout, self._distributor, self.param_groups, groups, to_train)
            self._consolidation.forget()
        averaging.mark_mode(self.param_groups, to_train)

    def _param_rows(self, stack: BlockStack, active: list[int]) -> list[Tensor]:
        """The members' parameter blocks, one per row (views where the layout allows)."""
        return self._distributor.param_rows(stack, active)

    def _needs_params(self, stack: BlockStack) -> bool:
        """Whether the stack's owner needs the parameter blocks (weight decay)."""
        return self.param_groups[stack.group_index]["weight_decay"] > 0

    def _update_refresh_offsets(self, layout: Layout) -> None:
        """Give every block its refresh schedule offset (``step.assign_refresh_offsets``)."""
        step.assign_refresh_offsets(layout, self.param_groups, self._schedules)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state in torch's layout (docs/design.md §9).

        After ``consolidate_state_dict(to=r)``, rank ``r`` returns the state of every
        rank's blocks instead, until the next ``step()``. It never communicates, except
        when called by ``accelerator.save_state()``, which every rank calls and which writes
        what the main process's ``state_dict()`` returns: there, an optimizer whose blocks
        are spread over the ranks gathers them first (``consolidate_state_dict``; onto every
        rank with ``save_on_each_node``), so that the file holds every block. The hooks
        registered with ``register_state_dict_pre_hook`` / ``_post_hook`` run as in torch's
        ``Optimizer`` (``checkpoint/state_dict.py``).
        """
        with self._own_view():
            if not self._consolidation.gathered:
                ranks = ranks_accelerate_saves_on()
                if ranks is not False:
                    self._consolidate_state_dict(ranks)
            return saving.save(self, lambda: self._consolidation.copy()
                               or self.local_state_dict(), self._all_params())

    def _materialize_owned_state(self) -> None:
        """Every owned block's state tensors, allocated (at their initial values) where no
        step has yet."""
        with self._own_view():
            layout = self._ensure_layout()
            for stack in layout.owned:
                stack.materialize(stack.settings(self.param_groups))

    def local_state_dict(self) -> dict[str, Any]:
        """The state of the blocks this rank owns (the whole state in one process)."""
        with self._own_view():
            self._materialize_owned_state()  # every owned block has state, also before a step
            layout = self._ensure_layout()
            return saving.pack_state(self.param_groups, layout.owned, self._distributor,
                                     layout.blockings)

    def consolidate_state_dict(self, to: int | Iterable[int] | None = 0) -> None:
        """Gather every rank's blocks onto rank ``to`` (a collective: every rank of the
        optimizer's group calls it), so that ``state_dict()`` there returns the full state
        until the next ``step()``, as torch's ``ZeroRedundancyOptimizer`` does. ``to`` counts
        ranks within the group the blocks are spread over, as torch's does: the global rank
        without ``process_group``, a position in a pipeline stage's group with one. ``to``
        may also be several ranks (e.g. each node's first rank, for ``save_on_each_node``)
        or ``None`` for every rank. Tools that save on one rank only (Trainer, Accelerate)
        call this first; in one process it does nothing."""
        with self._own_view():
            return self._consolidate_state_dict(to)

    def _consolidate_state_dict(self, to: int | Iterable[int] | None = 0) -> None:
        self._consolidation.forget()
        self._ensure_layout()
        if self._distributor.is_sharded_state:
            self._consolidation.gather(self.local_state_dict(), to, self._distributor.group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by ``state_dict``: this rank takes the blocks it owns (so a
        full or consolidated state loads at any world size). Refuses a state saved for
        another model or another blocking with a ``ValueError`` before changing anything.
        The hooks registered with ``register_load_state_dict_pre_hook`` / ``_post_hook``
        run as in torch's ``Optimizer`` (``checkpoint/state_dict.py``).
        """
        with self._own_view():
            saving.load(self, state_dict, self._all_params(), self._unpack)

    def _unpack(self, state_dict: dict[str, Any], saved: set[int]) -> None:
        """Load the optimizer's own entries of ``state_dict``, whose parameters ``saved``
        get blocks too (a checkpoint's frozen parameters)."""
        layout = self._ensure_layout(also=saved)
        saving.unpack_state(state_dict, self.param_groups, layout.owned, self._distributor,
                            layout.blockings)  # with the refreshes it saved pending
        self._consolidation.forget()

    # ------------------------------------------------------------------ copies
    def __getstate__(self) -> dict[str, Any]:
        """What ``copy.deepcopy`` and ``pickle`` keep: torch's (defaults, param groups)
        plus this rank's state in the checkpoint layout, so that the copy continues
        exactly as the original would. Hooks are not kept, as in torch."""
        state = super().__getstate__()
        state.pop("_known_names", None)  # ids of this process's tensors
        # a process group is not copied: its ranks are, and the copy uses the same group
        group = self._process_group
        state["_process_group_ranks"] = None if group is None else ranks_of(group)
        layout = self._layout
        stepped = layout is not None and any(s.state for s in layout.owned)
        state["state"] = {}
        state["_saved_state"] = saving.pack_state(
            self.param_groups, layout.owned, self._distributor, layout.blockings) \
            if stepped else None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        saved = state.pop("_saved_state", None)
        ranks = state.pop("_process_group_ranks", None)
        super().__setstate__(state)
        self._process_group = None if ranks is None else group_over(ranks).process_group
        self.defaults.pop("differentiable", None)  # torch's __setstate__ adds it
        self._groups = self.param_groups
        self._constructed = [list(group["params"]) for group in self.param_groups]
        self._zero, self._in_own_view, self._checked = None, False, []
        self._layout, self._distributor, self._chosen = None, None, None
        self._consolidation = saving.Consolidation()
        self._workspace, self._schedules = Workspace(), {}
        self._refresher = Refresher()
        self._health = health.StepHealth()
        self.state = StateView(self)
        self._distributor = self._pick_distributor(final=False)
        if saved is not None:
            self.load_state_dict(saved)

    @property
    def background_refresh(self) -> bool:
        """Whether ``refresh_delay``'s refreshes run beside the steps (default) or are
        computed at once when submitted (the same numbers: for debugging and tests)."""
        return self._refresher.background

    @background_refresh.setter
    def background_refresh(self, value: bool) -> None:
        self._refresher.background = bool(value)

    def owned_state_keys(self) -> list[tuple[int, str]]:
        """``(param_index, "block_{b}.{name}")`` of every state tensor this rank holds or
        will hold (used to load sharded checkpoints)."""
        with self._own_view():
            return self._owned_state_keys()

    def _checkpoint_only_keys(self) -> dict[int, list[str]]:
        """``id(param)`` → the keys of its entry of ``optimizer.state`` (``state_view.py``)
        that only its checkpoint entry holds (``refresh_delay``'s pending results, made
        when a checkpoint is packed)."""
        keys: dict[int, list[str]] = {}
        if self._layout is None:
            return keys
        for stack in self._layout.owned:
            only = [n for n in stack.expected_state(stack.settings(self.param_groups))
                    if is_pending(n)]
            if not only:
                continue
            for block in stack.members:
                keys.setdefault(id(block.param), []).extend(
                    f"block_{block.block_index}.{n}" for n in only)
        return keys

    def _owned_state_keys(self) -> list[tuple[int, str]]:
        layout = self._ensure_layout()
        prefix = self._distributor.state_key_prefix
        keys = []
        for stack in layout.owned:
            names = stack.expected_state(stack.settings(self.param_groups))
            for block in stack.members:
                keys += [(block.param_index, f"{prefix}block_{block.block_index}.{n}")
                         for n in names]
        return keys

    # ------------------------------------------------------------------ introspection
    def metrics(self) -> dict[str, float]:
        """The preconditioner's health as a flat dict of floats named ``optimizer/...``
        (docs/metrics.md says what each means and what to do when it looks wrong): steps,
        preconditioning, the last refresh's blocks and seconds, fallbacks since the last
        call, the factors' largest and median condition numbers, the fraction of bases
        the criterion recomputed, the grafting ratio per kind, the state's bytes.

        Read from what the steps recorded (no pass over gradients or parameters). Under
        DDP / FSDP2 every rank owns other blocks: the values are reduced over the ranks
        the blocks are spread over (two small collectives), the same on every rank, so
        every rank calls it together, as a step. Reading it starts the count of
        fallbacks again from 0."""
        with self._own_view():
            layout = self._ensure_layout()
            device = None
            if dist.is_available() and dist.is_initialized():
                device = collective_device(self._all_params(), self._distributor.process_group)
            return health.collect(layout, self.param_groups, self._distributor,
                                  self._health, device)

    @property
    def distributor(self) -> Distributor:
        """The distributor that places this optimizer's blocks (``distributors/``): its
        class says how (``SingleProcessDistributor``, ``DataParallelDistributor``,
        ``ShardedDistributor``, ``LocalShardDistributor``, ``ZeroDistributor``); its
        ``rank`` and ``world_size`` are this rank's within it. Chosen from ``distributed``
        at construction and again from the parameters when the blocks are laid out (the
        first step, ``describe_blocks()``): read it after that.

        Setting it (before the first step) fixes the one the optimizer uses instead: a
        planner without a process group, e.g. ``ShardedDistributor(rank=r, world_size=w,
        boxes_of=...)`` or a subclass of ``SingleProcessDistributor`` that assigns as
        rank ``r`` of ``w`` would, lays the blocks out and computes only that rank's share,
        as ``benchmarks/`` do to measure one rank of a larger world on one process. It
        keeps a distributor it was given for good (DeepSpeed ZeRO 1/2's partitions
        aside, which bring their own)."""
        return self._distributor

    @distributor.setter
    def distributor(self, distributor: Distributor) -> None:
        if self._layout is not None and any(s.state for s in self._layout.owned):
            raise RuntimeError(
                "DistributedShampoo: the distributor can only be set before the optimizer "
                "holds state (before the first step or load)")
        self._chosen = self._distributor = distributor
        self._layout = None

    def describe_blocks(self) -> list[dict[str, Any]]:
        """One row per block, the public view of the layout (the benchmarks' too):

        - ``name``, ``param_index`` (torch's numbering over all groups), ``group`` (its
          param group's index), ``block`` (its index within the parameter), ``shape``;
        - ``merged_shape`` (the parameter's shape as blocked, docs/design.md §1) and
          ``offset`` (where the block starts in it): the block is
          ``grad.reshape(merged_shape)[offset[d]:offset[d] + shape[d], ...]``;
        - ``rank``: the rank that owns it (holds its state, computes its direction), and
          ``owned``: whether that is this rank (``distributor.rank``);
        - ``stack``: the index of its stack, the same-shape blocks of one group that a step
          computes in one batched call;
        - ``preconditioner``, ``grafting``, ``preconditioned_dims`` (dims with a Kronecker
          factor), ``refresh_offset`` (its place in the refresh schedule);
        - ``state_bytes``: the bytes of optimizer state it holds on its owner (every state
          tensor of its configuration, allocated or not yet); ``step_flops``: what its
          kind computes per step (``Preconditioner.step_flops``, the ``"compute"``
          assignment cost).

        It lays the blocks out if no step has yet; under DDP / FSDP2 every rank describes
        the same blocks (with its own ``owned``). ``optimizer.state[p]`` holds the state
        tensors of the blocks this rank owns, under ``block_{block}.{name}``."""
        with self._own_view():
            return self._describe_blocks()

    def _describe_blocks(self) -> list[dict[str, Any]]:
        layout = self._ensure_layout()
        rank = self._distributor.rank
        rows = []
        for index, s in enumerate(layout.stacks):
            settings = s.settings(self.param_groups)
            nbytes = sum(s.state_bytes(settings).values())
            flops = kind_of(settings).step_flops(s.shape, settings)
            dims = tuple(s.preconditioned_dims(settings))
            rows += [{"name": b.name, "param_index": b.param_index, "group": s.group_index,
                      "block": b.block_index, "shape": s.shape, "merged_shape": b.merged,
                      "offset": (tuple(x.start or 0 for x in b.slices) if b.slices is not None
                                 else (0,) * len(b.merged)),
                      "rank": s.rank,
                      "owned": s.rank == rank, "stack": index,
                      "refresh_offset": s.refresh_offsets[i] if s.refresh_offsets else 0,
                      "state_bytes": nbytes, "step_flops": flops,
                      "preconditioner": settings["preconditioner"],
                      "grafting": settings["grafting"], "preconditioned_dims": dims}
                     for i, b in enumerate(s.members)]
        return rows

