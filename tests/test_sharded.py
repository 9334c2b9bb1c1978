"""FSDP2 / HSDP Shampoo on CPU with gloo (docs/design.md §8): 2 and 3 ranks on a 1-D mesh and a 2x2
HSDP mesh on 4 ranks, each against one process.

One spawn per mesh runs every scenario of ``sharded_worker.py``; the 3-rank run resumes
the 2-rank run's checkpoint and the HSDP run the 3-rank one's, through
``torch.distributed.checkpoint`` and its ``get/set_optimizer_state_dict`` helpers. The
planning that needs no process group (shards as boxes, the assignment) is tested in
tests/test_planning.py.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from hf_shampoo import DistributedShampoo
from tests import sharded_worker as worker
from tests.helpers import (
    assert_bitwise,
    assert_rounded_runs_close_and_identical,
    assert_sharded_ranks_bitwise,
    exact_scenarios,
    one_thread_per_process,
)

pytestmark = pytest.mark.distributed

torch.set_num_threads(1)
MESHES = {"w2": (2, False, None), "w3": (3, False, "w2"), "hsdp": (4, True, "w3")}


@pytest.fixture(scope="module")
def runs():
    root = tempfile.mkdtemp(prefix="hf_shampoo_fsdp_")
    out = {}
    with one_thread_per_process():
        for name, (world, hsdp, resume) in MESHES.items():
            out_dir = os.path.join(root, name)
            os.makedirs(out_dir)
            resume_dir = None
            if resume is not None:
                resume_dir = os.path.join(root, resume, f"dcp{MESHES[resume][0]}")
            mp.spawn(worker.run_world,
                     args=(world, os.path.join(root, f"init_{name}"), out_dir, resume_dir, hsdp),
                     nprocs=world, join=True)
            out[name] = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                         for r in range(world)]
    for name, results in out.items():
        errors = [r["error"] for r in results if "error" in r]
        assert not errors, f"{name}: {errors[0]}"
    return out




EXACT = exact_scenarios(worker.SCENARIOS)


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("scenario", EXACT)
def test_bit_identical_to_one_process(runs, mesh, scenario):
    assert_sharded_ranks_bitwise(runs[mesh], scenario,
                                 worker.train_one_process(worker.SCENARIOS[scenario]))


@pytest.mark.parametrize("mesh", list(MESHES))
def test_rounded_communication_close_and_identical_across_ranks(runs, mesh):
    assert_rounded_runs_close_and_identical(
        runs[mesh], lambda scenario: worker.train_one_process(worker.SCENARIOS[scenario]))


@pytest.mark.parametrize("mesh", list(MESHES))
def test_each_rank_holds_its_share_of_the_state(runs, mesh):
    params = [torch.nn.Parameter(t) for t in worker.full_params()]
    opt = DistributedShampoo(params, **worker.SCENARIOS["shampoo_adam"])
    for p, g in zip(params, worker.full_grads(1)):
        p.grad = g
    opt.step()
    total = sum(t.numel() for e in opt.state_dict()["state"].values() for t in e.values())
    shares = [r["shampoo_adam"]["state_numel"] for r in runs[mesh]]
    assert sum(shares) == total  # every block once, on one rank of the whole mesh
    assert max(shares) <= 1.6 * total / len(shares)  # tiny model: a few blocks per rank


@pytest.mark.parametrize("mesh", list(MESHES))
def test_every_rank_moves_some_bytes_and_only_rows_it_lacks(runs, mesh):
    # gradients + directions of the rows whose owner does not hold them: far less than
    # all-gathering every parameter (Σ numel · world) and sending it back
    numel = sum(t.numel() for t in worker.full_params())
    for rank_result in runs[mesh]:
        sent_and_received = rank_result["shampoo_adam"]["bytes"]
        assert 0 < sent_and_received < 2 * 4 * numel


def _every_rank_as_one_process(runs, mesh: str, result: str, name: str) -> None:
    """Every rank's ``result`` of scenario ``name`` equals six steps of one process, bit for
    bit."""
    expected = worker.train_one_process(worker.SCENARIOS[name], steps=6)
    for rank_result in runs[mesh]:
        assert_bitwise(rank_result[f"{result}_{name}"], expected)


@pytest.mark.parametrize("name", worker.CHECKPOINTED)
@pytest.mark.parametrize("mesh", list(MESHES))
def test_saving_through_dcp_helpers_does_not_change_the_trajectory(runs, mesh, name):
    _every_rank_as_one_process(runs, mesh, "dcp_uninterrupted", name)
    keys = [set(r[f"saved_keys_{name}"]) for r in runs[mesh]]
    assert set().union(*keys) == {f"p{i}" for i in range(len(worker.SHAPES))}


@pytest.mark.parametrize("name", worker.CHECKPOINTED)
@pytest.mark.parametrize("mesh", ["w3", "hsdp"])
def test_sharded_checkpoint_resumes_at_another_world_size(runs, mesh, name):
    _every_rank_as_one_process(runs, mesh, "dcp_resumed", name)


@pytest.mark.parametrize("name", worker.CHECKPOINTED)
@pytest.mark.parametrize("mesh", list(MESHES))
def test_full_state_dict_after_consolidation_round_trips(runs, mesh, name):
    _every_rank_as_one_process(runs, mesh, "full_resumed", name)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_a_non_finite_factor_stops_every_rank_and_moves_nothing(runs, mesh):
    runs_nan = [r["nan"] for r in runs[mesh]]
    assert all(r["message"] != "stepped" for r in runs_nan)
    assert any("'group 0 param 1 (shape (40, 20))'" in r["message"] for r in runs_nan)
    assert all("no parameter was changed" in r["message"] and r["unchanged"] for r in runs_nan)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_a_non_finite_gradient_shard_stops_every_rank_between_refreshes(runs, mesh):
    for key in ("nan_grad", "local_nan_grad"):  # lossless, then fsdp_mode="local"
        got = [r[key] for r in runs[mesh]]
        assert all("non-finite gradient" in r["message"] and "step 3" in r["message"]
                   and r["unchanged"] and r["step"] == 2 for r in got), (key, got)
        assert any("(shape (40, 20))" in r["message"] for r in got)  # its holder names it
    assert all("'group 0 param 1 (shape (40, 20))'" in r["nan_grad"]["message"]
               for r in runs[mesh])


@pytest.mark.parametrize("mesh", list(MESHES))
def test_local_mode_is_one_process_on_each_local_shard(runs, mesh):
    world = len(runs[mesh])
    shards = 2 if mesh == "hsdp" else world
    config = dict(worker.SCENARIOS["shampoo_adam"])
    for rank, rank_result in enumerate(runs[mesh]):
        assert rank_result["local_kind"] == "LocalShardDistributor"
        shard = rank % shards
        local_params = []
        for i, tensor in enumerate(worker.full_params()):
            local = tensor if i in worker.PLAIN else tensor.tensor_split(
                [min(k * -(-tensor.shape[0] // shards), tensor.shape[0])
                 for k in range(1, shards)])[shard]
            local_params.append(torch.nn.Parameter(local.clone()))
        opt = DistributedShampoo(local_params, **config)
        for step in range(1, worker.STEPS + 1):
            for i, (p, g) in enumerate(zip(local_params, worker.full_grads(step))):
                if g is not None and i not in worker.PLAIN:
                    g = g.tensor_split([min(k * -(-g.shape[0] // shards), g.shape[0])
                                        for k in range(1, shards)])[shard]
                p.grad = None if g is None else g.clone()
            opt.step()
        assert_bitwise(rank_result["local_params"], [p.detach() for p in local_params])
        assert all(k.startswith(f"shard{shard}of{shards}.block_")
                   for k in rank_result["local_state_keys"])


@pytest.mark.parametrize("mesh", list(MESHES))
def test_fully_shard_model_with_backward_and_clipping(runs, mesh):
    from tests.distributed_worker import WRAPPED_CONFIG

    results = [r["model"] for r in runs[mesh]]
    world = len(results)
    for r in results:
        assert r["kind"] == "ShardedDistributor"
        assert_bitwise(r["params"], results[0]["params"])
    # one process on the whole batch (the ranks' equal-size shards average to it)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))
    assert_bitwise([p.detach() for p in model.parameters()], results[0]["initial"])
    opt = DistributedShampoo(model.parameters(), **WRAPPED_CONFIG)
    data = torch.Generator().manual_seed(7)
    x, y = torch.randn(4 * world, 6, generator=data), torch.randn(4 * world, 3, generator=data)
    replicas = 2 if mesh == "hsdp" else 1
    del replicas  # HSDP averages over replicas too: the same full batch
    worker.ddp_worker.train_wrapped(model, opt, x, y)
    for got, want in zip(results[0]["params"], model.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-5)
@pytest.mark.parametrize("mesh", list(MESHES))
def test_frozen_parameters_sharded_match_one_process(runs, mesh):
    """Frozen parameters get no blocks or state on any rank; one unfrozen at step 3 gets
    them then; the parameters are bit-identical to one process."""
    frozen = {worker.ddp_worker.FROZEN}
    expected, opt, blocks = worker.ddp_worker.train_frozen(
        worker.SCENARIOS["shampoo_adam"], params=[torch.nn.Parameter(t.clone())
                                                  for t in worker.full_params()],
        set_step_grads=lambda params, step, no_grad: [
            setattr(p, "grad", g)
            for p, g in zip(params, worker.full_grads(step, no_grad=no_grad))])
    for rank_result in runs[mesh]:
        got = rank_result["frozen"]
        assert_bitwise(got["params"], [p.detach() for p in expected])
        assert got["blocks"] == blocks and not frozen & set(blocks[-1])
        assert got["state"] == sorted(opt.state_dict()["state"])
