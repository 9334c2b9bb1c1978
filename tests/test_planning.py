"""The single-process tests of the distributed code paths: what the distributors plan and
check without a process group (moved here from the ``distributed`` modules, so that their
layer says what they do):

- out of tests/test_distributed.py: the greedy owner assignment, ``distributed="ddp"`` refused
  without a process group, and frozen parameters in one process (the reference of
  ``test_frozen_parameters_under_ddp_match_one_process`` there);
- out of tests/test_sharded.py: shards as boxes of the merged view, and the lossless
  assignment on a simulated 1-D mesh;
- out of tests/test_rank_agreement.py: ``agreement``'s messages and settings, one process
  checking nothing, and a refused layout change changing nothing.
"""

from __future__ import annotations

import pytest
import torch

from hf_shampoo import DistributedShampoo
from hf_shampoo.distributors import (
    SingleProcessDistributor,
    agreement,
    block_cost,
    greedy_assignment,
)
from tests import distributed_worker as worker
from tests.helpers import assert_bitwise

pytestmark = pytest.mark.unit


# ---------------------------------------- DDP's planning (tests/test_distributed.py)
def test_greedy_assignment_is_longest_first_and_deterministic():
    costs = [block_cost(s) for s in [(16, 16), (16, 4), (7,), (16, 16), (3, 3)]]
    owners = greedy_assignment(costs, 2)
    assert owners == greedy_assignment(costs, 2)
    # the two largest blocks go to different ranks
    assert owners[0] != owners[3]
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(2)]
    assert max(loads) - min(loads) <= max(costs)
    assert block_cost((16, 16), "compute") == 2 * 16**3 + 256


def test_ddp_mode_without_process_group_is_refused():
    with pytest.raises(ValueError, match="distributed='ddp'"):
        DistributedShampoo([torch.nn.Parameter(torch.ones(2))], distributed="ddp")


def test_frozen_parameters_get_no_blocks_and_state_and_unfreezing_adds_them():
    """One process: a frozen parameter (requires_grad=False, no gradient) has no blocks and
    no state; unfrozen at step 3 it gets them then and moves exactly as a trainable
    parameter whose gradient was None at steps 1 and 2."""
    params, opt, blocks = worker.train_frozen(worker.SCENARIOS["shampoo_adam"])
    everything = set(range(len(worker.SHAPES)))
    assert blocks[0] == sorted(everything - {worker.FROZEN, 1})
    assert blocks[-1] == sorted(everything - {worker.FROZEN})
    assert sorted(opt.state_dict()["state"]) == sorted(everything - {worker.FROZEN})
    assert torch.equal(params[worker.FROZEN].detach(),
                       worker.make_params()[worker.FROZEN].detach())
    # the same run with parameter 1 trainable but without a gradient at steps 1 and 2
    reference = worker.make_params()
    reference[worker.FROZEN].requires_grad_(False)
    ref_opt = worker.optimizer_for(reference, worker.SCENARIOS["shampoo_adam"])
    for step in range(1, worker.STEPS + 1):
        worker.set_grads(reference, step, no_grad={worker.FROZEN: range(1, worker.STEPS + 1),
                                                   1: range(1, worker.UNFROZEN_AT)})
        ref_opt.step()
    assert_bitwise([p.detach() for p in params], [p.detach() for p in reference])


# ---------------------------------------- sharded planning (tests/test_sharded.py)
def test_row_shards_are_boxes_of_the_merged_view_in_torch_chunk_sizes():
    from hf_shampoo.blocking import merged_shape
    from hf_shampoo.distributors.placements import chunk_boxes, merged_box

    def ranges(shape, max_dim, shards):
        merged = merged_shape(shape, max_dim)
        return tuple((0, 0) if box is None else merged_box(box, shape, merged)[0]
                     for box in chunk_boxes(shape, shards))

    assert ranges((5, 4), 32, 3) == ((0, 8), (8, 16), (16, 20))  # merged (20,): elements
    assert ranges((10, 3, 3, 3), 128, 3) == ((0, 4), (4, 8), (8, 10))  # merged (10, 27)
    assert ranges((2, 5), 4, 3) == ((0, 1), (1, 2), (0, 0))  # the third shard is empty
    assert ranges((1, 6), 4, 2) == ((0, 6), (0, 0))  # a dropped size-1 dim 0: one shard
    for shape in [(7, 3), (12, 5, 2), (9,)]:  # shard sizes are torch.chunk's, in elements
        for shards in (2, 3, 4):
            merged = merged_shape(shape, 8)
            row = torch.Size(shape).numel() // merged[0]
            sizes = [(b - a) * row for a, b in ranges(shape, 8, shards)]
            chunks = [c.numel() for c in torch.empty(shape).chunk(shards)]
            assert sizes[:len(chunks)] == chunks and sum(sizes) == torch.Size(shape).numel()


