"""Scenarios run on every rank of a gloo group for tests/test_sharded.py (docs/design.md §8).

Parameters are FSDP2 DTensors: ``(Shard(0),)`` on a 1-D mesh, or ``(Replicate(), Shard(0))``
on a 2x2 HSDP mesh. Gradients are the single-process gradients of
``distributed_worker.set_grads``, distributed the way FSDP's reduce-scatter leaves them, so
that the parameters can be compared bit for bit with one process. ``run_world`` is the
``mp.spawn`` entry; it saves one result file per rank.
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from hf_shampoo import DistributedShampoo
from tests import distributed_worker as ddp_worker
from tests.helpers import join_gloo_world, leave_gloo_world

# rows not divisible by 2, 3 or 4; (40, 20) has blocks that span shards; (2, 5) leaves a
# rank of a 3-way mesh without rows; (3,) stays a plain (replicated) parameter; (6, 2) is
# merged into one dim (12,), whose merged rows are single elements
SHAPES = [(10, 3, 3, 3), (40, 20), (7,), (5, 4), (2, 5), (3,), (6, 2)]
PLAIN = {5}
NO_GRAD = {1: (2, 3)}  # parameter 1 has no gradient at steps 2 and 3
SCENARIOS = {name: ddp_worker.SCENARIOS[name] for name in (
    "shampoo_adam", "eigen_qr", "rmsprop_nesterov_l2", "adagrad_corrected_beta3",
    "staggered_eigen_qr", "bf16_communication", "shampoo_4bit", "shampoo_4bit_warmup",
    "eigen_qr_4bit", "muon",
    "muon_whole_bf16_svd", "sign_descent_l1", "diagonal_long_side", "kl_pseudo_inverse",
    "higher_order_roots", "eigendecomposed_kl_qr", "gpa_decoupled", "schedule_free_soap",
    "eigendecomposed_4bit", "compiled_stages")}
SCENARIOS["decoupled_momentum"] = dict(lr=0.01, grafting="adam", momentum=0.5,
                                       weight_decay=0.05, precondition_frequency=2,
                                       max_preconditioner_dim=16)
SCENARIOS["diagonal_adam"] = dict(lr=0.01, preconditioner="diagonal", grafting="adam",
                                  weight_decay=0.01, max_preconditioner_dim=16)
SCENARIOS["sgd_grafting_eigh"] = dict(lr=0.01, grafting="sgd", betas=(0.0, 0.99),
                                      preconditioner="eigenvalue_corrected",
                                      precondition_frequency=2, max_preconditioner_dim=16)
SCENARIOS["kl_shampoo"] = dict(lr=0.01, preconditioner="kl_shampoo", grafting="adam",
                               precondition_frequency=2, max_preconditioner_dim=16)
SCENARIOS["compute_cost_f64"] = dict(lr=0.01, grafting="sgd", precondition_frequency=3,
                                     max_preconditioner_dim=8, assignment_cost="compute",
                                     factor_matrix_dtype=torch.float64)
STEPS = 5


def full_params(shapes=SHAPES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in shapes]


def full_grads(step: int, shapes=SHAPES, no_grad=NO_GRAD) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for i, s in enumerate(shapes):
        grad = torch.randn(s, generator=g)
        out.append(None if step in no_grad.get(i, ()) else grad)
    return out


def placements(mesh):
    return [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]


def sharded_params(mesh, shapes=SHAPES, plain=PLAIN) -> list[torch.nn.Parameter]:
    out = []
    for i, tensor in enumerate(full_params(shapes)):
        if i in plain:
            out.append(torch.nn.Parameter(tensor))
        else:
            out.append(torch.nn.Parameter(distribute_tensor(tensor, mesh, placements(mesh))))
    return out


def set_sharded_grads(params, mesh, step: int, shapes=SHAPES, no_grad=NO_GRAD) -> None:
    for p, grad in zip(params, full_grads(step, shapes, no_grad)):
        if grad is None:
            p.grad = None
        elif isinstance(p, torch.distributed.tensor.DTensor):
            p.grad = distribute_tensor(grad, mesh, placements(mesh))
        else:
            p.grad = grad


def full(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, torch.distributed.tensor.DTensor):
        return tensor.full_tensor().detach().clone()
    return tensor.detach().clone()


def train_one_process(config: dict, steps: int = STEPS, shapes=SHAPES):
    """The reference: the same parameters and gradients, plain tensors, one process."""
    params = [torch.nn.Parameter(t) for t in full_params(shapes)]
    opt = ddp_worker.optimizer_for(params, config, distributed="none")
    with ddp_worker.small_factors_quantized(config):
        for step in range(1, steps + 1):
            for p, grad in zip(params, full_grads(step, shapes)):
                p.grad = grad
            ddp_worker.before_step(opt, config)
            opt.step()
            ddp_worker.after_step(opt, config, step)
    return [p.detach() for p in params]


def train(mesh, config: dict, steps: int = STEPS, params=None, optimizer=None,
          first_step: int = 1, between=None, set_grads=None):
    """``steps`` steps from ``first_step`` on; ``set_grads(params, step)`` places each
    step's gradients (default: ``set_sharded_grads`` on ``mesh``)."""
    params = params if params is not None else sharded_params(mesh)
    set_grads = set_grads or (lambda params, step: set_sharded_grads(params, mesh, step))
    opt = optimizer or ddp_worker.optimizer_for(params, config)
    with ddp_worker.small_factors_quantized(config):
        for step in range(first_step, first_step + steps):
            set_grads(params, step)
            ddp_worker.before_step(opt, config)
            opt.step()
            ddp_worker.after_step(opt, config, step)
            if between is not None:
                between(step, params, opt)
    return params, opt


