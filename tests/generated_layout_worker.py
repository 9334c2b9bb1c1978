"""The ranks of tests/test_generated_layouts.py: each ``mp.spawn``ed rank runs a list of drawn
DTensor cases (tests/layout_cases.py) in order, and writes one result per case as it goes.

A case is built on every rank alike: the mesh (its flattened dim too), the parameters placed
by ``distribute_tensor`` on drawn sub-meshes with drawn placements (plain tensors beside), or a
small model placed by ``parallelize_module`` and ``fully_shard``; each step's gradient is the
one-process gradient placed like its parameter. Each rank also runs the one-process reference
itself (the same bits on every rank), and reports per parameter whether the full tensor after
the steps is ``torch.equal`` to it, its state's size, and, for a case with ``resume_at``, the
same after a ``torch.distributed.checkpoint`` save under the case's layout and a load under
its ``resume_layout``. A case that raises reports its traceback; a rank stuck in a collective
times out (the group's timeout) instead of hanging the test.
"""

from __future__ import annotations

import datetime
import os
import traceback
import warnings

import torch
import torch.distributed as dist
from torch import nn

from hf_shampoo import DistributedShampoo
from tests import distributed_worker as ddp_worker
from tests import layout_cases as lc
from tests.helpers import leave_gloo_world

#: seconds a rank waits in one collective before the case fails (a hang is a failure)
#: seconds a collective may wait: a hung case fails instead of hanging the test; the long
#: search (HF_SHAMPOO_LAYOUT_CASES > 1, 8 ranks on 2 cores beside other work) waits longer,
#: since one rank descheduled for a minute timed out a sign-descent case there once
COLLECTIVE_TIMEOUT = 60 if float(os.environ.get("HF_SHAMPOO_LAYOUT_CASES", "1")) <= 1 else 300


def placement(spec: tuple):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if spec[0] == "R":
        return Replicate()
    if spec[0] == "S":
        return Shard(spec[1])
    return _StridedShard(spec[1], split_factor=spec[2])


#: meshes built so far, by (shape, names, flatten, variant): every gloo group a mesh makes
#: keeps two threads alive to the end of the process, so hundreds of cases with a mesh each
#: left ranks with 2,000 threads, a fifth of them runnable, and the long search crawling.
#: Each kind of mesh is built twice (alternate cases take the second) and then reused, so
#: that two alike roots still live in one process (a case of docs/parallelism.md); every
#: rank makes the same calls in the same order, so the ranks agree on which mesh is reused.
_MESHES: dict[tuple, object] = {}
_MESH_CALLS: dict[tuple, int] = {}


def cached_mesh(shape, names, flatten=None):
    from torch.distributed.device_mesh import init_device_mesh

    kind = (tuple(shape), tuple(names), None if flatten is None else tuple(flatten))
    calls = _MESH_CALLS[kind] = _MESH_CALLS.get(kind, -1) + 1
    key = (*kind, calls % 2)
    if key not in _MESHES:
        mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
        if flatten is not None:
            mesh[tuple(flatten)]._flatten("_".join(flatten))
        _MESHES[key] = mesh
    return _MESHES[key]


def build_mesh(desc: dict):
    return cached_mesh(desc["shape"], desc["names"], desc["flatten"])


def sub_mesh(mesh, dims: tuple[str, ...]):
    return mesh[dims[0]] if len(dims) == 1 else mesh[tuple(dims)]


def place(tensor: torch.Tensor, mesh, where) -> torch.Tensor:
    from torch.distributed.tensor import distribute_tensor

    if where is None:
        return tensor.clone()
    dims, specs = where
    return distribute_tensor(tensor.clone(), sub_mesh(mesh, dims),
                             [placement(s) for s in specs], src_data_rank=None)


def full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.full_tensor().detach().clone()
    return tensor.detach().clone()


def state_numel(opt) -> int:
    return sum(t.numel() for entry in opt.local_state_dict()["state"].values()
               for t in entry.values() if torch.is_tensor(t))


def optimizer(params, names, config, **extra) -> DistributedShampoo:
    return DistributedShampoo(lc.param_groups(params, names, config),
                              **lc.optimizer_kwargs(config), **extra)


