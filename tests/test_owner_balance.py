"""Block owners share what the kinds really hold and compute (docs/parallelism.md): planned
without a process group for a small Muon model (spectral descent on matrices, Adam on
embeddings and vectors) and a Shampoo model, on simulated 2- and 4-rank worlds."""

from __future__ import annotations

import pytest
import torch

from hf_shampoo import DistributedShampoo, make_optimizer
from hf_shampoo.distributors import SingleProcessDistributor, block_cost, greedy_assignment
from hf_shampoo.distributors.base import STAGGERED_SLACK, owners_of_blocks, single_units
from hf_shampoo.distributors.ddp import DataParallelDistributor
from hf_shampoo.distributors.placements import chunk_boxes
from hf_shampoo.distributors.sharded import ShardedDistributor
from hf_shampoo.preconditioners import kind_of

pytestmark = pytest.mark.unit


class _DataParallelPlan(SingleProcessDistributor):
    """The data-parallel assignment (greedy over all blocks) for a simulated world."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world_size = world

    def assign(self, blocks, block_shapes, costs=None, slots=None, units=None):
        # the data-parallel distributor's own rule, without its process group
        return DataParallelDistributor.assign(self, blocks, block_shapes, costs, slots, units)

    assignment_cost = "memory"


class _SlotBlindPlan(_DataParallelPlan):
    """The data-parallel assignment before staggered offsets were balanced: total cost
    alone."""

    def assign(self, blocks, block_shapes, costs=None, slots=None, units=None):
        costs = costs or [block_cost(s) for s in block_shapes]
        units = single_units(units, len(block_shapes))
        owners = greedy_assignment([sum(costs[i] for i in u) for u in units], self.world_size)
        return owners_of_blocks(owners, units, len(block_shapes))


def _sharded_plan(world: int) -> ShardedDistributor:
    return ShardedDistributor(rank=0, world_size=world, boxes_of=lambda params, names: {
        i: chunk_boxes(p.shape, world) for i, p in params.items()})


class _ShapeCosted:
    """The same plan with every block costed by its shape alone (the rule before)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def assign(self, blocks, block_shapes, costs=None, slots=None, units=None):
        return self.inner.assign(blocks, block_shapes,
                                 [block_cost(s, self.inner_cost) for s in block_shapes],
                                 units=units)


def _model() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512,
                                      n_positions=64, bos_token_id=0, eos_token_id=0))


def _optimizer(config: str, model, cost: str) -> DistributedShampoo:
    if config == "muon":
        return make_optimizer(model, preset="muon", lr=1e-3, distributed="none",
                              assignment_cost=cost)
    return DistributedShampoo(model.parameters(), lr=1e-3, grafting="adam",
                              max_preconditioner_dim=64, distributed="none",
                              assignment_cost=cost)


def _shares(config: str, world: int, plan: str, rule: str, cost: str):
    """Each rank's share of the state bytes (cost "memory") or of the step's flops
    ("compute"), and the largest stack's share (owners get whole stacks: stacking.py)."""
    opt = _optimizer(config, _model(), cost)
    distributor = _sharded_plan(world) if plan == "fsdp2" else _DataParallelPlan(world)
    if rule == "shape":
        wrapped = _ShapeCosted(distributor)
        wrapped.inner_cost = cost
        distributor = wrapped
    opt.distributor = distributor
    load, stacks = [0.0] * world, {}
    for row in opt.describe_blocks():
        one = row["state_bytes"] if cost == "memory" else row["step_flops"]
        load[row["rank"]] += one
        stacks[row["stack"]] = stacks.get(row["stack"], 0.0) + one
    total = sum(load)
    return [x / total for x in load], max(stacks.values()) / total


