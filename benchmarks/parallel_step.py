"""Per-rank optimizer step and bytes per step under FSDP2 x tensor parallel (docs/parallelism.md).

GPT-2 small's parameters are placed on a ``(dp_shard 2, tp 2)`` mesh of 4 gloo ranks as a
Megatron-style plan and FSDP2 leave them (``Conv1D`` weights are ``(in, out)``: attention
and MLP inputs colwise = ``Shard(1)``, their outputs rowwise = ``Shard(0)``, the vocabulary
``Shard(0)``, the rest replicated; FSDP2's ``Shard(0)`` or ``_StridedShard`` on top). The
schemes (``lossless`` ours, ``full_tensor`` on every rank with the whole step repeated,
``ddp`` on plain parameters) take the same steady step (Adam grafting, blocks of 1024).
Bytes per rank: measured (``bytes_last_step``) and computed from the layout for ours,
computed for the others (a ring all-gather sends and receives what a rank lacks).

    python -m benchmarks.parallel_step --steps 3 --layers 4
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import MIB, arguments, build_model, hardware, table_head, table_row
from hf_shampoo import DistributedShampoo

WORLD = 4
CONFIG = dict(lr=1e-3, betas=(0.9, 0.999), grafting="adam", max_preconditioner_dim=1024,
              precondition_frequency=10**6, start_preconditioning_step=10**6)


def tp_placements(name: str, shape: tuple[int, ...]):
    """The tensor-parallel placement of a GPT-2 parameter and FSDP2's on top."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    col, row, rep = Shard(1), Shard(0), Replicate()
    if name.endswith("wte.weight"):
        tp = row  # vocabulary parallel
    elif name.endswith(("c_attn.weight", "c_fc.weight")):
        tp = col  # Conv1D (in, out): colwise is the output dim
    elif name.endswith(("c_attn.bias", "c_fc.bias")):
        tp = row
    elif name.endswith("c_proj.weight"):
        tp = row  # rowwise: the input dim
    else:
        tp = rep
    fsdp = _StridedShard(0, split_factor=2) if tp == row else Shard(0)
    return [fsdp, tp]


