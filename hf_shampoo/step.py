"""The optimizer step's stages over a layout (docs/design.md §2), in the order ``step()`` runs them.

0. ``refuse_nonfinite_gradients``: a nan or an inf in any gradient (the distributor found
   it, on every rank alike) raises before any state or parameter changes;
1. ``gather_gradients``: each owned stack's gradients (blocks whose gradient is None are
   skipped), stacked, with L2 weight decay, and a plan of what every block does this step
   (its refresh schedule: ``refresh_schedule``);
2. ``check_refreshed_factors``: for blocks that refresh, factor matrices updated out of
   place and checked for non-finite values on every rank before anything changes;
   ``apply_delayed_refreshes`` then writes the delayed refreshes due (``refresh_delay``);
3. ``compute_directions``: every owned block's search direction ``-lr * P`` into the
   distributor's direction buffers (the per-stack math lives in ``stack.py`` and the
   preconditioner kinds);
4. the distributor's ``finish_step`` shares the directions between ranks and adds every
   block's to its parameter (``distributors/``).

``Layout`` is what the stages work on: the blocks of every parameter, their stacks, and
which stacks this rank owns; ``assign_refresh_offsets`` gives each block its place in the
refresh schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .blocking import ParamBlocking
from .config import is_preconditioning, is_refresh_step, start_step
from .delayed_refresh import apply_due, delay_of
from .distributors import OTHER_RANK, Distributor, greedy_assignment, refresh_work
from .distributors.agreement import Plan
from .errors import ShampooNumericalError
from .linalg import finite_rows
from .preconditioners import kind_of
from .stack import BlockStack, StackStep, Workspace
from .update_rules import add_rows


@dataclass
class Layout:
    """Blocks of every parameter, their stacks, and which stacks this rank owns."""

    blockings: dict[int, ParamBlocking]  # param_index → blocking
    stacks: list[BlockStack]  # every stack of every rank, in buffer order
    owned: list[BlockStack]  # the stacks whose state lives on this rank
    params: list[int]  # ids of the parameters it was built for (Accelerate may swap them)
    plan: Plan = field(default_factory=Plan)  # what every rank must hold alike (agreement)



def refuse_nonfinite_gradients(nonfinite: list[int], layout: Layout, step: int) -> None:
    """Stage 0: raise ``ShampooNumericalError`` naming the first parameter (by index) whose
    gradient holds a nan or an inf; every rank raises alike, nothing has changed yet."""
    if not nonfinite:
        return
    if nonfinite == [OTHER_RANK]:
        raise ShampooNumericalError(
            f"DistributedShampoo: another rank found a non-finite gradient (nan or inf) at "
            f"step {step} (its error names the parameter); no parameter or optimizer state "
            "was changed by this step"
        )
    names = {b.param_index: b.name for s in layout.stacks for b in s.members}
    listed = ", ".join(repr(names[i]) for i in nonfinite[:3])
    more = f" and {len(nonfinite) - 3} more" if len(nonfinite) > 3 else ""
    raise ShampooNumericalError(
        f"DistributedShampoo: non-finite gradient (nan or inf) for parameter {listed}{more} "
        f"at step {step}; no parameter or optimizer state was changed by this step. Skip "
        "such steps (AMP's GradScaler does), or pass check_finite_gradients=False to leave "
        "the check to your own code"
    )


def rows_of_state(stack: BlockStack, members: list[int]) -> dict[str, Tensor]:
    """A copy of the members' rows of every state tensor of ``stack`` (a job's state when
    only some blocks have a gradient; ``compute_directions`` writes it back)."""
    return {k: v[members] for k, v in stack.state.items()}


def gather_gradients(layout: Layout, groups: list[dict], steps: list[int],
                     active_members: dict[int, list[int]], distributor: Distributor,
                     param_rows) -> list[tuple[BlockStack, StackStep]]:
    """Stage 1: the owned stacks' gradients and what every block does this step.

    ``param_rows(stack, members)`` returns the members' parameter blocks, one per row (for
    L2 weight decay, added to the gradient here, docs/design.md §2's first line)."""
    jobs: list[tuple[BlockStack, StackStep]] = []
    for stack in layout.owned:
        active = active_members[id(stack)]
        if not active:
            continue
        group = stack.settings(groups)
        stack.materialize(group)
        full = len(active) == len(stack.members)
        state = stack.state if full else rows_of_state(stack, active)
        l2 = group["weight_decay"] > 0 and group["weight_decay_type"] == "l2"
        grad = distributor.stacked_grads(stack, active)
        if l2:
            add_rows(grad, param_rows(stack, active), group["weight_decay"])
        jobs.append((stack, _plan(stack, group, steps[stack.group_index], active, state, grad)))
    return jobs


