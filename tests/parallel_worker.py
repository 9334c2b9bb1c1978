"""Tensor-parallel and ND-parallel scenarios run on every rank of a gloo group for
tests/test_parallel.py (docs/parallelism.md).

Each layout places the parameters as torch's and Accelerate's parallelism does: tensor
parallel alone (``Shard(0)`` colwise, ``Shard(1)`` rowwise, ``Replicate()``), FSDP2 over
tensor parallel on a ``(dp_shard, tp)`` mesh (``_StridedShard`` where both shard dim 0),
HSDP x TP on ``(dp_replicate, dp_shard, tp)``, Accelerate's folded ``dp_shard_cp`` mesh,
expert parallel (an ``ep`` dim over the experts), parameters on sub-meshes and plain
parameters, all in one optimizer. Gradients are the single-process gradients of
``sharded_worker.full_grads`` placed like their parameters, so that the parameters can be
compared bit for bit with one process. ``run_world`` is the ``mp.spawn`` entry.
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from hf_shampoo.checkpoint import save_sharded
from hf_shampoo.distributors.placements import mesh_boxes
from tests import distributed_worker as ddp_worker
from tests import sharded_worker
from tests.helpers import join_gloo_world, leave_gloo_world

# the sharded scenarios' parameters, plus a fused-experts weight (4 experts of 6 x 5)
SHAPES = [*sharded_worker.SHAPES, (4, 6, 5)]
NO_GRAD = sharded_worker.NO_GRAD
STEPS = sharded_worker.STEPS
SCENARIOS = sharded_worker.SCENARIOS
CHECKPOINTED = ("shampoo_adam", "muon")


def _tp(mesh):
    return mesh["tp"]


# layout name → (world, mesh shape, mesh dim names, flatten, placements per parameter);
# a placement entry is (sub-mesh dim names or None for the whole mesh, placements), or
# None for a plain parameter. Parameter 3 (5, 4) and 6 (6, 2) are merged into one dim by
# small max_preconditioner_dim values, so a column shard of them is no box there.
COL, ROW = Shard(0), Shard(1)
LAYOUTS = {
    # FSDP2 alone on 4 ranks (where the checkpoint chain starts)
    "fsdp4": (4, (4,), ("dp_shard",), None, [(None, [COL])] * 5 + [None] + [(None, [COL])] * 2),
    # tensor parallel alone: colwise, rowwise, replicated, a conv's input channels
    "tp2": (2, (2,), ("tp",), None, [
        (None, [ROW]), (None, [COL]), (None, [Replicate()]), (None, [ROW]),
        (None, [COL]), None, (None, [ROW]), (None, [Shard(2)])]),
    # FSDP2 over TP, as fully_shard leaves a parallelize_module'd model; parameter 6 is
    # fully_shard'ed on the dp sub-mesh only (not tensor parallel), parameter 2 is tensor
    # parallel only (a sub-mesh on which dp replicas hold the same rows)
    "fsdp2_tp2": (4, (2, 2), ("dp_shard", "tp"), None, [
        (None, [COL, ROW]), (None, [_StridedShard(0, split_factor=2), COL]),
        (("tp",), [COL]), (None, [COL, ROW]), (None, [_StridedShard(0, split_factor=2), COL]),
        None, (("dp_shard",), [COL]), (None, [COL, Shard(1)])]),
    # HSDP x TP on a 3-D mesh (replicas of size 2, shards of size 1, TP 2)
    "hsdp_tp": (4, (2, 1, 2), ("dp_replicate", "dp_shard", "tp"), None, [
        (None, [Replicate(), COL, ROW]),
        (None, [Replicate(), _StridedShard(0, split_factor=2), COL]),
        (None, [Replicate(), COL, Replicate()]), (None, [Replicate(), COL, ROW]),
        (None, [Replicate(), COL, COL]), None, (None, [Replicate(), COL, Replicate()]),
        (None, [Replicate(), COL, Shard(1)])]),
    # HSDP x TP on 8 ranks: 2 replicas of a 2 x 2 FSDP2 x TP mesh
    "hsdp_tp8": (8, (2, 2, 2), ("dp_replicate", "dp_shard", "tp"), None, [
        (None, [Replicate(), COL, ROW]),
        (None, [Replicate(), _StridedShard(0, split_factor=2), COL]),
        (("dp_replicate", "dp_shard"), [Replicate(), COL]),
        (None, [Replicate(), COL, ROW]),
        (None, [Replicate(), _StridedShard(0, split_factor=2), COL]), None,
        (("tp",), [ROW]), (None, [Replicate(), COL, Shard(1)])]),
    # Accelerate's FSDP with context parallel: dp_shard and cp folded into dp_shard_cp; the
    # experts' weight expert-parallel over an ep dim of the same ranks
    "cp_tp": (4, (1, 2, 2), ("dp_shard", "cp", "tp"), ("dp_shard", "cp"), [
        (("dp_shard_cp", "tp"), [COL, ROW]),
        (("dp_shard_cp", "tp"), [_StridedShard(0, split_factor=2), COL]),
        (("dp_shard_cp",), [COL]), (("dp_shard_cp", "tp"), [Replicate(), ROW]),
        (("dp_shard_cp", "tp"), [COL, Replicate()]), None, (("tp",), [ROW]),
        (("dp_shard_cp", "tp"), [COL, Shard(0)])]),
}


def make_mesh(layout: str):
    _, shape, names, flatten, _ = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    if flatten is not None:
        mesh[flatten]._flatten("_".join(flatten))
    return mesh


def placement_of(mesh, layout: str, index: int):
    entry = LAYOUTS[layout][4][index]
    if entry is None:
        return None
    dims, placements = entry
    sub = mesh if dims is None else mesh[dims if len(dims) > 1 else dims[0]]
    return sub, placements


def place(tensor: torch.Tensor, mesh, layout: str, index: int) -> torch.Tensor:
    where = placement_of(mesh, layout, index)
    if where is None:
        return tensor
    return distribute_tensor(tensor, *where, src_data_rank=None)  # every rank has it


def params_for(mesh, layout: str, tensors=None) -> list[torch.nn.Parameter]:
    tensors = sharded_worker.full_params(SHAPES) if tensors is None else tensors
    return [torch.nn.Parameter(place(t, mesh, layout, i)) for i, t in enumerate(tensors)]


def set_grads(params, mesh, layout: str, step: int, no_grad=NO_GRAD) -> None:
    for i, (p, grad) in enumerate(zip(params, sharded_worker.full_grads(step, SHAPES,
                                                                         no_grad))):
        p.grad = None if grad is None else place(grad, mesh, layout, i)


def full(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, DTensor):
        return tensor.full_tensor().detach().clone()
    return tensor.detach().clone()


def train_one_process(config: dict, steps: int = STEPS):
    return sharded_worker.train_one_process(config, steps, SHAPES)


def train(mesh, layout: str, config: dict, steps: int = STEPS, params=None, optimizer=None,
          first_step: int = 1, between=None):
    """``sharded_worker.train`` with this layout's parameters and gradients."""
    params = params if params is not None else params_for(mesh, layout)
    return sharded_worker.train(
        mesh, config, steps, params, optimizer, first_step, between,
        set_grads=lambda params, step: set_grads(params, mesh, layout, step))