def test_column_shards_of_a_merged_matrix_are_no_box_there():
    from hf_shampoo.distributors.placements import chunk_boxes, merge_groups, merged_box

    assert merge_groups((10, 3, 3, 3), (10, 27)) == [[0], [1, 2, 3]]
    assert merge_groups((1, 17, 64), (1, 1088)) == [[0], [1, 2]]
    # input channels of a conv: a range of its merged columns
    assert merged_box(chunk_boxes((10, 3, 3, 3), 3, dim=1)[1], (10, 3, 3, 3), (10, 27)) \
        == ((0, 10), (9, 18))
    # a column shard of a (5, 4) matrix merged into (20,) is strided there: index cuts
    assert merged_box(chunk_boxes((5, 4), 2, dim=1)[0], (5, 4), (20,)) is None
    assert merged_box(((2, 3), (1, 3)), (5, 4), (20,)) == ((9, 11),)  # one row's part


def test_overlapping_or_missing_shards_are_refused():
    from hf_shampoo.distributors.placements import HeldBy

    with pytest.raises(ValueError, match="overlapping"):
        HeldBy.of((4, 4), [((0, 3), (0, 4)), ((2, 4), (0, 4))], "'w'")
    with pytest.raises(ValueError, match="hold 8 of its 16 elements"):
        HeldBy.of((4, 4), [((0, 2), (0, 4)), ((0, 2), (0, 4))], "'w'")
    held = HeldBy.of((4, 4), [((0, 2), (0, 4)), ((2, 4), (0, 4)), ((0, 2), (0, 4)), None], "w")
    assert held.ranks == ((0, 2), (1,)) and not held.replicated


class _Planner:
    """The lossless assignment for a simulated 1-D mesh (no process group)."""

    def __init__(self, world):
        from hf_shampoo.distributors.placements import chunk_boxes
        from hf_shampoo.distributors.sharded import ShardedDistributor

        self.planner = ShardedDistributor(
            rank=0, world_size=world,
            boxes_of=lambda params, names: {i: chunk_boxes(p.shape, world)
                                            for i, p in params.items()})

    def assign(self, shapes, max_dim):
        from hf_shampoo.blocking import ParamBlocking
        from hf_shampoo.distributors import block_cost
        from hf_shampoo.stack import BlockRef

        blocks = []
        for i, shape in enumerate(shapes):
            blocking = ParamBlocking.of(shape, max_dim)
            one = len(blocking.slices) == 1
            blocks += [BlockRef(0, i, b, torch.empty(shape), "", blocking.merged,
                                None if one else sl) for b, sl in enumerate(blocking.slices)]
        block_shapes = [tuple(s.stop - s.start for s in b.slices) if b.slices else b.merged
                        for b in blocks]
        owners = self.planner.assign(blocks, block_shapes)
        return blocks, owners, [block_cost(s) for s in block_shapes]


def test_owners_hold_the_rows_of_aligned_blocks_and_loads_stay_balanced():
    world = 4
    blocks, owners, costs = _Planner(world).assign([(64, 16)] * 3 + [(16, 16)] * 4, 16)
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(world)]
    assert max(loads) <= 1.1 * sum(costs) / world + max(costs)
    for block, owner in zip(blocks, owners):
        if block.merged == (64, 16):  # 16-row blocks on 16-row shards: owned where they live
            assert owner == block.slices[0].start // 16


def test_assignment_is_deterministic_and_spreads_blocks():
    shapes = [(30, 20), (7,), (50, 3), (8, 8, 8), (100,)]
    first = _Planner(3).assign(shapes, 8)[1]
    assert first == _Planner(3).assign(shapes, 8)[1]
    assert set(first) == {0, 1, 2}


# ---------------------------------------- rank agreement (tests/test_rank_agreement.py)
def test_the_message_of_differing_plans():
    """``agreement.message`` alone: counts, the first difference, a parameter only one
    rank has."""
    def entry(index, shape, mesh=None):
        param = [list(shape), "float32"] + ([mesh, ["Shard(dim=0)"]] if mesh else [])
        return {"index": index, "name": None, "param": param,
                "blocks": [[list(shape), 0, "float32", "()", 1.0]]}

    a = {"count": 2, "entries": [entry(0, (4, 4)), entry(1, (4,))]}
    b = {"count": 3, "entries": [entry(0, (4, 4)), entry(1, (4,)), entry(2, (2,))]}
    text = agreement.message([a, a, b], [(2, 1), (2, 1), (3, 2)], [0, 1, 2], me=1)
    assert text.startswith("DistributedShampoo: rank 2 holds different parameters from "
                           "ranks 0, 1")
    assert "rank 2 has more, from parameter 2 of shape (2,) float32" in text
    assert "This is rank 1;" in text
    c = {"count": 2, "entries": [entry(0, (4, 4), [0, 1]), entry(1, (4,))]}
    d = {"count": 2, "entries": [entry(0, (4, 4), {"sub-mesh": [1]}), entry(1, (4,))]}
    text = agreement.message([c, d], [(2, 1), (2, 2)], [0, 1], me=0)
    assert ("on a sub-mesh of shape (1,) placed (Shard(dim=0)) there, parameter 0 of shape "
            "(4, 4) float32 on mesh ranks [0, 1] placed (Shard(dim=0)) on rank 0") in text


