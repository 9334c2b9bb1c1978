"""State and per-step math of one stack of same-shape blocks (docs/design.md §2–§3).

A ``BlockStack`` holds every optimizer state tensor of ``n`` same-shape blocks of one
parameter group, stacked along a leading dim, so that factor updates, preconditioning
and eigendecompositions are single batched calls. ``direction`` runs docs/design.md §2 lines 2–8
for the stack: the group's preconditioner kind (``preconditioners/``, one module per
kind) and the shared ``update_rules``. State names (also the checkpoint keys, see
``checkpoint/layout.py``):

- ``factor_matrix_{j}``: ``F_j`` per preconditioned dim ``j``
- ``inverse_root_{j}``: ``I_j`` (shampoo)
- ``eigenvectors_{j}``: ``Q_j`` (eigenvalue-corrected; shampoo with qr or a tolerance)
- ``corrected_eigenvalues``: ``D`` (eigenvalue-corrected)
- ``grafting_state``: ``V``; ``filtered_grad``: ``M``; ``momentum``: ``B``
- ``iterate_offset``: ``D = z - y`` (iterate averaging, ``averaging.py``)

Intermediate results of a step live in a ``Workspace`` shared by all stacks, and the
stacked gradients in a buffer per stack (a copy: ``Distributor.stacked_grads``), so that a
steady step allocates next to nothing.
"""

from __future__ import annotations

import math
import time
import warnings
from collections import ChainMap
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from . import averaging, compiled, delayed_refresh, matmul_precision, update_rules
from .errors import ShampooNumericalError  # defined there; exported here as well
from .health import StackHealth
from .preconditioners import kind_of
from .preconditioners.refresh import split_first

MAX_CONSECUTIVE_FAILURES = 3


