"""Ranks that hold different parameters (pipeline stages), or the same parameters with
different settings, are refused with DistributedShampoo's own error on every rank, never a
gloo abort, a hang or replicas trained with a mix of settings (docs/parallelism.md#limits,
``distributors/agreement.py``).

One spawn per world size (2 and 3 ranks, gloo) runs every scenario of
``ranks_worker.py``; a spawn that outlives its deadline (a hang) or loses a rank to a signal
(an abort) fails the tests. ``agreement``'s messages and the single-process checks are
tested in tests/test_planning.py.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch.multiprocessing as mp

from tests import ranks_worker as worker
from tests.helpers import one_thread_per_process

pytestmark = pytest.mark.distributed

DEADLINE = 120  # seconds for one world's spawn: many times what it takes (15 s), and a
# hang never ends
WAY_OUT = ("process_group=", "docs/parallelism.md#pipeline-parallel")


def spawn_within(world: int, root: str) -> list[dict]:
    """Every rank's results; fails on a rank killed by a signal (an abort) or still
    running after ``DEADLINE`` seconds (a hang: the ranks are killed)."""
    context = mp.spawn(worker.run_world, args=(world, os.path.join(root, "init"), root),
                       nprocs=world, join=False)
    deadline = time.monotonic() + DEADLINE
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{world} ranks still running after {DEADLINE} s: a hang")
    return [json.load(open(os.path.join(root, f"rank{r}.json"))) for r in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    with one_thread_per_process():
        for world in (2, 3):
            out[world] = spawn_within(world, str(tmp_path_factory.mktemp(f"w{world}")))
    return out


def refused(results: list[dict], scenario: str) -> list[str]:
    """Every rank's error in ``scenario``: a ValueError, nothing changed (parameters,
    optimizer state, step counts)."""
    got = [r[scenario] for r in results]
    assert all(g["outcome"].startswith("ValueError: DistributedShampoo") for g in got), got
    assert all(g["unchanged"] for g in got), got
    return [g["outcome"] for g in got]


def test_pipeline_stages_are_refused_on_both_ranks(runs):
    messages = refused(runs[2], "pipeline_plain")
    for rank, message in enumerate(messages):
        assert "rank 1 holds different parameters from rank 0" in message
        assert "rank 0 holds 4 parameters to optimize, of shapes [(8, 6), (8,), (8, 8), (8,)]" \
            in message
        assert "rank 1 holds 4 parameters to optimize, of shapes [(4, 8), (4,), (2, 4), (2,)]" \
            in message
        assert "parameter 0 '0.weight' of shape (4, 8) float32 there" in message
        assert f"This is rank {rank}; nothing was changed" in message
        assert all(way in message for way in WAY_OUT), message
    assert all(r["pipeline_plain"]["kind"] == "DataParallelDistributor" for r in runs[2])
    # the check is not spent: the next step refuses again
    assert [r["pipeline_plain"]["again"] for r in runs[2]] == messages


def test_distributed_none_per_stage_steps(runs):
    assert all(r["pipeline_none"]["outcome"] == "stepped" for r in runs[2])
    assert all(r["pipeline_none"]["kind"] == "SingleProcessDistributor" for r in runs[2])


def test_a_layout_built_on_one_rank_first_is_still_checked_at_the_step(runs):
    messages = refused(runs[2], "described_first")
    assert all("rank 1 holds different parameters from rank 0" in m for m in messages)


def test_sharded_stages_on_sub_meshes_of_their_own_step_over_their_meshes(runs):
    """A stage fully_shard'ed on the ``dp`` sub-mesh of a ``(pp, dp)`` mesh is spread over
    its stage's ranks (here one each): nothing is exchanged with the other stage, and it
    steps."""
    for world in (2, 3):
        for scenario in ("pipeline_sharded", "pipeline_sharded_local"):
            if scenario not in runs[world][0]:
                continue
            assert all(r[scenario]["outcome"] == "stepped" for r in runs[world]), scenario
    assert all(r["pipeline_sharded"]["kind"] == "ShardedDistributor" for r in runs[2])
    assert all(r["pipeline_sharded_local"]["kind"] == "LocalShardDistributor" for r in runs[2])


def test_three_ranks_name_the_one_that_differs(runs):
    for rank, message in enumerate(refused(runs[3], "pipeline_plain")):
        assert "rank 2 holds different parameters from ranks 0, 1" in message
        assert "ranks 0, 1 hold 4 parameters to optimize" in message
        assert "Rank 2 differs from rank 0 first at its parameter 0" in message
        assert f"This is rank {rank};" in message


def test_ranks_holding_the_same_parameters_step(runs):
    for world in (2, 3):
        assert all(r["equal"] == {"outcome": "stepped", "unchanged": False,
                                  "kind": "DataParallelDistributor"} for r in runs[world])


def test_the_same_parameters_blocked_otherwise_are_refused(runs):
    for rank, message in enumerate(refused(runs[2], "settings")):
        assert message.startswith(
            "ValueError: DistributedShampoo: ranks of the process group differ in parameter "
            "group 0's setting 'max_preconditioner_dim': rank 0 has 1024, rank 1 has 4."), \
            message
        assert f"This is rank {rank}; nothing was changed." in message


SETTINGS = [  # scenario, keyword, rank 0's value, rank 1's, as the error shows them
    ("kind_soap", "preconditioner", "'shampoo'", "'eigenvalue_corrected'"),
    ("kind_kl", "preconditioner", "'kl_shampoo'", "'shampoo'"),
    ("grafting", "grafting", "'adam'", "'rmsprop'"),
    ("lr", "lr", "0.01", "0.5"),
    ("epsilon", "epsilon", "1e-12", "1e-10"),
    ("weight_decay", "weight_decay", "0.0", "0.01"),
    ("betas", "betas", "(0.9, 1.0)", "(0.9, 0.999)"),
    ("tensor_lr", "lr", "0.25", "0.5"),
]


@pytest.mark.parametrize("scenario,key,first,second", SETTINGS)
def test_the_same_parameters_with_different_settings_are_refused(runs, scenario, key, first,
                                                                 second):
    """One rank with another kind, grafting, lr, epsilon, ... than the other: refused at
    the first step on both, naming the setting and both values, nothing changed."""
    for rank, message in enumerate(refused(runs[2], scenario)):
        assert message.startswith(
            "ValueError: DistributedShampoo: ranks of the process group differ in parameter "
            f"group 0's setting {key!r}: rank 0 has {first}, rank 1 has {second}"), message
        assert f"This is rank {rank}; nothing was changed." in message
        assert "holds different parameters" not in message


def test_settings_that_agree_step(runs):
    """Tensor learning rates alike, and ``lr=1`` next to ``lr=1.0``: the same numbers."""
    for scenario in ("tensor_lr_same", "int_and_float_lr"):
        assert [r[scenario]["outcome"] for r in runs[2]] == ["stepped"] * 2, scenario


def test_a_group_added_with_other_settings_is_refused_keeping_the_state(runs):
    """Two steps alike, then a group of the same shape everywhere, with another epsilon on
    rank 0: the next step refuses on both, the first steps' state untouched."""
    assert all(r["differing_after_steps"]["first"] == ["stepped"] * 2 for r in runs[2])
    for message in refused(runs[2], "differing_after_steps"):
        assert ("differ in parameter group 1's setting 'epsilon': rank 0 has 1e-06, rank 1 "
                "has 1e-12") in message, message