def steps(params, shapes, opt, case, first: int, last: int, set_grad) -> None:
    config = case["config"]
    for step in range(first, last + 1):
        for i, (p, grad) in enumerate(zip(params, lc.full_grads(
                shapes, case["seed"], step, case["no_grad"]))):
            p.grad = None if grad is None else set_grad(i, p, grad)
        ddp_worker.before_step(opt, config)
        opt.step()
        ddp_worker.after_step(opt, config, step)


def one_process(case, initial: list[torch.Tensor], names: list[str]):
    """The reference: plain tensors, ``distributed="none"``."""
    params = [nn.Parameter(t.clone()) for t in initial]
    opt = optimizer(params, names, case["config"], distributed="none")
    shapes = [tuple(t.shape) for t in initial]
    steps(params, shapes, opt, case, 1, case["steps"], lambda i, p, g: g)
    return [p.detach() for p in params], state_numel(opt)


def compare(got: list[torch.Tensor], expected: list[torch.Tensor], names) -> list[str]:
    """The parameters that differ, with their largest difference."""
    out = []
    for name, a, b in zip(names, got, expected):
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else "shape"
            out.append(f"{name}: max |diff| {diff}")
    return out


def as_module(params, names) -> nn.Module:
    module = nn.Module()
    for name, p in zip(names, params):
        module.register_parameter(name.replace(".", "_"), p)
    return module


def stage_case(case: dict) -> dict:
    """A pipeline case as this rank's stage: its parameters, placed on the stage's
    sub-meshes of the ``("pp", ...)`` mesh (every stage saves into one DCP directory, its
    names its own)."""
    pipeline = case["pipeline"]
    mesh = build_mesh(pipeline["mesh"])
    stage = pipeline["stages"][mesh["pp"].get_local_rank()]
    out = {**case, "names": stage["names"], "shapes": stage["shapes"],
           "no_grad": stage["no_grad"], "layout": {"mesh": pipeline["mesh"],
                                                   "where": stage["where"]},
           "stage": mesh["pp"].get_local_rank()}
    if "resume_mesh" in pipeline:
        out["resume_layout"] = {"mesh": pipeline["resume_mesh"],
                                "where": stage["resume_where"]}
    del out["pipeline"]
    return out


def run_synthetic(case: dict, work: str) -> dict:
    if "pipeline" in case:
        result = _run_synthetic(stage_case(case), work, everyone=True)
        return {**result, "stage": stage_case(case)["stage"]}
    return _run_synthetic(case, work)


def _run_synthetic(case: dict, work: str, everyone: bool = False) -> dict:
    """``everyone``: every rank of the world learns whether any found torch's placement
    unable to rebuild a tensor, so that all skip the case together (pipeline stages draw
    their own tensors)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    shapes, names = [tuple(s) for s in case["shapes"]], case["names"]
    initial = lc.full_params(shapes, case["seed"])
    expected, expected_state = one_process(case, initial, names)
    mesh = build_mesh(case["layout"]["mesh"])
    where = case["layout"]["where"]
    params = [nn.Parameter(place(t, mesh, w)) for t, w in zip(initial, where)]
    torn = [n for n, p, t in zip(names, params, initial) if not torch.equal(full(p), t)]
    if "resume_layout" in case:  # the second layout too, before anything trains
        other = build_mesh(case["resume_layout"]["mesh"])
        torn += [n for n, t, w in zip(names, initial, case["resume_layout"]["where"])
                 if not torch.equal(full(place(t, other, w)), t)]
    if everyone:
        flag = torch.tensor([int(bool(torn))])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and not torn:
            torn = ["(another stage's parameters)"]
    if torn:  # torch's own placement does not give the tensor back: not ours to judge
        return {"invalid": f"torch's full_tensor() does not rebuild {torn}"}
    opt = optimizer(params, names, case["config"])
    result: dict = {"reference_state": expected_state}
    set_grad = lambda i, p, g: place(g, mesh, where[i])  # noqa: E731
    resume_at = case.get("resume_at")
    steps(params, shapes, opt, case, 1, resume_at or case["steps"], set_grad)
    if resume_at is None:
        result["state"] = state_numel(opt)
        got = [full(p) for p in params]
        result["diffs"] = compare(got, expected, names)
        return result
    # save under this layout (gradients cleared first, as after zero_grad), load under the
    # resume layout, go on to the last step
    opt.zero_grad(set_to_none=True)
    path = os.path.join(work, f"dcp_{case['seed']}")
    # pipeline stages write one directory: their groups' entries keyed by parameter name
    # (torchtitan's option), not by position (which the stages' groups would share)
    options = StateDictOptions(flatten_optimizer_state_dict=everyone)
    dcp.save({"optimizer": get_optimizer_state_dict(as_module(params, names), opt,
                                                    options=options)},
             checkpoint_id=path)
    saved = [full(p) for p in params]
    other = build_mesh(case["resume_layout"]["mesh"])
    other_where = case["resume_layout"]["where"]
    params = [nn.Parameter(place(t, other, w)) for t, w in zip(saved, other_where)]
    opt = optimizer(params, names, case["config"])
    module = as_module(params, names)
    state = {"optimizer": get_optimizer_state_dict(module, opt, options=options)}
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(module, opt, state["optimizer"], options=options)
    set_grad = lambda i, p, g: place(g, other, other_where[i])  # noqa: E731
    steps(params, shapes, opt, case, resume_at + 1, case["steps"], set_grad)
    result["state"] = state_numel(opt)
    result["diffs"] = compare([full(p) for p in params], expected, names)
    return result


# ----------------------------------------------------------------- real modules
class Experts(nn.Module):
    """A fused experts' weight ``(experts, width, hidden)``, as MoE layers keep it."""

    def __init__(self, experts: int, width: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, width, hidden) / width ** 0.5)


