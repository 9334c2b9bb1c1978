"""Ranks that hold different parameters, or the same with different settings, for
tests/test_rank_agreement.py (docs/parallelism.md#limits): every rank of a gloo group runs
every scenario of its world and records what ``step()`` did: the error it raised (or
"stepped"), whether the parameters, the optimizer's state and the step counts stayed as
they were, and the distributor's class.

A pipeline split gives rank ``r`` its own stage of one 4-layer model (world 2: layers 0-1
on rank 0, 2-3 on rank 1; world 3: ranks 0 and 1 hold layers 0-1, rank 2 layers 2-3), as
plain tensors (the data-parallel distributor over the world: refused) or fully_shard'ed on
a 1-rank sub-mesh of its own (the sharded distributor over that mesh's ranks: it steps).
``run_world`` is the ``mp.spawn`` entry; it writes ``rank{r}.json``.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from hf_shampoo import DistributedShampoo
from tests.helpers import join_gloo_world

LAYERS = [(6, 8), (8, 8), (8, 4), (4, 2)]


def stage_of(rank: int, world: int) -> int:
    """The pipeline stage rank ``rank`` holds: the last rank alone holds the second."""
    return 1 if rank == world - 1 else 0


def make_stage(stage: int) -> torch.nn.Sequential:
    torch.manual_seed(stage)
    layers = [torch.nn.Linear(i, o) for i, o in LAYERS]
    return torch.nn.Sequential(*layers[2 * stage:2 * stage + 2])


def set_grads(params, seed: int) -> None:
    """The same gradients on every rank holding the same stage (plain or DTensor)."""
    g = torch.Generator().manual_seed(seed)
    for p in params:
        full = torch.randn(tuple(p.shape), generator=g)
        if hasattr(p, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor

            full = distribute_tensor(full, p.device_mesh, p.placements)
        p.grad = full


def snapshot(params) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for p in params]


def state_of(opt: DistributedShampoo) -> list[tuple[int, str, torch.Tensor]]:
    """Every state tensor of every stack of the optimizer's layout (none before it has
    one), read without a collective."""
    layout = opt._layout
    if layout is None:
        return []
    return [(i, name, tensor.detach().clone()) for i, stack in enumerate(layout.stacks)
            for name, tensor in sorted(stack.state.items())]


def same_state(before: list, after: list) -> bool:
    return len(before) == len(after) and all(
        a[:2] == b[:2] and a[2].shape == b[2].shape and torch.equal(a[2], b[2])
        for a, b in zip(before, after))


def attempt(opt: DistributedShampoo, params, seed: int = 1) -> dict:
    """One ``step()`` on fresh gradients: what it raised (or "stepped"), and whether the
    parameters, the optimizer's state and the groups' step counts stayed as they were."""
    before, steps = snapshot(params), [g["step"] for g in opt.param_groups]
    state = state_of(opt)
    set_grads(params, seed)
    try:
        opt.step()
        outcome = "stepped"
    except (ValueError, RuntimeError) as error:
        outcome = f"{type(error).__name__}: {error}"
    after = snapshot(params)
    return {"outcome": outcome,
            "unchanged": all(torch.equal(a, b) for a, b in zip(before, after))
            and steps == [g["step"] for g in opt.param_groups]
            and same_state(state, state_of(opt)),
            "kind": type(opt.distributor).__name__}


def pipeline_plain(rank: int, world: int, **config) -> dict:
    """Each rank's stage, plain tensors, named: the data-parallel distributor."""
    stage = make_stage(stage_of(rank, world))
    opt = DistributedShampoo(stage.named_parameters(), lr=0.1, **config)
    first = attempt(opt, list(stage.parameters()))
    first["again"] = attempt(opt, list(stage.parameters()))["outcome"]  # raises again
    return first


def described_first(rank: int, world: int) -> dict:
    """Rank 0 alone lays the blocks out before the first step (``describe_blocks()``, as
    ``if is_main_process: print(describe(optimizer))`` does): no collective then, and
    the first step still refuses on every rank."""
    stage = make_stage(stage_of(rank, world))
    opt = DistributedShampoo(stage.parameters(), lr=0.1)
    if rank == 0:
        opt.describe_blocks()
    return attempt(opt, list(stage.parameters()))


