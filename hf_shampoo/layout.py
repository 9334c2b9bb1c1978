"""Building the layout: blocks, stacks, owners, the plan the ranks agree on (docs/design.md §4).

The parameters that train (``trainable``) are cut into blocks (``blocking.py``), the blocks
into stacks by ``stacking.py``'s rule, and each stack is given its owner by the
distributor's ``assign``, which balances what each block costs its owner and, with
staggered refreshes, the refreshes of each step. The parameters and their blocks are
recorded in an ``agreement.Plan``, checked alike on every rank before the layout's first
collective (``LayoutBuilder.agreed``). ``LayoutBuilder`` reads only what it is given: the
param groups, the distributor, ``assignment_cost`` and the parameters by ``param_index``;
what it builds is ``step.Layout``, what a step's stages work on. This module builds the
layout in memory; ``checkpoint/layout.py`` is how a layout's state is stored on disk, by
block identity.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from . import matmul_precision, stacking, step
from .blocking import ParamBlocking, expert_shape, is_vector_like
from .config import RUNTIME_KEYS, TABLE, is_elongated, keyword_acts, vector_settings
from .distributors import Distributor, agreement
from .distributors.collectives import collective_device
from .preconditioners import kind_of
from .stack import BlockRef, BlockStack
from .step import Layout


def trainable(params: Sequence[Tensor]) -> list[int]:
    """``param_index`` of the parameters that get blocks and state (``params``: every
    parameter, in ``param_index`` order): those that require a gradient or have one. A
    frozen parameter (``requires_grad=False``, no gradient) gets nothing, as torch's
    optimizers give it no state, until it has one. Every rank agrees without
    communicating: the model's code decides ``requires_grad``."""
    seen: set[int] = set()
    trainable = []
    for i, p in enumerate(params):
        if id(p) in seen:
            continue  # a tensor listed twice is one parameter, as in torch
        seen.add(id(p))
        if p.requires_grad or p.grad is not None:
            trainable.append(i)
    return trainable


def vector_overrides(group: Mapping, param: Tensor) -> dict:
    """``vector_preconditioner``'s settings for a vector-like parameter (one expert's
    shape for fused experts), nothing for the others."""
    vector = is_vector_like(expert_shape(param.shape, group["experts"]))
    return vector_settings(group) if vector else {}


def param_settings(group: dict, param: Tensor) -> Mapping:
    """A parameter's hyperparameters: its group's, with ``vector_preconditioner``'s
    settings on top for a vector-like parameter."""
    overrides = vector_overrides(group, param)
    return ChainMap(overrides, group) if overrides else group


def numbers_settings(group: Mapping) -> tuple[tuple[str, str], ...]:
    """``(keyword, agreement.setting(value))`` of every setting of ``group`` that
    enters its blocks' numbers: each keyword of the table that acts for the group's
    kinds (``keyword_acts``: its own and ``vector_preconditioner``'s), but the runtime
    ones (``compile``: how this process runs the step), floats exactly; and
    ``peak_lr`` where weight decay divides by it."""
    pairs = [(key, agreement.setting(group[key], row.type in (float, tuple, dict)
                                     or tuple in getattr(row.type, "__args__", ())))
             for key, row in TABLE.items()
             if key not in RUNTIME_KEYS and keyword_acts(key, group)]
    if group["weight_decay"] != 0 and group["weight_decay_type"] in (
            "corrected", "independent") and "peak_lr" in group:
        pairs.append(("peak_lr", agreement.setting(group["peak_lr"], True)))
    return tuple(pairs)