def named_gpt2(layers: int = 12):
    """GPT-2 small's parameters (its shapes; ``layers`` of its 12 blocks)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = build_model("gpt2") if layers == 12 else GPT2LMHeadModel(GPT2Config(n_layer=layers))
    return [(n, p.detach()) for n, p in model.named_parameters()]


def gradients(params, step: int):
    g = torch.Generator().manual_seed(step)
    return [torch.randn(p.shape, generator=g) * 1e-2 for p in params]


def placed(named, mesh):
    """The parameters ``named`` as DTensors on ``mesh`` by ``tp_placements``, and a function
    that places full gradients like them."""
    from torch.distributed.tensor import distribute_tensor

    placements = [tp_placements(n, tuple(t.shape)) for n, t in named]
    params = [torch.nn.Parameter(distribute_tensor(t, mesh, pl, src_data_rank=None))
              for (_, t), pl in zip(named, placements)]

    def place_grads(grads):
        for p, g, pl in zip(params, grads, placements):
            p.grad = distribute_tensor(g, mesh, pl, src_data_rank=None)

    return params, place_grads


def steady_step_times(opt, full, place_grads, steps: int) -> list[float]:
    """One grafting-only step (the state allocated), then ``steps`` preconditioned steps
    without a refresh, each timed after a barrier."""
    place_grads(gradients(full, 0))
    opt.step()
    for group in opt.param_groups:
        group["step"] = group["start_preconditioning_step"]
    times = []
    for step in range(1, steps + 1):
        place_grads(gradients(full, step))
        dist.barrier()
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return times


def run_rank(rank: int, scheme: str, init_file: str, out: str, steps: int,
             layers: int = 12) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    named = named_gpt2(layers)
    full = [t for _, t in named]
    measured, planned, computed = 0, 0, 0
    if scheme == "ddp":
        params = [torch.nn.Parameter(t.clone()) for t in full]
        opt = DistributedShampoo(params, distributed="ddp", **CONFIG)
        place_grads = lambda grads: [setattr(p, "grad", g) for p, g in zip(params, grads)]
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        params, place_grads = placed(named, mesh)
        if scheme == "lossless":
            opt = DistributedShampoo(params, **CONFIG)
        else:  # full_tensor on every rank: one process's optimizer on full copies
            copies = [torch.nn.Parameter(t) for t in full]  # the full tensors themselves
            inner = DistributedShampoo(copies, distributed="none", **CONFIG)

            class FullTensorStep:
                param_groups = inner.param_groups

                @torch.no_grad()
                def step(self):
                    for p, c in zip(params, copies):
                        c.grad = p.grad.full_tensor()
                    inner.step()
                    for p, c in zip(params, copies):
                        p.to_local().copy_(_local_part(c.detach(), p))

            opt = FullTensorStep()
            for p in params:
                computed += 2 * (p.numel() - p.to_local().numel()) * 4
    times = steady_step_times(opt, full, place_grads, steps)
    if scheme == "lossless":
        measured = opt.distributor.bytes_last_step
        planned = opt.distributor.planned_bytes()
        computed = planned
    elif scheme == "ddp":
        rows = opt.describe_blocks()
        segment = max(sum(math.prod(row["shape"]) for row in rows if row["rank"] == r)
                      for r in range(WORLD))
        computed = 2 * (WORLD - 1) * segment * 4
    state = sum(t.numel() * t.element_size() for entry in (
        opt.local_state_dict() if scheme != "full_tensor" else inner.state_dict()
    )["state"].values() for t in entry.values())
    torch.save({"median": statistics.median(times), "measured": measured,
                "computed": computed, "state": state}, os.path.join(out, f"{scheme}{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _local_part(whole: torch.Tensor, param) -> torch.Tensor:
    from hf_shampoo.distributors.placements import mesh_boxes

    box = mesh_boxes(param)[dist.get_rank()]
    return whole[tuple(slice(a, b) for a, b in box)]


def spawn_each(run_rank, names, steps: int, layers: int, world: int, prefix: str
               ) -> list[tuple[str, list]]:
    """``run_rank`` on ``world`` gloo ranks once per name (a scheme, a layout), each run with
    its own rendezvous file in a fresh directory (``prefix``): every rank's result
    (``<name><rank>.pt`` there), by name."""
    root = tempfile.mkdtemp(prefix=prefix)
    rows = []
    for name in names:
        mp.spawn(run_rank, args=(name, os.path.join(root, f"init_{name}"), root, steps, layers),
                 nprocs=world, join=True)
        rows.append((name, [torch.load(os.path.join(root, f"{name}{r}.pt"))
                            for r in range(world)]))
    return rows


def main() -> None:
    parser = arguments(__doc__, steps=3)
    parser.add_argument("--schemes", nargs="+", default=["lossless", "full_tensor", "ddp"])
    parser.add_argument("--layers", type=int, default=12,
                        help="GPT-2 small's blocks to keep (12: all; the full_tensor scheme "
                             "holds one process's whole state on every rank)")
    args = parser.parse_args()
    rows = spawn_each(run_rank, args.schemes, args.steps, args.layers, WORLD,
                      "hf_shampoo_parallel_step_")
    torch.set_num_threads(1)
    print(f"# Optimizer step on 4 gloo ranks, GPT-2 small's shapes ({args.layers} of 12 "
          f"blocks), dp_shard 2 x tp 2 ({hardware()}, one thread per rank)\n")
    names = {"lossless": "lossless (ours), dp_shard 2 x tp 2",
             "full_tensor": "full_tensor on every rank, dp_shard 2 x tp 2",
             "ddp": "DDP on 4 ranks (plain parameters)"}
    print(table_head("scheme", "step s (slowest rank, median)",
                     "MiB/step per rank, measured (max)", "MiB/step per rank, computed (max)",
                     "state MiB/rank (max)"))
    for scheme, got in rows:
        measured = max(g["measured"] for g in got)
        print(table_row(names[scheme], f"{max(g['median'] for g in got):.3f}",
                        f"{measured / MIB:.1f}" if measured else "n/a",
                        f"{max(g['computed'] for g in got) / MIB:.1f}",
                        f"{max(g['state'] for g in got) / MIB:.0f}"))


if __name__ == "__main__":
    main()