def pipeline_sharded(rank: int, world: int, **config) -> dict:
    """Each rank's stage fully_shard'ed on a 1-rank sub-mesh of its own (a ``(pp, dp)``
    mesh of shape ``(world, 1)``): the sharded distributor, whose layout gathers every
    rank's view of sub-mesh parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp"))
    stage = make_stage(stage_of(rank, world))
    fully_shard(stage, mesh=mesh["dp"])
    opt = DistributedShampoo(stage.parameters(), lr=0.1, **config)
    return attempt(opt, list(stage.parameters()))


def equal(rank: int, world: int) -> dict:
    """Every rank holds the same stage: it steps."""
    stage = make_stage(0)
    opt = DistributedShampoo(stage.parameters(), lr=0.1)
    return attempt(opt, list(stage.parameters()))


def settings(rank: int, world: int) -> dict:
    """The same parameters, blocked otherwise on the last rank (max_preconditioner_dim)."""
    stage = make_stage(0)
    dim = 4 if rank == world - 1 else 1024
    opt = DistributedShampoo(stage.parameters(), lr=0.1, max_preconditioner_dim=dim)
    return attempt(opt, list(stage.parameters()))


def differing(rank: int, world: int, **per_rank) -> dict:
    """The same stage everywhere, each keyword of ``per_rank`` a pair ``(rank 0's value,
    the other ranks')``: refused at the first step, on every rank, nothing changed."""
    stage = make_stage(0)
    config = {key: values[0] if rank == 0 else values[1] for key, values in per_rank.items()}
    opt = DistributedShampoo(stage.parameters(), **{"lr": 0.1, **config})
    return attempt(opt, list(stage.parameters()))


def differing_after_steps(rank: int, world: int) -> dict:
    """Two steps alike; then every rank adds a group of the same shape, rank 0 with
    another ``epsilon``: the next step refuses, and the state of the first two stays."""
    stage = make_stage(0)
    opt = DistributedShampoo(stage.parameters(), lr=0.1)
    first = [attempt(opt, list(stage.parameters()), seed=s)["outcome"] for s in (1, 2)]
    extra = torch.nn.Parameter(torch.ones(3, 2))
    opt.add_param_group({"params": [extra], "epsilon": 1e-6 if rank == 0 else 1e-12})
    result = attempt(opt, [*stage.parameters(), extra], seed=3)
    result["first"] = first
    return result


def scheduled(rank: int, world: int) -> dict:
    """Settings are compared as they are at the check: rank 0 lays the blocks out first
    (``describe_blocks()``) at ``lr=0.1``, then every rank's schedule sets ``lr`` to 0.025
    before the first step; after a step and a schedule step (``lr`` 0.05) every rank
    adds the same group (a layout checked again). No rank is refused."""
    stage = make_stage(0)
    opt = DistributedShampoo(stage.parameters(), lr=0.1)
    if rank == 0:
        opt.describe_blocks()
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: (t + 1) / 4)
    first = attempt(opt, list(stage.parameters()))
    schedule.step()
    extra = torch.nn.Parameter(torch.ones(3, 2))
    opt.add_param_group({"params": [extra]})
    result = attempt(opt, [*stage.parameters(), extra], seed=2)
    result["first"] = first["outcome"]
    result["lr"] = [group["lr"] for group in opt.param_groups]
    return result


def added_group(rank: int, world: int) -> dict:
    """The same stage everywhere and one step; then every rank adds a group of a shape
    of its own: the next step refuses, nothing moves."""
    stage = make_stage(0)
    opt = DistributedShampoo(stage.parameters(), lr=0.1)
    first = attempt(opt, list(stage.parameters()))
    extra = torch.nn.Parameter(torch.zeros(3, 2 + rank))
    opt.add_param_group({"params": [extra]})
    result = attempt(opt, [*stage.parameters(), extra], seed=2)
    result["first"] = first["outcome"]
    return result


def no_mesh_world_group(rank: int, world: int) -> dict:
    """As ``no_mesh``, with the world named as the group: the last rank is in the group
    but holds no part of the parameter."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh("cpu", [0, 1])
    param = torch.nn.Parameter(distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)]))
    opt = DistributedShampoo([param], lr=0.1, process_group=dist.group.WORLD)
    return attempt(opt, [param])


def no_mesh(rank: int, world: int) -> dict:
    """The same parameter on every rank, on a mesh of ranks [0, 1] only: the last rank of
    a world of 3 holds no part of it."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh("cpu", [0, 1])
    param = torch.nn.Parameter(distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)]))
    opt = DistributedShampoo([param], lr=0.1)
    return attempt(opt, [param])


def _constructed(build) -> dict:
    """``build()`` → (optimizer, params): a refusal at construction as ``attempt`` reports
    one at the step."""
    try:
        opt, params = build()
    except (ValueError, TypeError) as error:
        return {"outcome": f"{type(error).__name__}: {error}", "unchanged": True, "kind": None}
    return attempt(opt, params)


def _stage_groups(world: int):
    """Every rank creates both stages' groups, in the same order (torch's rule for
    ``new_group``): ranks ``[0, world - 1)`` and ``[world - 1]``."""
    first = dist.new_group(list(range(world - 1)))
    last = dist.new_group([world - 1])
    return first, last


