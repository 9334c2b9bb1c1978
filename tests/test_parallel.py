"""Tensor parallel and ND-parallel meshes on CPU with gloo (docs/parallelism.md), each
against one process: FSDP2 on 4 ranks, tensor parallel on 2, FSDP2 x TP and HSDP x TP and
Accelerate's folded ``dp_shard_cp`` x TP on 4, HSDP x TP on 8.

One spawn per layout runs the scenarios of ``parallel_worker.py``; each layout resumes the
previous one's ``torch.distributed.checkpoint`` (FSDP2 4 → FSDP2 2 x TP 2 → HSDP x TP →
cp x TP → TP 2 → HSDP x TP on 8), and one process resumes TP 2's, consolidated.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from hf_shampoo import DistributedShampoo
from hf_shampoo.checkpoint import consolidate_checkpoint
from tests import distributed_worker as ddp_worker
from tests import helpers
from tests import parallel_worker as worker

pytestmark = pytest.mark.distributed

torch.set_num_threads(1)

EXACT = helpers.exact_scenarios(worker.SCENARIOS)
# every kind under TP alone and under FSDP2 x TP; a spread of kinds on the other meshes
FEW = ["shampoo_adam", "muon", "schedule_free_soap", "diagonal_adam", "eigen_qr_4bit",
       "sign_descent_l1", "bf16_communication"]
CHAIN = [  # (layout, scenarios, resumes which layout's checkpoint)
    ("fsdp4", FEW, None),
    ("fsdp2_tp2", list(worker.SCENARIOS), "fsdp4"),
    ("hsdp_tp", FEW, "fsdp2_tp2"),
    ("cp_tp", FEW, "hsdp_tp"),
    ("tp2", list(worker.SCENARIOS), "cp_tp"),
    ("hsdp_tp8", FEW, "tp2"),  # 8 ranks: 2 replicas x dp_shard 2 x tp 2
]
SCENARIOS_OF = {layout: scenarios for layout, scenarios, _ in CHAIN}


@pytest.fixture(scope="module")
def runs():
    root = tempfile.mkdtemp(prefix="hf_shampoo_tp_")
    out = {}
    with helpers.one_thread_per_process():
        for layout, scenarios, resume in CHAIN:
            out_dir = os.path.join(root, layout)
            os.makedirs(out_dir)
            resume_from = os.path.join(root, resume) if resume else None
            mp.spawn(worker.run_world,
                     args=(layout, os.path.join(root, f"init_{layout}"), out_dir, resume_from,
                           scenarios),
                     nprocs=worker.LAYOUTS[layout][0], join=True)
            out[layout] = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                           for r in range(worker.LAYOUTS[layout][0])]
    for layout, results in out.items():
        errors = [r["error"] for r in results if "error" in r]
        assert not errors, f"{layout}: {errors[0]}"
    out["root"] = root
    return out




CASES = [(layout, name) for layout, scenarios, _ in CHAIN for name in scenarios
         if name in EXACT]


@pytest.mark.parametrize("layout", list(SCENARIOS_OF))
def test_placement_boxes_are_where_torch_puts_the_local_shards(runs, layout):
    assert all(r["boxes_match"] for r in runs[layout])


@pytest.mark.parametrize(("layout", "scenario"), CASES)
def test_bit_identical_to_one_process(runs, layout, scenario):
    helpers.assert_sharded_ranks_bitwise(runs[layout], scenario,
                                         worker.train_one_process(worker.SCENARIOS[scenario]))


@pytest.mark.parametrize("layout", ["fsdp2_tp2", "tp2"])
def test_rounded_communication_close_and_identical_across_ranks(runs, layout):
    helpers.assert_rounded_runs_close_and_identical(
        runs[layout], lambda scenario: worker.train_one_process(worker.SCENARIOS[scenario]))


def _one_process_state(scenario: str) -> tuple[int, int]:
    """One process's state elements, in all and of its largest block."""
    params = [torch.nn.Parameter(t) for t in worker.sharded_worker.full_params(worker.SHAPES)]
    opt = ddp_worker.optimizer_for(params, worker.SCENARIOS[scenario], distributed="none")
    for p, g in zip(params, worker.sharded_worker.full_grads(1, worker.SHAPES)):
        p.grad = g
    opt.step()
    blocks: dict[tuple, int] = {}
    for index, entry in opt.state_dict()["state"].items():
        for key, tensor in entry.items():
            block = (index, key.split(".")[0])
            blocks[block] = blocks.get(block, 0) + tensor.numel()
    return sum(blocks.values()), max(blocks.values())