def test_settings_are_compared_as_they_are_at_the_check(runs):
    """A layout built on rank 0 alone before a schedule changed ``lr``, and a layout
    extended after a schedule step, compare every rank's ``lr`` of that moment: no rank
    is refused."""
    got = [r["scheduled"] for r in runs[2]]
    assert [g["first"] for g in got] == ["stepped"] * 2, got
    assert [g["outcome"] for g in got] == ["stepped"] * 2, got
    assert [g["lr"] for g in got] == [[0.05, 0.1]] * 2, got


def test_a_stage_whose_ranks_differ_in_settings_is_refused_on_its_ranks(runs):
    """``process_group=`` each stage's group (ranks [0, 1] and [2]): SOAP on rank 0 and
    Shampoo on rank 1, or two learning rates, are refused on both ranks of the first stage
    (global ranks named); the last stage, alone, steps."""
    for scenario, key, first, second in [
            ("stage_groups_kind", "preconditioner", "'eigenvalue_corrected'", "'shampoo'"),
            ("stage_groups_lr", "lr", "0.5", "0.01")]:
        got = [r[scenario] for r in runs[3]]
        assert got[2]["outcome"] == "stepped", got
        for rank, result in enumerate(got[:2]):
            assert result["unchanged"], result
            assert result["outcome"].startswith(
                "ValueError: DistributedShampoo: ranks of the process group differ in "
                f"parameter group 0's setting {key!r}: rank 0 has {first}, rank 1 has "
                f"{second}"), result
            assert f"This is rank {rank};" in result["outcome"]