class Workspace:
    """Scratch tensors reused by every stack and every step.

    Stacks are processed one after another, so one buffer per name, grown to the largest
    request, serves them all. A tensor from ``get`` is valid until the next ``get`` of the
    same name (with the same dtype and device).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, Tensor] = {}

    def get(self, name: str, shape, dtype: torch.dtype, device: torch.device) -> Tensor:
        numel = math.prod(shape)
        key = (name, dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer[:numel].view(shape)


class StateDict(dict):
    """A stack's state, name → stacked tensor: a dict that counts, in ``StateDict.changes``
    (over every stack), each change of which tensors it holds (a tensor allocated, moved
    to another device, a load's ``clear``). ``optimizer.state`` (``state_view.py``) keeps
    its map of views until that count moves; writing into a tensor in place is no change
    of the dict."""

    changes = 0

    def __setitem__(self, key: str, value: Tensor) -> None:
        StateDict.changes += 1
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        StateDict.changes += 1
        super().__delitem__(key)

    def clear(self) -> None:
        StateDict.changes += 1
        super().clear()

    def pop(self, *args):
        StateDict.changes += 1
        return super().pop(*args)

    def popitem(self):
        StateDict.changes += 1
        return super().popitem()

    def setdefault(self, key: str, default: Tensor | None = None):
        StateDict.changes += 1
        return super().setdefault(key, default)

    def update(self, *args, **kwargs) -> None:
        StateDict.changes += 1
        super().update(*args, **kwargs)

    def __ior__(self, other):
        StateDict.changes += 1
        return super().__ior__(other)


@dataclass
class StackStep:
    """One step of one stack: the rows it works on (blocks with a gradient) and what each
    row does this step. Row lists index ``grad``; ``members`` maps rows to stack positions."""

    group: dict
    step: int
    members: list[int]
    state: dict[str, Tensor]  # the stack's state, or a copy of the rows of ``members``
    grad: Tensor  # stacked gradients with L2 decay added (docs/design.md §2 line 1), work dtype
    param: list[Tensor] | None  # per row its parameter block, when weight decay needs them
    refresh_rows: list[int] = field(default_factory=list)  # amortized computation now
    first_rows: list[int] = field(default_factory=list)  # of those: the first refresh
    grafting_rows: list[int] = field(default_factory=list)  # before their start step
    new_factors: dict[str, Tensor] | None = None  # checked factors of every row, to adopt
    offsets: list[int] = field(default_factory=list)  # per row: its refresh schedule offset
    cache: dict = field(default_factory=dict)  # the kind's values shared within this step
    # iterate averaging's (1 - μ_x μ_y, 1 - μ_x, float32 lr) this step (averaging.py)
    averaging: tuple[float, float, float] | None = None
    refresh_seconds: float = 0.0  # host seconds of the kind's refresh calls (health.py)
    # refresh_delay >= 1: where the refresh of ``refresh_rows`` goes (delayed_refresh.py)
    refresher: object | None = None

    def own_step(self, row: int) -> int:
        """The step on a row's own schedule (the step minus its refresh offset)."""
        return self.step - (self.offsets[row] if self.offsets else 0)


@dataclass
class BlockRef:
    """One block: which parameter it belongs to and where it sits in it."""

    group_index: int
    param_index: int  # position in the optimizer's flat parameter order (state_dict key)
    block_index: int  # row-major index among the parameter's blocks (docs/design.md §1)
    param: Tensor
    name: str
    merged: tuple[int, ...]  # the parameter's merged shape (docs/design.md §1)
    slices: tuple[slice, ...] | None  # the block within it; None for a single-block parameter


@dataclass
class BlockStack:
    """The optimizer state of ``n`` same-shape blocks of one parameter group."""

    group_index: int
    shape: tuple[int, ...]
    members: list[BlockRef]
    work_dtype: torch.dtype
    rank: int = 0  # the rank that owns this stack's state and computes its directions
    directions: Tensor | None = None  # -lr * P per block, (n, *shape); may view a shared buffer
    state: StateDict = field(default_factory=StateDict)
    failures: dict[str, list[int]] = field(default_factory=dict)
    # per member: steps by which its refresh schedule is delayed (refresh_schedule)
    refresh_offsets: list[int] = field(default_factory=list)
    gathered_grad: Tensor | None = field(default=None, repr=False)  # reused every step
    gathered_param: Tensor | None = field(default=None, repr=False)  # FSDP owners: weights
    # what differs from the group for these blocks (vector_preconditioner's settings)
    overrides: dict = field(default_factory=dict)
    # what the steps recorded for optimizer.metrics() (health.py; this rank's stacks)
    health: StackHealth = field(default_factory=StackHealth, repr=False)
    # refresh_delay: refreshes submitted and not yet applied (delayed_refresh.Pending)
    pending: list = field(default_factory=list, repr=False)

    def settings(self, groups: list[dict]) -> Mapping:
        """The hyperparameters of these blocks: their group's, live (a scheduler's lr
        change shows), with ``overrides`` on top."""
        group = groups[self.group_index]
        return ChainMap(self.overrides, group) if self.overrides else group

    @property
    def order(self) -> int:
        return len(self.shape)

    @property
    def device(self) -> torch.device:
        return self.members[0].param.device

    def preconditioned_dims(self, group: dict) -> list[int]:
        return kind_of(group).preconditioned_dims(group, self.order)

    # ----------------------------------------------------------------- state layout
    def expected_state(self, group: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name → (per-block shape, dtype) of every state tensor this group's checkpoint
        entries hold (``resident_state``: those kept between steps)."""
        shapes = kind_of(group).state_shapes(self, group)
        shapes.update(update_rules.state_shapes(group, self.shape, self.work_dtype))
        if delayed_refresh.delay_of(group):
            shapes.update(delayed_refresh.state_shapes(self, group))
        return shapes

    def assignment_cost(self, group: Mapping, cost: str) -> float:
        """What one of these blocks costs its owner (``assignment_cost``): ``"memory"``,
        the bytes of its state as its kind and stages keep it; ``"compute"``, its kind's
        floating-point operations per step (``Preconditioner.step_flops``)."""
        if cost == "memory":
            return float(sum(self.state_bytes(group).values()))
        return float(kind_of(group).step_flops(self.shape, group))

    def resident_state(self, group: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The part of ``expected_state`` the stack keeps between steps: all of it but the
        ``pending_`` results of ``refresh_delay``, which only checkpoints hold."""
        return {name: shape for name, shape in self.expected_state(group).items()
                if not delayed_refresh.is_pending(name)}

    def state_bytes(self, group: dict) -> dict[str, int]:
        """Name → bytes of one block's state tensor (of ``resident_state``)."""
        return {name: math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
                for name, (shape, dtype) in self.resident_state(group).items()}

    def materialize(self, group: dict) -> None:
        """Allocate missing state (identity roots and bases, zeros elsewhere) and move the
        state to the parameters' device if they moved."""
        device, n = self.device, len(self.members)
        for name, tensor in self.state.items():
            if tensor.device != device:
                self.state[name] = tensor.to(device)
        for name, (shape, dtype) in self.resident_state(group).items():
            if name in self.state:
                continue
            self.state[name] = kind_of(group).initial_state(name, shape, dtype, n, device)
            if name.startswith("factor_matrix_"):
                self.failures[name] = [0] * n

    # --------------------------------------------------------------- one step
    def checked_factors(self, job: StackStep) -> dict[str, Tensor]:
        """This step's factor matrices of the rows that refresh, computed out of place so
        that they can be checked for non-finite values before anything changes."""
        return kind_of(job.group).checked_factors(self, job)

    def direction(self, job: StackStep, workspace: Workspace, out: Tensor, lr: float) -> None:
        """docs/design.md §2 lines 2–8 for the rows of ``job``: writes ``-lr * P`` into ``out``.

        The kind (``preconditioners/``) does the statistics, the refresh and ``P``; the
        shared ``update_rules`` the rest. ``job.grad`` may be modified; ``job.param`` (views of
        the parameters where the layout allows) is only read.
        Intermediate results live in ``workspace`` (shared by all stacks), so that a
        steady step allocates next to nothing.
        """
        group, step, state, grad = job.group, job.step, job.state, job.grad
        kind = kind_of(group)
        stages = compiled.stages_for(group)  # update_rules, or its compiled lines 3-8 (compile)

        scratch = stages.Scratch(workspace, grad)

        # line 2: statistics and, for the rows due, the amortized computation
        fdtype = group["factor_matrix_dtype"]
        g = grad if grad.dtype == fdtype else grad.to(fdtype)
        kind.update_statistics(self, job, g, scratch)
        if job.refresh_rows and job.refresher is not None:  # refresh_delay: from a snapshot
            delayed_refresh.submit(self, job, job.refresher, Workspace)
        elif job.refresh_rows:
            start = time.perf_counter()
            for rows, first in split_first(job.refresh_rows, job.first_rows):
                kind.refresh(self, job, rows, first, workspace)
            job.refresh_seconds = time.perf_counter() - start
        kind.after_refresh(self, job, g, scratch)
        # line 3: grafting state from the same (post-L2) gradient; line 4: filtered gradient
        stages.update_grafting_state(state, group, grad)
        filtered = stages.filtered_gradient(state, group, step, grad, scratch("filtered"))
        # line 5: search direction, grafted
        scale = None
        self.health.graft = None
        if not kind.grafted:
            with matmul_precision.applying(group, grad.device):
                direction = kind.precondition(self, job, filtered, scratch("direction"),
                                              scratch)
        elif group["grafting"] is not None and len(job.grafting_rows) == grad.shape[0]:
            direction = stages.graft(state, group, step, filtered, scratch("graft"))
        else:
            with matmul_precision.applying(group, grad.device):
                direction = kind.precondition(self, job, filtered, scratch("direction"),
                                              scratch)
            norms: list = []  # the norms grafting takes anyway, kept for metrics()
            scale = stages.apply_grafting(state, group, step, direction, filtered,
                                          job.grafting_rows, scratch("graft"), norms=norms)
            if norms:
                self.health.graft = (step, *norms[0], tuple(job.grafting_rows))
        # lines 6–8: weight decay, momentum, -lr
        stages.finish_direction(state, group, direction, scale, direction is not filtered,
                                job.param, lr, out, scratch("direction"))
        # line 9: iterate averaging turns z's step into the parameters' (y's) step
        if job.averaging is not None:
            decay = averaging.decay_factor(job.averaging[2], stages.decoupled_decay_factor(group))
            param = stages.stacked(job.param, out.dtype)
            averaging.apply(state, job.averaging, decay, param, out, scratch("averaged"))

    def count_failures(self, name: str, ok: Tensor, members: list[int], step: int,
                       what: str = "eigendecomposition", eigenvalues: Tensor | None = None,
                       group: Mapping | None = None) -> None:
        """Record which members' decompositions (``what``) of ``name`` failed this refresh;
        warn, or raise after too many failures in a row. ``eigenvalues``: of the refreshed
        ``A + εI``, one row per member or per member that succeeded, for the condition
        numbers of ``metrics()`` (``health.py``; ``group``: the blocks' settings)."""
        counts = self.failures.setdefault(name, [0] * len(self.members))
        flags = ok.tolist()
        if eigenvalues is not None:
            good = [r for r, success in enumerate(flags) if success]
            values = eigenvalues
            if len(good) < len(flags) and eigenvalues.shape[0] == len(flags):
                values = eigenvalues[torch.tensor(good, dtype=torch.long,
                                                  device=eigenvalues.device)]
            self.health.record_condition(name, len(self.members),
                                         [members[r] for r in good], values, group)
        for position, success in zip(members, flags):
            if success:
                counts[position] = 0
                continue
            counts[position] += 1
            self.health.fallbacks += 1
            member = self.members[position]
            message = (
                f"DistributedShampoo: {what} of {name} of parameter "
                f"{member.name!r} (block {member.block_index}) failed at step {step}"
            )
            if counts[position] > MAX_CONSECUTIVE_FAILURES:
                raise ShampooNumericalError(
                    f"{message} for the {counts[position]}th time in a row; giving up"
                )
            warnings.warn(f"{message}; keeping the previous preconditioner", stacklevel=4)
