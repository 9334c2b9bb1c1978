"""Two simulated machines for tests/test_multi_node.py: run by ``torchrun --nnodes 2
--nproc_per_node 2`` twice at once on one machine (``helpers.torchrun_nodes``), 4 ranks.

Each rank reports where the launcher put it (``GROUP_RANK``, ``LOCAL_RANK`` and which
launcher started it), then trains, against the single-process gradients:

- DDP: ``distributed_worker``'s replicated scenarios (every rank the same gradients, the
  blocks spread over the 4 ranks of both nodes) and a ``DistributedDataParallel`` model;
- FSDP2 over all 4 ranks (a 1-D mesh, each parameter's rows on both nodes);
- HSDP on a 2x2 ``("replicate", "shard")`` mesh: shards within a node, replicas across
  the nodes (the groups each rank sees are reported, for the test to check that mapping),
  and a ``fully_shard`` model with backward on that mesh.

``python tests/multi_node_worker.py OUT_DIR`` writes ``OUT_DIR/rank{R}.pt`` per rank.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import distributed_worker as ddp_worker  # noqa: E402
from tests import sharded_worker  # noqa: E402
from tests.helpers import leave_gloo_world  # noqa: E402

# a spread of kinds: Shampoo, 4-bit eigenvalue-corrected, Muon with Adam vectors,
# schedule-free SOAP, bf16 communication (close to one process, not equal)
DDP_SCENARIOS = ("shampoo_adam", "eigen_qr_4bit", "muon", "schedule_free_soap",
                 "bf16_communication")
SHARDED_SCENARIOS = ("shampoo_adam", "eigen_qr_4bit", "muon", "diagonal_adam",
                     "schedule_free_soap", "bf16_communication")


def where_am_i() -> dict:
    """This rank as the launcher placed it, gathered from every rank: [{rank, node
    (GROUP_RANK), local_rank, launcher (HF_SHAMPOO_TEST_NODE)}]."""
    me = {"rank": dist.get_rank(), "node": int(os.environ["GROUP_RANK"]),
          "local_rank": int(os.environ["LOCAL_RANK"]),
          "local_world": int(os.environ["LOCAL_WORLD_SIZE"]),
          "launcher": int(os.environ["HF_SHAMPOO_TEST_NODE"])}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    return everyone


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict = {"world": world}
    try:
        results["placement"] = where_am_i()
        for name in DDP_SCENARIOS:
            params, opt = ddp_worker.train(ddp_worker.SCENARIOS[name])
            results[f"ddp_{name}"] = {"params": [p.detach().clone() for p in params],
                                      "kind": type(opt._distributor).__name__}
        results["ddp_model"] = ddp_worker._ddp_scenario(rank, world)

        meshes = {"fsdp": init_device_mesh("cpu", (world,)),
                  "hsdp": init_device_mesh("cpu", (2, world // 2),
                                           mesh_dim_names=("replicate", "shard"))}
        hsdp = meshes["hsdp"]
        results["hsdp_groups"] = {dim: dist.get_process_group_ranks(hsdp.get_group(dim))
                                  for dim in ("replicate", "shard")}
        for mesh_name, mesh in meshes.items():
            for name in SHARDED_SCENARIOS:
                params, opt = sharded_worker.train(mesh, sharded_worker.SCENARIOS[name])
                results[f"{mesh_name}_{name}"] = {
                    "params": [sharded_worker.full(p) for p in params],
                    "kind": type(opt._distributor).__name__,
                    "state_numel": sharded_worker.state_numel(opt)}
        model: dict = {}
        sharded_worker._fully_shard_model(hsdp, model)
        results["hsdp_model"] = model["model"]
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        results["error"] = traceback.format_exc()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_gloo_world()  # no rank tears gloo down while another still talks to it


if __name__ == "__main__":
    main(sys.argv[1])