@pytest.mark.parametrize("plan", ["ddp", "fsdp2"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("config", ["muon", "shampoo"])
@pytest.mark.parametrize("cost", ["memory", "compute"])
def test_the_largest_rank_holds_at_most_the_mean_plus_one_block(config, world, plan, cost):
    """Greedy owners (heaviest stack first): no rank exceeds the mean (1.1x it for the
    sharded owners' capacity) by more than one stack; and costing blocks by their kind is
    never worse than by their shape here."""
    shares, largest = _shares(config, world, plan, "kind", cost)
    capacity = 1.1 if plan == "fsdp2" else 1.0
    assert max(shares) <= capacity / world + largest + 1e-9, (shares, largest)
    assert sum(shares) == pytest.approx(1.0)
    before, _ = _shares(config, world, plan, "shape", cost)
    assert max(shares) <= max(before) + 1e-9, (shares, before)


def test_kind_costs_balance_a_muon_model_the_shape_rule_did_not():
    """Vectors and embeddings under Adam hold two moments, matrices under spectral
    descent one momentum and no factors: costed by shape, one rank held 0.544 of the
    state of this model on 2 ranks; costed by kind, 0.5."""
    before, _ = _shares("muon", 2, "fsdp2", "shape", "memory")
    after, _ = _shares("muon", 2, "fsdp2", "kind", "memory")
    assert max(before) > 0.52
    assert max(after) < max(before) and max(after) <= 0.505


def test_step_flops_of_the_kinds():
    from hf_shampoo.config import DEFAULTS

    group = dict(DEFAULTS, precondition_frequency=10)
    shampoo = kind_of(group).step_flops((64, 32), group)
    assert shampoo == pytest.approx(10 * 2048 + 4 * 96 * 2048 + 10 * (64**3 + 32**3) / 10)
    muon = dict(group, preconditioner="spectral_descent")
    per_iteration = 4 * 32 * 32 * 64 + 2 * 32**3
    assert kind_of(muon).step_flops((64, 32), muon) == pytest.approx(
        muon["newton_schulz_iterations"] * per_iteration + 10 * 2048)
    diagonal = dict(group, preconditioner="diagonal")
    assert kind_of(diagonal).step_flops((64, 32), diagonal) == pytest.approx(10 * 2048)


def _refresh_wall(world: int, plan_class) -> tuple[float, list[float], float]:
    """ResNet-50 (timm) under staggered refreshes, f = 10, owners by ``plan_class``: the
    window's refresh time if each step waits for its busiest rank (Σ over offsets of the
    largest rank's ``Σ d³``, as a share of all the refresh work), each rank's share of
    the state bytes, and the largest block's."""
    import timm

    model = timm.create_model("resnet50", num_classes=10)
    opt = DistributedShampoo(model.parameters(), lr=1e-3, grafting="adam",
                             max_preconditioner_dim=1024, precondition_frequency=10,
                             refresh_schedule="staggered", distributed="none")
    opt.distributor = plan_class(world)
    work: dict[tuple[int, int], float] = {}
    state = [0.0] * world
    stacks: dict[int, float] = {}
    for row in opt.describe_blocks():
        state[row["rank"]] += row["state_bytes"]
        stacks[row["stack"]] = stacks.get(row["stack"], 0.0) + row["state_bytes"]
        key = (row["refresh_offset"], row["rank"])
        work[key] = work.get(key, 0.0) + sum(d**3 for d in row["shape"])
    offsets = {offset for offset, _ in work}
    wall = sum(max(work.get((o, r), 0.0) for r in range(world)) for o in offsets)
    largest = max(stacks.values())
    return wall / sum(work.values()), [x / sum(state) for x in state], largest / sum(state)


@pytest.mark.parametrize("world", [2, 4])
def test_staggered_owners_spread_each_steps_refreshes(world):
    """With staggered refreshes every step refreshes some blocks and waits for the rank
    with the most of them: owners balanced per offset cut that from 0.93 to 0.65 of the
    refresh work on 2 ranks (0.63 to 0.42 on 4; 1/world is the floor), the state per rank
    staying within the slack of the mean plus one block."""
    wall, shares, largest = _refresh_wall(world, _DataParallelPlan)
    before, _, _ = _refresh_wall(world, _SlotBlindPlan)
    assert wall <= 0.8 * before, (wall, before)
    assert wall >= 1 / world
    assert max(shares) <= (1 + STAGGERED_SLACK) / world + largest + 1e-9, shares