def check_refreshed_factors(jobs: list[tuple[BlockStack, StackStep]], layout: Layout,
                            groups: list[dict], steps: list[int],
                            active_members: dict[int, list[int]],
                            distributor: Distributor) -> None:
    """Stage 2: refreshing blocks' factor matrices updated out of place and checked; a
    non-finite one raises ``ShampooNumericalError`` on every rank before anything changed."""
    checks = []
    for stack, job in jobs:
        if job.refresh_rows:
            factors = stack.checked_factors(job)
            if len(job.refresh_rows) == len(job.members):
                job.new_factors = factors
            flags = [finite_rows(f) for f in factors.values()]
            checks.append((stack, job, torch.stack(flags).all(0) if flags else None))
    checks = [c for c in checks if c[2] is not None]
    local_bad = bool(checks) and not bool(torch.stack([ok.all() for *_, ok in checks]).all())
    bad_anywhere = local_bad
    if distributor.world_size > 1 and _refreshes_somewhere(layout, groups, steps,
                                                           active_members):
        # every rank learns whether any refreshed factor is non-finite, so that all raise
        # together instead of the others waiting in the next collective forever
        bad_anywhere = distributor.any_rank(local_bad)
    if local_bad:
        for stack, job, ok in checks:
            bad = (~ok).nonzero().flatten().tolist()
            if bad:
                member = stack.members[job.members[job.refresh_rows[bad[0]]]]
                raise ShampooNumericalError(
                    f"DistributedShampoo: non-finite factor matrix for parameter "
                    f"{member.name!r} (block {member.block_index}) at step "
                    f"{job.step}; no parameter was changed by this step"
                )
    if bad_anywhere:
        raise ShampooNumericalError(
            "DistributedShampoo: another rank found a non-finite factor matrix at step "
            f"{max(steps)} (its error names the parameter); no parameter was changed by "
            "this step"
        )


def compute_directions(jobs: list[tuple[BlockStack, StackStep]], workspace: Workspace,
                       param_rows) -> None:
    """Stage 3: every owned block's direction ``-lr * P`` into its stack's direction
    buffer; a stack with blocks lacking a gradient writes only the others' rows (and
    their state)."""
    for stack, job in jobs:
        group = job.group
        if group["weight_decay"] > 0 and group["weight_decay_type"] != "l2":
            job.param = param_rows(stack, job.members)
        lr = float(group["lr"])
        if len(job.members) == len(stack.members):
            stack.direction(job, workspace, stack.directions, lr)
            continue
        out = torch.empty_like(job.grad)
        stack.direction(job, workspace, out, lr)
        index = torch.tensor(job.members, device=out.device)
        stack.directions.index_copy_(0, index, out.to(stack.directions.dtype))
        for name, tensor in job.state.items():  # materialize() made every name exist
            stack.state[name].index_copy_(0, index, tensor)


def apply_delayed_refreshes(jobs: list[tuple[BlockStack, StackStep]], layout: Layout,
                            groups: list[dict], steps: list[int], refresher) -> None:
    """Stage 2b (``refresh_delay``): the owned stacks' refreshes due this step written into
    their state (``delayed_refresh.apply_due``), before any direction reads it; the jobs
    of the stacks that refresh with a delay learn where their refreshes go."""
    changed = {id(s) for s in apply_due(layout.owned, groups, steps)}
    for stack, job in jobs:
        if id(stack) in changed and job.state is not stack.state:  # a copy of some rows
            job.state = rows_of_state(stack, job.members)
        if job.refresh_rows and delay_of(job.group):
            job.refresher = refresher


