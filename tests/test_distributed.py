"""Data-parallel Shampoo on CPU with gloo (docs/design.md §4): 2 and 3 ranks against one process.

One spawn per world size runs every scenario of ``distributed_worker.py``; the tests
compare its per-rank results with single-process runs made here. The planning that needs no
process group (owner assignment, refusals, frozen parameters in one process) is tested in
tests/test_planning.py.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from hf_shampoo import DistributedShampoo
from hf_shampoo.checkpoint import consolidate_checkpoint, load_sharded
from tests import distributed_worker as worker
from tests.helpers import assert_bitwise, one_thread_per_process

pytestmark = pytest.mark.distributed

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def runs():
    """{world: [rank results]} for worlds 2 and 3 (world 3 resumes world 2's checkpoint)."""
    root = tempfile.mkdtemp(prefix="hf_shampoo_dist_")
    out = {}
    with one_thread_per_process():
        for world, resume in ((2, None), (3, os.path.join(root, "w2", "sharded2"))):
            out_dir = os.path.join(root, f"w{world}")
            os.makedirs(out_dir)
            mp.spawn(worker.run_world,
                     args=(world, os.path.join(root, f"init{world}"), out_dir, resume),
                     nprocs=world, join=True)
            out[world] = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                          for r in range(world)]
    out["root"] = root
    return out




EXACT = [name for name in worker.SCENARIOS if name != "bf16_communication"]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("scenario", EXACT)
def test_bit_identical_to_one_process(runs, world, scenario):
    expected, _ = worker.train(worker.SCENARIOS[scenario])
    for rank_result in runs[world]:
        assert rank_result[scenario]["kind"] == "DataParallelDistributor"
        assert_bitwise(rank_result[scenario]["params"], [p.detach() for p in expected])


@pytest.mark.parametrize("world", [2, 3])
def test_bf16_communication_close_to_one_process(runs, world):
    expected, _ = worker.train(worker.SCENARIOS["bf16_communication"])
    for rank_result in runs[world]:
        for got, want in zip(rank_result["bf16_communication"]["params"], expected):
            # each step's update is rounded to bf16 (8 bits of mantissa): |Δ| ≤ 2^-8 |lr·P|
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=5e-4)
    # and the ranks agree with each other exactly
    first = runs[world][0]["bf16_communication"]["params"]
    for rank_result in runs[world][1:]:
        assert_bitwise(rank_result["bf16_communication"]["params"], first)


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_holds_about_its_share_of_the_state(runs, world):
    _, opt = worker.train(worker.SCENARIOS["shampoo_adam"])
    total = worker.state_numel(opt.state_dict())
    shares = [r["shampoo_adam"]["state_numel"] for r in runs[world]]
    assert sum(shares) == total
    assert max(shares) <= 1.25 * total / world
    # with groups of one trainer every rank holds everything
    assert all(r["trainers_per_group_1"]["state_numel"] == total for r in runs[world])


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_without_blocks_still_step(runs, world):
    expected, _ = worker.train(worker.SCENARIOS["shampoo_adam"], shapes=[(3,)])
    numels = [r["one_block"]["state_numel"] for r in runs[world]]
    assert sorted(numels)[:-1] == [0] * (world - 1) and numels[0] > 0
    for rank_result in runs[world]:
        assert_bitwise(rank_result["one_block"]["params"], [p.detach() for p in expected])


@pytest.mark.parametrize("world", [2, 3])
def test_one_ranks_shard_is_refused_by_other_ranks(runs, world):
    assert runs[world][0]["foreign_shard"] == "loaded"
    for rank_result in runs[world][1:]:
        assert "holds only the blocks of rank 0" in rank_result["foreign_shard"]
        assert "consolidate_state_dict" in rank_result["foreign_shard"]


def test_consolidated_state_equals_one_process_state(runs):
    _, opt = worker.train(worker.SCENARIOS["eigen_qr"])
    expected = opt.state_dict()
    for world in (2, 3):
        for got in (runs[world][0]["consolidated"], runs[world][-1]["consolidated"]):
            assert got["shard"]["complete"]
            assert set(got["state"]) == set(expected["state"])
            for index, entry in expected["state"].items():
                assert set(got["state"][index]) == set(entry)
                for key, tensor in entry.items():
                    assert torch.equal(got["state"][index][key], tensor), (index, key)
        assert all(r["consolidated"] is None for r in runs[world][1:-1])