@pytest.mark.parametrize("layout", list(SCENARIOS_OF))
@pytest.mark.parametrize("scenario", ["shampoo_adam", "muon"])
def test_every_block_has_its_state_once_in_the_world(runs, layout, scenario):
    """Statistics, roots and orthogonalizations are computed once in the world, never per
    tensor-parallel rank: the ranks' state adds up to one process's, and no rank holds
    more than the mean (1.1x, the owners' capacity) and one block."""
    shares = [r[scenario]["state_numel"] for r in runs[layout]]
    total, largest = _one_process_state(scenario)
    assert sum(shares) == total
    assert max(shares) <= 1.1 * total / len(shares) + largest


@pytest.mark.parametrize("layout", list(SCENARIOS_OF))
def test_bytes_sent_are_those_the_layout_plans(runs, layout):
    """Gradient parts to owners and direction parts back (no weight decay in this
    scenario, so no parameter parts): measured in the step = computed from the plan, and
    less than every rank all-gathering every parameter."""
    numel = sum(t.numel() for t in worker.sharded_worker.full_params(worker.SHAPES))
    world = len(runs[layout])
    for rank_result in runs[layout]:
        got = rank_result["shampoo_adam"]
        assert got["bytes"] == got["planned"] > 0
        assert got["bytes"] < 2 * 4 * numel * (world - 1)


@pytest.mark.parametrize(("layout", "name"), [(layout, name) for layout, _, resume in CHAIN
                                              if resume for name in worker.CHECKPOINTED])
def test_checkpoint_resumes_under_another_mesh(runs, layout, name):
    expected = worker.train_one_process(worker.SCENARIOS[name], steps=6)
    for rank_result in runs[layout]:
        helpers.assert_bitwise(rank_result[f"resumed_{name}"], expected)


@pytest.mark.parametrize("layout", ["fsdp2_tp2", "tp2"])
def test_one_process_resumes_the_consolidated_checkpoint(runs, layout, tmp_path):
    config = worker.SCENARIOS["shampoo_adam"]
    saved = os.path.join(runs["root"], layout, f"sharded_{layout}")
    consolidate_checkpoint(saved, tmp_path / "optimizer.pt")
    params = [torch.nn.Parameter(t) for t in torch.load(os.path.join(saved, "params.pt"),
                                                        weights_only=True)]
    opt = DistributedShampoo(params, distributed="none", **config)
    opt.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    for step in range(4, 7):
        for p, g in zip(params, worker.sharded_worker.full_grads(step, worker.SHAPES)):
            p.grad = g
        opt.step()
    helpers.assert_bitwise([p.detach() for p in params],
                           worker.train_one_process(config, steps=6))


@pytest.mark.parametrize("layout", ["fsdp2_tp2", "hsdp_tp", "cp_tp", "tp2"])
def test_parallelize_module_and_fully_shard_with_backward(runs, layout):
    results = [r["model"] for r in runs[layout]]
    for r in results:
        assert r["kind"] == "ShardedDistributor"
        helpers.assert_bitwise(r["params"], results[0]["params"])
    assert any("Shard(dim=1)" in p for p in results[0]["placements"])  # rowwise weight
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    helpers.assert_bitwise([p.detach() for p in model.parameters()], results[0]["initial"])
    opt = DistributedShampoo(model.parameters(), **ddp_worker.WRAPPED_CONFIG)
    replicas = results[0]["replicas"]
    data = torch.Generator().manual_seed(7)
    x, y = torch.randn(4 * replicas, 6, generator=data), torch.randn(4 * replicas, 3,
                                                                      generator=data)
    ddp_worker.train_wrapped(model, opt, x, y)
    for got, want in zip(results[0]["params"], model.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-5)