def test_the_message_of_differing_settings():
    """``agreement.message`` with settings: every rank's value of the first differing
    one, the others named; with parameters that differ too, the parameters first."""
    def plan(settings, shape=(4, 4)):
        entry = {"index": 0, "name": None, "param": [list(shape), "float32"],
                 "blocks": [[list(shape), 0, "float32", "()", 1.0]]}
        return {"count": 1, "entries": [entry], "groups": 1, "settings": [[0, settings]]}

    a = plan([["lr", "0.1"], ["epsilon", "1e-12"], ["preconditioner", "'shampoo'"]])
    b = plan([["lr", "0.1"], ["epsilon", "1e-10"], ["preconditioner", "'sketchy'"],
              ["sketch_rank", "128"]])
    text = agreement.message([a, b, a], [(1, 1), (1, 2), (1, 1)], [0, 1, 2], me=2)
    assert text.startswith(
        "DistributedShampoo: ranks of the process group differ in parameter group 0's "
        "setting 'epsilon': ranks 0, 2 have 1e-12, rank 1 has 1e-10 (and its settings "
        "'preconditioner', 'sketch_rank').")
    assert text.endswith("This is rank 2; nothing was changed.")
    c = plan([["lr", "0.5"], ["epsilon", "1e-12"], ["preconditioner", "'shampoo'"]], (2, 2))
    text = agreement.message([a, c], [(1, 1), (1, 3)], [0, 1], me=0)
    assert text.startswith("DistributedShampoo: rank 1 holds different parameters from "
                           "rank 0")
    assert ("The ranks also differ in parameter group 0's setting 'lr': rank 0 has 0.1, "
            "rank 1 has 0.5.") in text


def test_settings_are_shown_exactly():
    assert agreement.setting(0.1) == "0.1" and agreement.setting(1e-12) == "1e-12"
    assert agreement.setting(0.1 + 0.2) == "0.30000000000000004"  # not 0.3: exactly
    assert agreement.setting(torch.tensor(0.5)) == "0.5"
    assert agreement.setting(1, real=True) == agreement.setting(1.0) == "1.0"
    assert agreement.setting(3) == "3" and agreement.setting(True) == "True"
    assert agreement.setting((0.9, 1), real=True) == "(0.9, 1.0)"
    assert agreement.setting({2: 0.5}, real=True) == "{2: 0.5}"
    assert agreement.setting(torch.float64) == "torch.float64"
    assert agreement.setting("adam") == "'adam'" and agreement.setting(None) == "None"


def test_one_process_and_planners_check_nothing():
    from hf_shampoo import DistributedShampoo

    param = torch.nn.Parameter(torch.ones(4, 3))
    opt = DistributedShampoo([param], lr=0.1)
    param.grad = torch.ones(4, 3)
    opt.step()
    assert opt._layout.plan.agreed and not opt.distributor.needs_agreement()


class _Checked(SingleProcessDistributor):
    """One process that checks as a sharded distributor on sub-meshes would: before
    ``assign``, at every layout."""

    def needs_agreement(self) -> bool:
        return True

    def collective_layout(self, params) -> bool:
        return True


def test_a_refused_layout_change_changes_nothing(monkeypatch):
    """Where the check runs while laying out (``collective_layout``), a refused new group
    is not added, and a refused rebuild keeps the old layout and distributor."""
    from hf_shampoo import DistributedShampoo

    refuse = {"above": 1}

    def check(plan, group=None, device=None):
        if len(plan.entries) > refuse["above"]:
            raise ValueError("DistributedShampoo: refused (test)")

    monkeypatch.setattr(agreement, "check", check)
    param = torch.nn.Parameter(torch.ones(4, 3))
    opt = DistributedShampoo([param], lr=0.1)
    opt.distributor = distributor = _Checked()
    param.grad = torch.ones(4, 3)
    opt.step()
    layout, state = opt._layout, {k: dict(v) for k, v in opt.state_dict()["state"].items()}
    extra = torch.nn.Parameter(torch.ones(2, 2))
    with pytest.raises(ValueError, match="refused"):
        opt.add_param_group({"params": [extra]})
    assert len(opt.param_groups) == 1 and len(opt._constructed) == 1
    assert opt._layout is layout and len(layout.plan.entries) == 1 and layout.plan.agreed
    assert opt.distributor is distributor
    for index, entry in opt.state_dict()["state"].items():
        assert all(torch.equal(t, state[index][k]) for k, t in entry.items())
    # a rebuild (the parameters swapped, as Accelerate does) that is refused
    refuse["above"] = 0
    opt.param_groups[0]["params"] = [torch.nn.Parameter(torch.ones(4, 3))]
    with pytest.raises(ValueError, match="refused"):
        opt._ensure_layout()
    assert opt._layout is layout and opt.distributor is distributor