def stage_groups(rank: int, world: int, per_rank=None, **config) -> dict:
    """Plain stages, each optimizer over its stage's own group: they step (``per_rank``:
    the keywords of rank ``r``, ``per_rank(r)``, on top of ``config``)."""
    first, last = _stage_groups(world)
    stage = make_stage(stage_of(rank, world))
    group = last if rank == world - 1 else first
    config = {**config, **(per_rank(rank) if per_rank else {})}

    def build():
        return (DistributedShampoo(stage.parameters(), process_group=group,
                                   **{"lr": 0.1, **config}),
                list(stage.parameters()))

    return _constructed(build)


def group_without_rank(rank: int, world: int) -> dict:
    """Every rank passes the first stage's group: the last rank is not in it."""
    first, _ = _stage_groups(world)
    stage = make_stage(0)
    return _constructed(lambda: (DistributedShampoo(stage.parameters(), lr=0.1,
                                                    process_group=first),
                                 list(stage.parameters())))


def mesh_outside_group(rank: int, world: int) -> dict:
    """A parameter sharded over the whole world, each rank naming its stage's group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    first, last = _stage_groups(world)
    param = torch.nn.Parameter(distribute_tensor(torch.ones(6, 3), mesh, [Shard(0)]))
    group = last if rank == world - 1 else first
    return _constructed(lambda: (DistributedShampoo([param], lr=0.1, process_group=group),
                                 [param]))


def two_dim_mesh(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp"))
    stage = make_stage(0)
    return _constructed(lambda: (DistributedShampoo(stage.parameters(), lr=0.1,
                                                    process_group=mesh),
                                 list(stage.parameters())))


SCENARIOS = {
    2: {"pipeline_plain": pipeline_plain,
        "pipeline_none": lambda r, w: pipeline_plain(r, w, distributed="none"),
        "described_first": described_first,
        "pipeline_sharded": pipeline_sharded,
        "pipeline_sharded_local": lambda r, w: pipeline_sharded(r, w, fsdp_mode="local"),
        "equal": equal, "settings": settings, "added_group": added_group,
        "kind_soap": lambda r, w: differing(r, w, preconditioner=("shampoo",
                                                                  "eigenvalue_corrected")),
        "kind_kl": lambda r, w: differing(r, w, preconditioner=("kl_shampoo", "shampoo")),
        "grafting": lambda r, w: differing(r, w, grafting=("adam", "rmsprop")),
        "lr": lambda r, w: differing(r, w, lr=(0.01, 0.5)),
        "epsilon": lambda r, w: differing(r, w, epsilon=(1e-12, 1e-10)),
        "weight_decay": lambda r, w: differing(r, w, weight_decay=(0.0, 0.01)),
        "betas": lambda r, w: differing(r, w, betas=((0.9, 1.0), (0.9, 0.999))),
        "tensor_lr": lambda r, w: differing(r, w, lr=(torch.tensor(0.25), torch.tensor(0.5))),
        "tensor_lr_same": lambda r, w: differing(r, w, lr=(torch.tensor(0.25),) * 2),
        "int_and_float_lr": lambda r, w: differing(r, w, lr=(1, 1.0)),
        "differing_after_steps": differing_after_steps, "scheduled": scheduled},
    3: {"pipeline_plain": pipeline_plain, "pipeline_sharded": pipeline_sharded,
        "equal": equal, "no_mesh": no_mesh, "no_mesh_world_group": no_mesh_world_group,
        "stage_groups": stage_groups,
        "stage_groups_trainers": lambda r, w: stage_groups(r, w, num_trainers_per_group=1),
        "stage_groups_trainers_2": lambda r, w: stage_groups(r, w, num_trainers_per_group=2),
        "stage_groups_none": lambda r, w: stage_groups(r, w, distributed="none"),
        "stage_groups_kind": lambda r, w: stage_groups(r, w, per_rank=lambda r: {
            "preconditioner": "eigenvalue_corrected" if r == 0 else "shampoo"}),
        "stage_groups_lr": lambda r, w: stage_groups(r, w, per_rank=lambda r: {
            "lr": 0.01 if r == 1 else 0.5}),
        "group_without_rank": group_without_rank, "mesh_outside_group": mesh_outside_group,
        "two_dim_mesh": two_dim_mesh},
}


def run_world(rank: int, world: int, init_file: str, out_dir: str) -> None:
    join_gloo_world(rank, world, init_file)
    results = {name: scenario(rank, world) for name, scenario in SCENARIOS[world].items()}
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as file:
        json.dump(results, file)
    dist.destroy_process_group()