def boxes_match_local_shards(params) -> bool:
    """Every DTensor's box from its placements is where its local shard sits in the full
    tensor (the arithmetic of placements.py checked against torch's own sharding)."""
    ok = True
    for p in params:
        if not isinstance(p, DTensor):
            continue
        whole = p.full_tensor()
        box = mesh_boxes(p)[dist.get_rank()]
        local = p.to_local()
        if box is None:
            ok &= local.numel() == 0
        else:
            ok &= torch.equal(whole[tuple(slice(a, b) for a, b in box)], local)
    return bool(ok)


def _checkpoint(mesh, layout: str, out_dir: str, resume_from: str | None, results: dict):
    """Save at step 3 through torch's DCP helpers; resume another layout's checkpoint."""
    world = dist.get_world_size()
    for name in CHECKPOINTED:
        config = SCENARIOS[name]
        path = os.path.join(out_dir, f"dcp_{layout}_{name}")

        def save_at_3(step, params, opt, path=path):
            if step == 3:
                opt.zero_grad(set_to_none=True)
                module = sharded_worker.as_module(params)
                dcp.save({"optimizer": get_optimizer_state_dict(module, opt)},
                         checkpoint_id=path)
                fulls = [full(p) for p in params]  # full_tensor is a collective
                if dist.get_rank() == 0:
                    torch.save(fulls, os.path.join(path, "params.pt"))

        train(mesh, layout, config, steps=3, between=save_at_3)
        dist.barrier()
        if resume_from is None:
            continue
        source = os.path.join(resume_from, f"dcp_{os.path.basename(resume_from)}_{name}")
        saved = torch.load(os.path.join(source, "params.pt"), weights_only=True)
        params = params_for(mesh, layout, saved)
        opt = ddp_worker.optimizer_for(params, config)
        module = sharded_worker.as_module(params)
        state = {"optimizer": get_optimizer_state_dict(module, opt)}
        dcp.load(state, checkpoint_id=source)
        set_optimizer_state_dict(module, opt, state["optimizer"])
        train(mesh, layout, config, steps=3, params=params, optimizer=opt, first_step=4)
        results[f"resumed_{name}"] = [full(p) for p in params]
    # hf_shampoo's own sharded format, for consolidation into one file (the test's part)
    params, opt = train(mesh, layout, SCENARIOS["shampoo_adam"], steps=3)
    save_sharded(opt, os.path.join(out_dir, f"sharded_{layout}"))
    fulls = [full(p) for p in params]
    if dist.get_rank() == 0:
        torch.save(fulls, os.path.join(out_dir, f"sharded_{layout}", "params.pt"))
    del world


