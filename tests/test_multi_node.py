"""Several machines, simulated on one: ``torchrun --nnodes 2 --nproc_per_node 2`` started
twice at once (nodes 0 and 1), meeting on 127.0.0.1, 4 ranks in all
(``multi_node_worker.py``). DDP over both nodes, FSDP2 over all 4 ranks and HSDP with
replicas across the nodes and shards within each, against one process, bit for bit.

Both rendezvous a cluster uses: ``c10d`` (``--rdzv-endpoint``; torch numbers the nodes in
the order it sorts them, ignoring ``--node-rank``) and ``static`` (``--master-addr``;
``GROUP_RANK`` is the ``--node-rank`` given).
"""

from __future__ import annotations

import pytest
import torch

from tests import distributed_worker as ddp_worker
from tests import multi_node_worker as worker
from tests import sharded_worker
from tests.helpers import assert_bitwise, torchrun_nodes

pytestmark = pytest.mark.distributed

torch.set_num_threads(1)

NODES, PER_NODE = 2, 2
RENDEZVOUS = ("c10d", "static")


@pytest.fixture(scope="module", params=RENDEZVOUS)
def runs(request, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp(f"nodes_{request.param}")
    torchrun_nodes("multi_node_worker.py", [str(out_dir)], NODES, PER_NODE, out_dir,
                   rendezvous=request.param)
    results = [torch.load(out_dir / f"rank{r}.pt", weights_only=False)
               for r in range(NODES * PER_NODE)]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    return request.param, results


def test_two_ranks_on_each_node(runs):
    """Ranks 0-1 on one node (one launcher), 2-3 on the other; with the static rendezvous
    the node is the ``--node-rank`` its launcher was given."""
    rendezvous, results = runs
    placement = results[0]["placement"]
    assert all(r["placement"] == placement for r in results)
    assert [p["rank"] for p in placement] == list(range(NODES * PER_NODE))
    for p in placement:
        assert (p["node"], p["local_rank"], p["local_world"]) == \
            (p["rank"] // PER_NODE, p["rank"] % PER_NODE, PER_NODE)
    launcher_of = {p["node"]: {q["launcher"] for q in placement if q["node"] == p["node"]}
                   for p in placement}
    assert sorted(len(v) for v in launcher_of.values()) == [1, 1]  # one launcher per node
    assert launcher_of[0] != launcher_of[1]
    if rendezvous == "static":
        assert all(p["launcher"] == p["node"] for p in placement)


def test_hsdp_replicates_across_the_nodes_and_shards_within_each(runs):
    _, results = runs
    node = {p["rank"]: p["node"] for p in results[0]["placement"]}
    for rank, result in enumerate(results):
        groups = result["hsdp_groups"]
        assert rank in groups["shard"] and rank in groups["replicate"]
        assert len(groups["shard"]) == len(groups["replicate"]) == 2
        assert {node[r] for r in groups["shard"]} == {node[rank]}  # within its node
        assert {node[r] for r in groups["replicate"]} == {0, 1}  # one replica per node


EXACT = [(layout, name) for layout, names in (
    ("ddp", worker.DDP_SCENARIOS), ("fsdp", worker.SHARDED_SCENARIOS),
    ("hsdp", worker.SHARDED_SCENARIOS)) for name in names if name != "bf16_communication"]


def one_process(layout: str, name: str) -> list[torch.Tensor]:
    if layout == "ddp":
        params, _ = ddp_worker.train(ddp_worker.SCENARIOS[name])
        return [p.detach() for p in params]
    return sharded_worker.train_one_process(sharded_worker.SCENARIOS[name])


@pytest.mark.parametrize(("layout", "scenario"), EXACT)
def test_bit_identical_to_one_process(runs, layout, scenario):
    expected = one_process(layout, scenario)
    kind = "DataParallelDistributor" if layout == "ddp" else "ShardedDistributor"
    for rank_result in runs[1]:
        got = rank_result[f"{layout}_{scenario}"]
        assert got["kind"] == kind
        assert_bitwise(got["params"], expected)


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "hsdp"])
def test_bf16_communication_close_to_one_process_and_identical_across_nodes(runs, layout):
    expected = one_process(layout, "bf16_communication")
    first = runs[1][0][f"{layout}_bf16_communication"]["params"]
    for rank_result in runs[1]:
        got = rank_result[f"{layout}_bf16_communication"]["params"]
        assert_bitwise(got, first)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=5e-4)


@pytest.mark.parametrize("layout", ["fsdp", "hsdp"])
@pytest.mark.parametrize("scenario", ["shampoo_adam", "muon"])
def test_every_block_has_its_state_once_on_the_two_nodes(runs, layout, scenario):
    params = [torch.nn.Parameter(t) for t in sharded_worker.full_params()]
    opt = ddp_worker.optimizer_for(params, sharded_worker.SCENARIOS[scenario],
                                   distributed="none")
    sharded_worker.train(None, sharded_worker.SCENARIOS[scenario], params=params,
                         optimizer=opt, set_grads=lambda params, step: [
                             setattr(p, "grad", g)
                             for p, g in zip(params, sharded_worker.full_grads(step))])
    shares = [r[f"{layout}_{scenario}"]["state_numel"] for r in runs[1]]
    assert sum(shares) == sharded_worker.state_numel(opt)
    assert all(shares)  # both nodes hold some of it


def test_wrapped_models_stay_identical_across_the_nodes(runs):
    """A DDP model and an HSDP ``fully_shard`` model with backward: the same parameters on
    every rank, close to one process on the whole batch (the all-reduce and the
    reduce-scatter round differently from a local sum)."""
    results = runs[1]
    for name, expected in (("ddp_model", ddp_worker.ddp_one_process(len(results))),
                           ("hsdp_model",
                            sharded_worker.fully_shard_one_process(len(results))[1])):
        for r in results:
            assert_bitwise(r[name]["params"], results[0][name]["params"])
        for got, want in zip(results[0][name]["params"], expected):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    initial, _ = sharded_worker.fully_shard_one_process(len(results))
    assert_bitwise(results[0]["hsdp_model"]["initial"], initial)
    assert results[0]["hsdp_model"]["kind"] == "ShardedDistributor"
    assert results[0]["ddp_model"]["kind"] == "DataParallelDistributor"