def build_model(desc: dict) -> tuple[nn.Sequential, dict]:
    """The model and its ``parallelize_module`` plan (module name → style)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    width = desc["width"]
    modules: list[nn.Module] = []
    plan: dict = {}
    for layer in desc["layers"]:
        at = str(len(modules))
        if layer[0] == "embedding":
            modules.append(nn.Embedding(layer[1], width))
            plan[at] = ColwiseParallel() if layer[2] == "colwise" else RowwiseParallel()
        elif layer[0] == "mlp":
            hidden, bias = layer[1], layer[2]
            modules.append(nn.Sequential(nn.Linear(width, hidden, bias=bias),
                                         nn.Linear(hidden, width, bias=bias)))
            plan[f"{at}.0"], plan[f"{at}.1"] = ColwiseParallel(), RowwiseParallel()
        elif layer[0] == "norm":
            modules.append(nn.LayerNorm(width) if layer[1] == "layer" else nn.RMSNorm(width))
            if layer[2]:
                plan[at] = SequenceParallel()
        elif layer[0] == "experts":
            modules.append(Experts(layer[1], width, layer[2]))
        elif layer[0] == "head":
            modules.append(nn.Linear(width, layer[1], bias=layer[2]))
            plan[at] = ColwiseParallel()
    return nn.Sequential(*modules), plan


def placed_model(desc: dict, split: dict, values: list[torch.Tensor]) -> nn.Sequential:
    """The model of ``desc`` holding ``values``, placed by ``split``: ``parallelize_module``
    on ``tp``, the experts' weight expert parallel on the same ranks, then ``fully_shard``
    (per block first with ``shard_blocks``) on ``dp_shard``, or HSDP over ``dp_replicate``
    × ``dp_shard``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    model, plan = build_model(desc)
    with torch.no_grad():
        for p, value in zip(model.parameters(), values):
            p.copy_(value)
    mesh = cached_mesh((split["dp_replicate"], split["dp_shard"], split["tp"]),
                       ("dp_replicate", "dp_shard", "tp"))
    parallelize_module(model, mesh["tp"], plan)
    for module in model:
        if isinstance(module, Experts):  # expert parallel over the tensor-parallel ranks
            module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh["tp"],
                                                           [Shard(0)], src_data_rank=None))
    dp = mesh[("dp_replicate", "dp_shard")] if split["dp_replicate"] > 1 else mesh["dp_shard"]
    if split["shard_blocks"]:
        for module in model:
            if any(True for _ in module.parameters()):
                fully_shard(module, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def held_boxes(params, values: list[torch.Tensor]) -> list:
    """Each parameter's box on this rank (``placements.mesh_boxes``), checked against
    where its local shard really lies in ``values`` (FSDP2's and tensor parallel's own
    cutting): a box that is not the local data fails the case."""
    from hf_shampoo.distributors.placements import mesh_boxes

    boxes = []
    for p, value in zip(params, values):
        if not hasattr(p, "placements"):
            boxes.append(None)
            continue
        box = mesh_boxes(p)[dist.get_rank()]
        local = p.to_local().detach()
        held = value[tuple(slice(a, b) for a, b in box)] if box is not None else None
        if not (local.numel() == 0 and box is None) and not (
                held is not None and torch.equal(held, local)):
            raise AssertionError(f"{tuple(p.placements)}: the local shard of shape "
                                 f"{tuple(local.shape)} is not the box {box}")
        boxes.append(box)
    return boxes


def placed_grad(p, box, grad: torch.Tensor) -> torch.Tensor:
    """The one-process gradient placed like its parameter: its box of the full gradient as
    the local shard (as FSDP2's reduce-scatter leaves it; ``distribute_tensor`` cuts
    uneven strided shards otherwise than FSDP2 does)."""
    from torch.distributed.tensor import DTensor

    if not hasattr(p, "placements"):
        return grad
    if box is None:
        local = grad.new_empty(p.to_local().shape)
    else:
        local = grad[tuple(slice(a, b) for a, b in box)].contiguous()
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def run_model(case: dict, work: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    desc = case["model"]
    torch.manual_seed(case["seed"])
    reference, _ = build_model(desc)
    names = [n for n, _ in reference.named_parameters()]
    initial = [p.detach().clone() for p in reference.parameters()]
    shapes = [tuple(t.shape) for t in initial]
    expected, expected_state = one_process(case, initial, names)
    model = placed_model(desc, desc, initial)
    params = list(model.parameters())
    result: dict = {"reference_state": expected_state,
                    "placements": [str(tuple(p.placements)) if hasattr(p, "placements")
                                   else "plain" for p in params]}
    opt = optimizer(params, names, case["config"])
    boxes = held_boxes(params, initial)
    set_grad = lambda i, p, g: placed_grad(p, boxes[i], g)  # noqa: E731
    resume_at = case.get("resume_at")
    steps(params, shapes, opt, case, 1, resume_at or case["steps"], set_grad)
    if resume_at is not None:  # DCP save, resumed under the other split of the same model
        opt.zero_grad(set_to_none=True)
        path = os.path.join(work, f"dcp_model_{case['seed']}")
        dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
        saved = [full(p) for p in params]
        model = placed_model(desc, case["resume_split"], saved)
        params = list(model.parameters())
        boxes = held_boxes(params, saved)
        opt = optimizer(params, names, case["config"])
        state = {"optimizer": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=path)
        set_optimizer_state_dict(model, opt, state["optimizer"])
        steps(params, shapes, opt, case, resume_at + 1, case["steps"], set_grad)
    result["state"] = state_numel(opt)
    result["diffs"] = compare([full(p) for p in params], expected, names)
    return result


def fresh_dtensor_caches() -> None:
    """Start a case as a fresh training process would: torch's DTensor sharding caches
    emptied. They compare meshes by value, so a later case's DTensor could otherwise come
    back on an earlier case's equal sub-mesh, whose root is that case's mesh (a one-rank
    ``"dp_shard"`` is any root's with such a dim): the stage found from it then differs
    between ranks, a hang (docs/parallelism.md#pipeline-parallel names this limit for a
    process that holds several root meshes)."""
    from torch.distributed.tensor import DTensor

    torch._C._clear_DTensor_sharding_propagator_cache()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()


def run_world(rank: int, world: int, init_file: str, out_dir: str, cases: list[dict]) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    results: list[dict] = []
    for case in cases:
        fresh_dtensor_caches()
        try:
            run = run_model if "model" in case else run_synthetic
            # 4-bit cases quantise their tiny factors from construction to the last load
            with ddp_worker.small_factors_quantized(case["config"]), lc.drawn_calls(case):
                result = run(case, out_dir)
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            result = {"error": traceback.format_exc()[-3000:]}
        results.append(result)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        if "error" in result:
            break  # the ranks may no longer agree on what comes next
        dist.barrier()
    leave_gloo_world()