def tensor_parallel_model(mesh, layout: str) -> dict:
    """A real model: ``parallelize_module`` (colwise then rowwise) on the ``tp`` dim, then
    ``fully_shard`` on the data-parallel dims where the layout has them, with backward and
    gradient clipping; every rank ends with the same parameters, close to one process (the
    tensor-parallel and FSDP reductions round differently from a local sum)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from hf_shampoo import DistributedShampoo

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    initial = [p.detach().clone() for p in model.parameters()]
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    names = mesh.mesh_dim_names
    dp = [n for n in ("dp_replicate", "dp_shard") if n in names]
    if LAYOUTS[layout][3] is not None:  # Accelerate's FSDP shards over the folded dims
        dp = ["_".join(LAYOUTS[layout][3])]
    replicas = 1
    if dp:
        dp_mesh = mesh[tuple(dp)] if len(dp) > 1 else mesh[dp[0]]
        fully_shard(model, mesh=dp_mesh)
        replicas = dp_mesh.size()
    opt = DistributedShampoo(model.parameters(), **ddp_worker.WRAPPED_CONFIG)
    data = torch.Generator().manual_seed(7)
    x, y = torch.randn(4 * replicas, 6, generator=data), torch.randn(4 * replicas, 3,
                                                                      generator=data)
    coordinate = 0
    if dp:
        coordinate = dp_mesh.get_local_rank() if dp_mesh.ndim == 1 else (
            dp_mesh.get_local_rank(0) * dp_mesh.size(1) + dp_mesh.get_local_rank(1))
    batch = slice(coordinate * 4, (coordinate + 1) * 4)
    ddp_worker.train_wrapped(model, opt, x[batch], y[batch])
    return {"params": [full(p) for p in model.parameters()], "initial": initial,
            "placements": [str(tuple(p.placements)) for p in model.parameters()],
            "replicas": replicas, "kind": type(opt._distributor).__name__}


def run_world(rank: int, layout: str, init_file: str, out_dir: str,
              resume_from: str | None, scenarios: list[str]):
    world = LAYOUTS[layout][0]
    join_gloo_world(rank, world, init_file)
    results: dict = {}
    try:
        mesh = make_mesh(layout)
        results["boxes_match"] = boxes_match_local_shards(params_for(mesh, layout))
        for name in scenarios:
            params, opt = train(mesh, layout, SCENARIOS[name])
            results[name] = {"params": [full(p) for p in params],
                             "state_numel": sharded_worker.state_numel(opt),
                             "kind": type(opt._distributor).__name__,
                             "bytes": opt._distributor.bytes_last_step,
                             "planned": opt._distributor.planned_bytes()}
        _checkpoint(mesh, layout, out_dir, resume_from, results)
        if "tp" in mesh.mesh_dim_names:
            results["model"] = tensor_parallel_model(mesh, layout)
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        results["error"] = traceback.format_exc()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_gloo_world()