def as_module(params) -> torch.nn.Module:
    module = torch.nn.Module()
    for i, p in enumerate(params):
        module.register_parameter(f"p{i}", p)
    return module


def state_numel(opt) -> int:
    return sum(t.numel() for entry in opt.local_state_dict()["state"].values()
               for t in entry.values())


# scenarios saved and resumed through torch.distributed.checkpoint
CHECKPOINTED = ddp_worker.CHECKPOINTED


def _checkpoints(mesh, out_dir: str, resume_dir: str | None, results: dict, name: str) -> None:
    config = SCENARIOS[name]
    world = dist.get_world_size()
    # save through torch's helpers at step 3 (grads cleared first, as after zero_grad),
    # then go on: the save must not change the trajectory
    path = os.path.join(out_dir, f"dcp{world}_{name}")

    def save_at_3(step, params, opt):
        if step == 3:
            opt.zero_grad(set_to_none=True)
            model = as_module(params)
            state = get_optimizer_state_dict(model, opt)
            dcp.save({"optimizer": state}, checkpoint_id=path)
            if dist.get_rank() == 0:
                torch.save([full(p) for p in params], os.path.join(path, "params.pt"))
            else:
                [full(p) for p in params]  # full_tensor is a collective
            results[f"saved_keys_{name}"] = sorted(str(k) for k in state["state"])

    params, _ = train(mesh, config, steps=6, between=save_at_3)
    results[f"dcp_uninterrupted_{name}"] = [full(p) for p in params]

    # full state dict after consolidation onto every rank, loaded back into a fresh optimizer
    params, opt = train(mesh, config, steps=3)
    opt.consolidate_state_dict(to=None)
    model = as_module(params)
    full_state = get_optimizer_state_dict(model, opt, options=StateDictOptions(
        full_state_dict=True))
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = ddp_worker.optimizer_for(fresh_params, config)
    set_optimizer_state_dict(as_module(fresh_params), fresh, full_state,
                             options=StateDictOptions(full_state_dict=True))
    train(mesh, config, steps=3, params=fresh_params, optimizer=fresh, first_step=4)
    results[f"full_resumed_{name}"] = [full(p) for p in fresh_params]

    if resume_dir is not None:  # another world size's sharded checkpoint, resumed here
        resume_dir = f"{resume_dir}_{name}"
        saved = torch.load(os.path.join(resume_dir, "params.pt"), weights_only=True)
        params = [torch.nn.Parameter(distribute_tensor(t, mesh, placements(mesh)))
                  if i not in PLAIN else torch.nn.Parameter(t) for i, t in enumerate(saved)]
        opt = ddp_worker.optimizer_for(params, config)
        model = as_module(params)
        state = {"optimizer": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=resume_dir)
        set_optimizer_state_dict(model, opt, state["optimizer"])
        train(mesh, config, steps=3, params=params, optimizer=opt, first_step=4)
        results[f"dcp_resumed_{name}"] = [full(p) for p in params]


def _non_finite_refresh(mesh, results: dict) -> None:
    """A NaN gradient row reaches one block's owner at a refresh step (the gradient check
    off): every rank raises (none waits in a collective), and no parameter moves. With the
    check (the default), an inf in one rank's gradient shard on a step without a refresh:
    every rank raises naming the parameter, and nothing moves."""
    params, opt = train(mesh, dict(SCENARIOS["shampoo_adam"], check_finite_gradients=False),
                        steps=1)
    _poison(params, mesh, 2, 5, (0, 0), float("nan"))  # step 2 refreshes every block
    results["nan"] = ddp_worker.failing_step(opt, params, full)
    params, opt = train(mesh, SCENARIOS["shampoo_adam"], steps=2)  # refreshes at 2, 4, ...
    _poison(params, mesh, 3, 6, (-1, 0), float("inf"))  # the last shard's rank holds it
    results["nan_grad"] = ddp_worker.failing_step(opt, params, full)