@pytest.mark.parametrize("name", worker.CHECKPOINTED)
def test_sharded_checkpoint_resumes_on_one_and_three_ranks(runs, name):
    config = worker.SCENARIOS[name]
    uninterrupted = runs[2][0][f"uninterrupted_{name}"]
    for rank_result in runs[2]:
        assert_bitwise(rank_result[f"uninterrupted_{name}"], uninterrupted)
    # saved on 2 ranks, resumed on 3
    for rank_result in runs[3]:
        assert_bitwise(rank_result[f"resumed_{name}"], uninterrupted)
    # saved on 2 ranks, resumed in one process
    directory = os.path.join(runs["root"], "w2", f"sharded2_{name}")
    params = [torch.nn.Parameter(t) for t in
              torch.load(os.path.join(directory, "params.pt"), weights_only=True)]
    opt = worker.optimizer_for(params, config)
    load_sharded(opt, directory)
    worker.train(config, steps=3, params=params, optimizer=opt, first_step=4)
    assert_bitwise([p.detach() for p in params], uninterrupted)


@pytest.mark.parametrize("name", worker.CHECKPOINTED)
def test_consolidated_checkpoint_file_resumes_in_one_process(runs, tmp_path, name):
    config = worker.SCENARIOS[name]
    directory = os.path.join(runs["root"], "w3", f"sharded3_{name}")  # saved on 3 ranks
    consolidate_checkpoint(directory, tmp_path / "optimizer.pt")
    params = [torch.nn.Parameter(t) for t in
              torch.load(os.path.join(directory, "params.pt"), weights_only=True)]
    opt = worker.optimizer_for(params, config)
    opt.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    worker.train(config, steps=3, params=params, optimizer=opt, first_step=4)
    assert_bitwise([p.detach() for p in params], runs[3][0][f"uninterrupted_{name}"])


@pytest.mark.parametrize("scenario", ["ddp", "accelerate"])
def test_wrapped_models_stay_identical_across_ranks(runs, scenario):
    for world in (2, 3):
        results = [r[scenario] for r in runs[world]]
        assert all(r["kind"] == "DataParallelDistributor" for r in results)
        for r in results[1:]:
            assert_bitwise(r["params"], results[0]["params"])
    # and match one process on the full batch up to all-reduce rounding
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = DistributedShampoo(model.parameters(), **worker.WRAPPED_CONFIG)
    data = torch.Generator().manual_seed(7)
    x, y = torch.randn(24, 6, generator=data), torch.randn(24, 2, generator=data)
    for _ in range(4):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    for got, want in zip(runs[2][0][scenario]["params"], model.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-5)




@pytest.mark.parametrize("world", [2, 3])
def test_a_non_finite_factor_stops_every_rank_and_moves_nothing(runs, world):
    got = [r["nan"] for r in runs[world]]
    assert all(r["message"] != "stepped" and "no parameter was changed" in r["message"]
               for r in got)
    assert any("param 1 (shape (40, 20))" in r["message"] for r in got)  # the owner names it
    assert all(r["unchanged"] for r in got)


@pytest.mark.parametrize("world", [2, 3])
def test_a_non_finite_gradient_stops_every_rank_between_refreshes(runs, world):
    got = [r["nan_grad"] for r in runs[world]]
    assert all("non-finite gradient" in r["message"] and "param 2 (shape" in r["message"]
               and "step 3" in r["message"] for r in got), got
    assert all(r["unchanged"] and r["step"] == 2 for r in got)


@pytest.mark.parametrize("world", [2, 3])
def test_frozen_parameters_under_ddp_match_one_process(runs, world):
    expected, opt, blocks = worker.train_frozen(worker.SCENARIOS["shampoo_adam"])
    for rank_result in runs[world]:
        got = rank_result["frozen"]
        assert_bitwise(got["params"], [p.detach() for p in expected])
        assert got["blocks"] == blocks
        assert got["state"] == sorted(opt.state_dict()["state"])