def assign_refresh_offsets(layout: Layout, groups: list[dict],
                           schedules: dict[int, tuple]) -> None:
    """Give every block its refresh schedule offset (docs/design.md §2 with ``refresh_schedule``);
    ``schedules`` remembers each group's (schedule, frequency) between calls.

    ``"all"``: 0. ``"staggered"``: the group's blocks, heaviest first (``Σ d³``, the
    cost of their eigendecompositions), each go to the least-loaded of the
    ``precondition_frequency`` offsets. The order depends only on the blocks'
    identities (parameter index, block index), never on ranks, so every rank and a
    single process agree. Recomputed when the group's schedule or frequency changes.
    """
    for gi, group in enumerate(groups):
        key = (group["refresh_schedule"], group["precondition_frequency"])
        stacks = [s for s in layout.stacks if s.group_index == gi]
        if schedules.get(gi) == key and all(
            len(s.refresh_offsets) == len(s.members) for s in stacks
        ):
            continue
        schedules[gi] = key
        for s in stacks:
            s.refresh_offsets = [0] * len(s.members)
        # only blocks whose kind refreshes have a schedule to spread
        blocks = sorted((b.param_index, b.block_index, s, i)
                        for s in stacks if kind_of(s.settings(groups)).refreshes
                        for i, b in enumerate(s.members))
        if key[0] != "staggered" or not blocks:
            continue
        slots = staggered_offsets([s.shape for _, _, s, _ in blocks], key[1])
        for (_, _, s, i), slot in zip(blocks, slots):
            s.refresh_offsets[i] = slot


def staggered_offsets(shapes: list[tuple[int, ...]], frequency: int) -> list[int]:
    """The staggered offsets of a group's refreshing blocks, given in (parameter index,
    block index) order: heaviest first (``Σ d³``), each to the least-loaded of the
    ``frequency`` offsets (with more offsets than blocks, LPT gives each block its own)."""
    if not shapes:
        return []
    return greedy_assignment([refresh_work(shape) for shape in shapes],
                             min(frequency, len(shapes)))



def _refreshes_somewhere(layout: Layout, groups: list[dict], steps: list[int],
                         active: dict[int, list[int]]) -> bool:
    """Whether any block with a gradient, on any rank, refreshes this step (the same answer
    on every rank: schedules and active blocks agree everywhere)."""
    for stack in layout.stacks:
        members = active[id(stack)]
        if not members:
            continue
        group, step = stack.settings(groups), steps[stack.group_index]
        offsets = {stack.refresh_offsets[i] for i in members} if stack.refresh_offsets else {0}
        if any(is_refresh_step(group, step, offset) for offset in offsets):
            return True
    return False


def _plan(
    stack: BlockStack, group: dict, step: int, active: list[int], state: dict, grad: Tensor
) -> StackStep:
    """What every row (active member) of a stack does this step, from its schedule offset."""
    offsets = [stack.refresh_offsets[i] if stack.refresh_offsets else 0 for i in active]
    refresh = [r for r, o in enumerate(offsets) if is_refresh_step(group, step, o)]
    first = [r for r in refresh if step - offsets[r] == start_step(group)]
    grafting = []
    if group["grafting"] is not None:
        # refresh_delay: a block grafts until its first roots arrive, d steps after its start
        delay = delay_of(group)
        grafting = [r for r, o in enumerate(offsets)
                    if not is_preconditioning(group, step - delay, o)]
    return StackStep(group, step, active, state, grad, None, refresh, first, grafting,
                     offsets=offsets)


# --- kinds' per-step hook (riemannian_lora under FSDP2: docs/lora.md) ---------------------
def before_step(layout: Layout, groups: list[dict], distributor: Distributor) -> None:
    """Between stages 0 and 1, on every rank: each kind with ``steps_on_every_rank`` gets
    its ``before_step`` with every stack of its kind (all ranks' stacks, in layout order,
    the same on every rank), e.g. to gather weights that its owned blocks read. Nothing
    for the other kinds."""
    hooked: dict[str, tuple] = {}
    for stack in layout.stacks:
        kind = kind_of(stack.settings(groups))
        if kind.steps_on_every_rank:
            hooked.setdefault(kind.name, (kind, []))[1].append(stack)
    for kind, stacks in hooked.values():
        kind.before_step(stacks, groups, distributor)