def _poison(params, mesh, step: int, seed: int, where: tuple, value: float) -> None:
    """Step ``step``'s gradients, with ``value`` at ``where`` of parameter 1's."""
    set_sharded_grads(params, mesh, step)
    grad = torch.randn(SHAPES[1], generator=torch.Generator().manual_seed(seed))
    grad[where] = value
    params[1].grad = distribute_tensor(grad, mesh, placements(mesh))


def _frozen(mesh, results: dict) -> None:
    """A frozen parameter and one unfrozen at step 3, sharded: as in one process."""

    params, opt, blocks = ddp_worker.train_frozen(
        SCENARIOS["shampoo_adam"], params=sharded_params(mesh),
        set_step_grads=lambda params, step, no_grad: set_sharded_grads(
            params, mesh, step, no_grad=no_grad))
    opt.consolidate_state_dict(to=None)
    results["frozen"] = {"params": [full(p) for p in params], "blocks": blocks,
                         "state": sorted(opt.state_dict()["state"])}


def _local_mode(mesh, results: dict) -> None:
    """fsdp_mode="local" equals one process run on this rank's local shards."""
    config = dict(SCENARIOS["shampoo_adam"], fsdp_mode="local")
    params, opt = train(mesh, config)
    results["local_params"] = [p.to_local().detach().clone()
                               if isinstance(p, torch.distributed.tensor.DTensor)
                               else p.detach().clone() for p in params]
    results["local_kind"] = type(opt._distributor).__name__
    results["local_state_keys"] = sorted(
        k for entry in opt.state_dict()["state"].values() for k in entry)
    # an inf in the last rank's shard only: every rank raises (local mode agrees by one
    # all_reduce of the flags), and no rank's shard moves
    params, opt = train(mesh, config, steps=2)
    _poison(params, mesh, 3, 6, (-1, 0), float("inf"))
    results["local_nan_grad"] = ddp_worker.failing_step(opt, params, full)


def _fully_shard_model(mesh, results: dict) -> None:
    """A real fully_shard model with backward: every rank ends with the same parameters,
    close to one process (the reduce-scatter rounds differently from a local sum)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))
    reference = [p.detach().clone() for p in model.parameters()]
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = DistributedShampoo(model.parameters(), **ddp_worker.WRAPPED_CONFIG)
    data = torch.Generator().manual_seed(7)
    world = dist.get_world_size()
    x, y = torch.randn(4 * world, 6, generator=data), torch.randn(4 * world, 3, generator=data)
    shard = slice(dist.get_rank() * 4, (dist.get_rank() + 1) * 4)
    ddp_worker.train_wrapped(model, opt, x[shard], y[shard])
    results["model"] = {"params": [full(p) for p in model.parameters()],
                        "initial": reference, "kind": type(opt._distributor).__name__}


def fully_shard_one_process(world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What ``_fully_shard_model`` on ``world`` ranks approximates: (initial parameters,
    parameters after one process trained on the whole batch; FSDP2 and HSDP average the
    ranks' equal shards to it, up to reduce-scatter rounding)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))
    initial = [p.detach().clone() for p in model.parameters()]
    opt = DistributedShampoo(model.parameters(), **ddp_worker.WRAPPED_CONFIG)
    data = torch.Generator().manual_seed(7)
    x, y = torch.randn(4 * world, 6, generator=data), torch.randn(4 * world, 3, generator=data)
    ddp_worker.train_wrapped(model, opt, x, y)
    return initial, [p.detach() for p in model.parameters()]


def run_world(rank: int, world: int, init_file: str, out_dir: str, resume_dir: str | None,
              hsdp: bool = False):
    join_gloo_world(rank, world, init_file)
    mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
            if hsdp else init_device_mesh("cpu", (world,)))
    results: dict = {}
    try:
        for name, config in SCENARIOS.items():
            params, opt = train(mesh, config)
            results[name] = {"params": [full(p) for p in params],
                             "state_numel": state_numel(opt),
                             "kind": type(opt._distributor).__name__,
                             "bytes": opt._distributor.bytes_last_step}
        for name in CHECKPOINTED:
            _checkpoints(mesh, out_dir, resume_dir, results, name)
        _frozen(mesh, results)
        _non_finite_refresh(mesh, results)
        _local_mode(mesh, results)
        _fully_shard_model(mesh, results)
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        results["error"] = traceback.format_exc()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_gloo_world()