def test_groups_added_with_different_shapes_are_refused_at_the_next_step(runs):
    assert all(r["added_group"]["first"] == "stepped" for r in runs[2])
    for message in refused(runs[2], "added_group"):
        assert "agree on their first 4 parameters" not in message
        assert "parameter 4 of shape (3, 3) float32 there" in message


@pytest.mark.parametrize("scenario", ["no_mesh", "no_mesh_world_group"])
def test_a_parameter_held_by_no_mesh_on_some_rank_of_the_group_is_refused_everywhere(
        runs, scenario):
    """A parameter on ranks [0, 1], and rank 2 in the group (the world, by default or
    named) holding none of it: on every rank the same error."""
    for message in refused(runs[3], scenario):
        assert "held by no mesh on ranks [2] (its mesh has ranks [0, 1])" in message
        assert "the group its blocks are spread over (the world)" in message
        assert all(way in message for way in WAY_OUT), message


def test_stages_over_groups_of_their_own_step(runs):
    """``process_group=`` the stage's group (ranks [0, 1] and [2]): the stages hold
    different parameters and step, each over its own group."""
    got = [r["stage_groups"] for r in runs[3]]
    assert [g["outcome"] for g in got] == ["stepped"] * 3, got
    assert [g["kind"] for g in got] == ["DataParallelDistributor"] * 2 + [
        "SingleProcessDistributor"]


def test_refusals_name_the_group_and_the_rank(runs):
    results = runs[3]
    # trainer groups inside a stage's group would need groups of some ranks only
    got = [r["stage_groups_trainers"]["outcome"] for r in results]
    for outcome in got[:2]:
        assert outcome.startswith(
            "ValueError: DistributedShampoo: num_trainers_per_group=1 with a process_group of "
            "ranks [0, 1] is not supported: pass the trainer group itself as process_group"), \
            outcome
    assert got[2] == "stepped"
    # trainer groups of 2 do not divide the last stage's group of 1 rank
    got = [r["stage_groups_trainers_2"]["outcome"] for r in results]
    assert got[:2] == ["stepped", "stepped"], got
    assert got[2].startswith("ValueError: DistributedShampoo: num_trainers_per_group=2 must "
                             "divide the process_group's size (ranks [2]) 1"), got[2]
    # distributed="none" and a group say two different things
    for r in results:
        assert "process_group is given with distributed='none'" in \
            r["stage_groups_none"]["outcome"]
    # a group without this rank: refused there, at construction; the group's ranks step
    got = [r["group_without_rank"]["outcome"] for r in results]
    assert got[:2] == ["stepped", "stepped"], got
    assert got[2] == ("ValueError: DistributedShampoo: process_group does not contain this "
                      "rank (2) (torch.distributed.new_group returned "
                      "GroupMember.NON_GROUP_MEMBER here); give each rank the group it "
                      "trains in"), got[2]
    # a parameter whose mesh reaches outside the group: every rank refuses, at construction
    for rank, r in enumerate(results):
        outcome = r["mesh_outside_group"]["outcome"]
        outside = "[2]" if rank < 2 else "[0, 1]"
        assert outcome.startswith("ValueError: DistributedShampoo: parameter 'group 0 param 0 "
                                  "(shape (6, 3))' (shape (6, 3)) lives on a mesh of ranks "
                                  f"[0, 1, 2], which reaches ranks {outside} outside "
                                  "process_group"), outcome
    for r in results:
        assert r["two_dim_mesh"]["outcome"].startswith(
            "ValueError: DistributedShampoo: process_group is a 2-D DeviceMesh (dims "
            "('pp', 'dp')); it takes a ProcessGroup or a 1-D DeviceMesh")