@dataclass
class LayoutBuilder:
    """Lays an optimizer's parameters out, from what it reads: the groups as they are now,
    the distributor that owns the blocks, and the parameters by ``param_index``."""

    groups: list[dict]  # the optimizer's param_groups
    distributor: Distributor
    assignment_cost: str  # the optimizer's defaults["assignment_cost"]
    refs: list[tuple[int, int, Tensor]]  # (group index, position, parameter) by param_index
    names: list[str]  # the optimizer's param_name of each parameter, by param_index
    schedules: dict[int, tuple]  # the optimizer's, for step.assign_refresh_offsets

    def param_ids(self) -> list[int]:
        """``Layout.params``: the ids of the parameters, by ``param_index``."""
        return [id(p) for _, _, p in self.refs]

    def build(self, wanted: Iterable[int]) -> Layout:
        """A new layout of the ``wanted`` parameters, with a new plan."""
        blockings, blocks = self.blocks(wanted)
        stacks, plan = self.make_stacks(blocks, blockings, agreement.Plan())
        layout = Layout(blockings, stacks, [], self.param_ids(), plan)
        self.finish(layout)
        return layout

    def extend(self, layout: Layout, wanted: Iterable[int]) -> Layout:
        """Add blocks for the ``wanted`` parameters that have none yet (a new param group, a
        parameter unfrozen during training); existing blocks and their state stay."""
        new = [i for i in wanted if i not in layout.blockings]
        blockings, blocks = self.blocks(new)
        stacks, layout.plan = self.make_stacks(blocks, blockings, layout.plan)
        layout.blockings.update(blockings)
        layout.stacks = sorted(layout.stacks + stacks, key=lambda s: s.rank)
        layout.params = self.param_ids()
        self.finish(layout)
        return layout

    def finish(self, layout: Layout) -> None:
        """This rank's stacks, the distributor's direction buffers and every block's
        refresh offset (``step.assign_refresh_offsets``)."""
        layout.owned = [s for s in layout.stacks if s.rank == self.distributor.rank]
        self.distributor.allocate_directions(layout.stacks)
        step.assign_refresh_offsets(layout, self.groups, self.schedules)

    def blocks(self, indices: Iterable[int]) -> tuple[dict, list[BlockRef]]:
        """The blockings of the parameters ``indices`` and their blocks, in layout order."""
        blockings, blocks = {}, []
        for index in indices:
            gi, _, param = self.refs[index]
            group = param_settings(self.groups[gi], param)
            name = self.names[index]
            shape = self.distributor.blocking_shape(param)
            experts = group["experts"]  # dim 0: independent matrices, blocked one by one
            blocking = ParamBlocking.of(shape, group["max_preconditioner_dim"],
                                        kind_of(group).matrix_blocks
                                        or is_elongated(expert_shape(shape, experts), group),
                                        experts)
            blockings[index] = blocking
            single = len(blocking.slices) == 1
            blocks += [
                BlockRef(gi, index, b, param, name, blocking.merged, None if single else sl)
                for b, sl in enumerate(blocking.slices)
            ]
        return blockings, blocks

    def make_stacks(self, blocks: list[BlockRef], blockings: dict, plan: agreement.Plan
                    ) -> tuple[list[BlockStack], agreement.Plan]:
        """The blocks' stacks, each block given its owner, and ``plan`` with the blocks'
        parameters (``planned``)."""
        shapes = [blockings[b.param_index].block_shapes[b.block_index] for b in blocks]
        kinds: list[tuple] = []  # per block: what its stack is made of, but the owner
        for block, shape in zip(blocks, shapes):
            group = self.groups[block.group_index]
            matmul_precision.check(group, block.param.device)
            wide = torch.float64 in (block.param.dtype, group["factor_matrix_dtype"])
            work_dtype = torch.float64 if wide else torch.float32
            overrides = vector_overrides(group, block.param)
            kinds.append((block.group_index, shape, block.param.device, work_dtype,
                          tuple(sorted(overrides.items()))))
        # what each block costs its owner, as its kind holds and computes it
        cost, priced = self.assignment_cost, {}
        for kind in set(kinds):
            gi, shape, _, work_dtype, overrides = kind
            probe = BlockStack(gi, shape, [], work_dtype, overrides=dict(overrides))
            priced[kind] = probe.assignment_cost(probe.settings(self.groups), cost)
        costs = [priced[k] for k in kinds]
        plan = self.planned(plan, blocks, kinds, costs)
        slots = self.refresh_slots(blocks, shapes, kinds)
        # stacks cut by a rule of the blocks alone: every layout computes each block in
        # the same call beside the same blocks (stacking.py); owners get whole stacks
        groups = self.groups
        units = stacking.chunks(
            kinds, shapes, lambda kind: groups[kind[0]]["stacking"] == stacking.FUSED)
        owners = self.distributor.assign(blocks, shapes, costs, slots=slots, units=units)
        stacks = []
        for unit in units:
            group_index, shape, _, work_dtype, overrides = kinds[unit[0]]
            stacks.append(BlockStack(group_index, shape, [blocks[i] for i in unit], work_dtype,
                                     rank=owners[unit[0]], overrides=dict(overrides)))
        return sorted(stacks, key=lambda s: s.rank), plan

    def refresh_slots(self, blocks: list[BlockRef], shapes: list[tuple[int, ...]],
                      kinds: list[tuple]) -> list[int | None] | None:
        """Each block's staggered refresh offset as ``step.assign_refresh_offsets`` will
        give it (for the owners to balance each step's refreshes; docs/performance.md),
        ``None`` for blocks that refresh with every block or never; ``None`` if none is
        staggered."""
        slots: list[int | None] = [None] * len(blocks)
        by_group: dict[int, list[int]] = {}
        for i, (block, kind) in enumerate(zip(blocks, kinds)):
            group = self.groups[block.group_index]
            settings = ChainMap(dict(kind[4]), group) if kind[4] else group
            if settings["refresh_schedule"] == "staggered" and kind_of(settings).refreshes:
                by_group.setdefault(block.group_index, []).append(i)
        for gi, members in by_group.items():
            members.sort(key=lambda i: (blocks[i].param_index, blocks[i].block_index))
            offsets = step.staggered_offsets([shapes[i] for i in members],
                                             self.groups[gi]["precondition_frequency"])
            for i, offset in zip(members, offsets):
                slots[i] = offset
        return slots if by_group else None

    def planned(self, plan: agreement.Plan, blocks: list[BlockRef], kinds: list[tuple],
                costs: list[float]) -> agreement.Plan:
        """``plan`` with the new blocks' parameters (``agreement.Plan``: what the ranks
        must hold alike), checked across the ranks now where laying them out is itself a
        collective (sub-meshes, DeepSpeed's partitions), else at the first step. The
        groups' settings join it at the check (``agreed``), as they are then."""
        entries: dict[int, dict] = {}
        for block, (group, shape, _, work_dtype, overrides), cost in zip(blocks, kinds, costs):
            entry = entries.get(block.param_index)
            if entry is None:
                named = self.groups[block.group_index].get("param_names")
                entry = entries[block.param_index] = {
                    "index": block.param_index, "name": block.name if named else None,
                    "param": agreement.param_key(block.param, self.group_ranks()),
                    "blocks": []}
            entry["blocks"].append([list(shape), group, str(work_dtype).removeprefix(
                "torch."), repr(overrides), float(cost)])
        plan = plan.extended(entries.values())
        if self.distributor.collective_layout([b.param for b in blocks]):
            plan = self.agreed(plan)
        return plan

    def agreed(self, plan: agreement.Plan) -> agreement.Plan:
        """``plan``, found the same on every rank (once: ``agreement.check`` raises
        ``ValueError`` on every rank where they differ), where the distributor's
        collectives depend on it: its parameters and blocks, and the settings of the
        groups they are in as the groups hold them now (every rank checks at the same
        step, so a learning-rate schedule's ``lr`` is the same on every rank)."""
        if plan.agreed or not self.distributor.needs_agreement():
            return plan.checked()
        plan = plan.with_settings((gi, numbers_settings(self.groups[gi]))
                                  for gi in plan.groups())
        process_group = self.distributor.process_group
        agreement.check(plan, group=process_group,
                        device=collective_device([p for _, _, p in self.refs], process_group))
        return plan.checked()

    def group_ranks(self) -> int | tuple[int, ...]:
        """The global ranks blocks are spread over (the world's size where the distributor
        has no group)."""
        group = self.distributor.group
        return self.distributor.world_size if group is None else group.ranks
