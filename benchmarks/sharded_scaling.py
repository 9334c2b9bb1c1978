"""Per-rank optimizer state and bytes communicated per step under FSDP2 (docs/design.md §8).

For ResNet-50 and GPT-2 small shapes at world 2/4/8 (1-D FSDP2 meshes, simulated ranks:
the real block assignment and communication plan of ``hf_shampoo.distributors.fsdp`` are computed
for every rank without a process group), this prints, per scheme:

- ``state MiB/rank``: the largest rank's optimizer state (Shampoo with Adam grafting,
  beta1 = 0.9, float32), and ``buffers``: its per-step gradient and direction buffers;
- ``MiB/step``: bytes all ranks send in a step (gradients in, directions out), and the
  largest rank's sent + received bytes.

Schemes: DDP (docs/design.md §4: one all-gather of every direction), FSDP2 lossless (ours: block
owners, only rows the owner lacks travel), FSDP2 local (no communication beyond FSDP's),
and the baseline of Meta's lossless distributor (whole parameters owned, greedy by size;
two all_to_all per step moving every row its owner lacks).

``--time`` adds the busiest rank's optimizer step (DDP and lossless: its owned blocks, with
every direction still applied; local: its shard's blocks), steady and refresh, one thread,
timed as ``distributed_scaling.py`` does
(the collectives are not timed; their volume is in the first table).

    python -m benchmarks.sharded_scaling --models resnet50 gpt2 --worlds 2 4 8
    python -m benchmarks.sharded_scaling --models resnet50 --worlds 2 4 8 --time
"""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks.common import (
    SimulatedRank,
    block_shape,
    blocks_of,
    build_model,
    hardware,
    median,
    simulated_sharded,
    timed,
)
from hf_shampoo import DistributedShampoo
from hf_shampoo.blocking import ParamBlocking
from hf_shampoo.config import DEFAULTS
from hf_shampoo.distributors import SingleProcessDistributor, block_cost, greedy_assignment
from hf_shampoo.stack import BlockStack

MIB = 2.0**20
GROUP = {**DEFAULTS, "grafting": "adam", "betas": (0.9, 0.999), "lr": 1e-3}


def state_numel(shape: tuple[int, ...], group: dict) -> int:
    stack = BlockStack(0, shape, [], torch.float32)
    return sum(math.prod(s) for s, _ in stack.expected_state(group).values())


def lossless(params, world: int, max_dim: int) -> dict:
    d = simulated_sharded(world)
    blocks = blocks_of(params, max_dim)
    owners = d.assign(blocks, [block_shape(b) for b in blocks])
    state = [0] * world
    buffers = [0] * world
    sent = [0] * world
    received = [0] * world
    for block, owner in zip(blocks, owners):
        shape = block_shape(block)
        state[owner] += state_numel(shape, GROUP) * 4
        buffers[owner] += 2 * math.prod(shape) * 4  # gathered gradient + direction
        for cut in d.cuts(block):
            holder = cut.ranks[0]  # one holder per part on a 1-D mesh
            if holder != owner:  # gradient rows in, direction rows back
                nbytes = cut.numel * 4
                sent[holder] += nbytes
                received[owner] += nbytes
                sent[owner] += nbytes
                received[holder] += nbytes
    return {"state": max(state), "buffers": max(buffers), "total": sum(sent),
            "rank": max(s + r for s, r in zip(sent, received))}


def ddp(params, world: int, max_dim: int) -> dict:
    blocks = blocks_of(params, max_dim)
    shapes = [block_shape(b) for b in blocks]
    owners = greedy_assignment([block_cost(s) for s in shapes], world)
    state, own = [0] * world, [0] * world
    for shape, owner in zip(shapes, owners):
        state[owner] += state_numel(shape, GROUP) * 4
        own[owner] += math.prod(shape)
    segment = max(own) * 4  # the all-gather moves one equal segment per rank
    return {"state": max(state), "buffers": world * segment,
            "total": world * (world - 1) * segment, "rank": world * segment}


def local(params, world: int, max_dim: int) -> dict:
    state = [0] * world
    for p in params:
        rows = p.shape[0] if p.dim() else 1
        chunk = -(-rows // world)
        for r in range(world):
            n = max(0, min(rows, (r + 1) * chunk) - min(rows, r * chunk))
            if n == 0:
                continue
            shape = (n, *p.shape[1:]) if p.dim() else ()
            for bshape in ParamBlocking.of(shape, max_dim).block_shapes:
                state[r] += state_numel(bshape, GROUP) * 4
    return {"state": max(state), "buffers": 0, "total": 0, "rank": 0}


def meta_lossless(params, world: int, max_dim: int) -> dict:
    """Whole parameters to owners by size (greedy), full gradients gathered to the owner and
    the updated rows sent back: two all_to_all moving every row its owner lacks."""
    sizes = [p.numel() for p in params]
    owners = greedy_assignment([float(s) for s in sizes], world)
    state = [0] * world
    sent, received = [0] * world, [0] * world
    for p, owner in zip(params, owners):
        for shape in ParamBlocking.of(p.shape, max_dim).block_shapes:
            state[owner] += state_numel(shape, GROUP) * 4
        rows = p.shape[0] if p.dim() else 1
        row = p.numel() // rows
        chunk = -(-rows // world)
        for r in range(world):
            n = max(0, min(rows, (r + 1) * chunk) - min(rows, r * chunk))
            if r != owner and n:
                nbytes = n * row * 4
                sent[r] += nbytes
                received[owner] += nbytes
                sent[owner] += nbytes
                received[r] += nbytes
    return {"state": max(state), "buffers": None, "total": sum(sent),
            "rank": max(s + r for s, r in zip(sent, received))}


class SimulatedOwner(SingleProcessDistributor):
    """Rank ``rank`` of a ``world``-rank lossless run without communicating: the real
    assignment, only this rank's blocks computed (every direction is still applied)."""

    def __init__(self, world: int, rank: int) -> None:
        super().__init__()
        self.world_size, self.rank = world, rank

    def assign(self, blocks, block_shapes, costs=None):
        return simulated_sharded(self.world_size).assign(blocks, block_shapes, costs)


def busiest(params, world: int, max_dim: int, scheme: str) -> int:
    """The rank with the most state under the scheme."""
    state = [0] * world
    if scheme == "ddp":
        shapes = [block_shape(b) for b in blocks_of(params, max_dim)]
        for shape, owner in zip(shapes, greedy_assignment([block_cost(s) for s in shapes],
                                                           world)):
            state[owner] += state_numel(shape, GROUP)
        return max(range(world), key=lambda r: state[r])
    if scheme == "local":
        for p in params:
            rows = p.shape[0] if p.dim() else 1
            chunk = -(-rows // world)
            for r in range(world):
                n = max(0, min(rows, (r + 1) * chunk) - min(rows, r * chunk))
                if n:
                    state[r] += sum(state_numel(b, GROUP) for b in ParamBlocking.of(
                        (n, *p.shape[1:]) if p.dim() else (), max_dim).block_shapes)
        return max(range(world), key=lambda r: state[r])
    d = simulated_sharded(world)
    blocks = blocks_of(params, max_dim)
    for block, owner in zip(blocks, d.assign(blocks, [block_shape(b) for b in blocks])):
        state[owner] += state_numel(block_shape(block), GROUP)
    return max(range(world), key=lambda r: state[r])


def rank_times(params, world: int, rank: int, scheme: str, args) -> tuple[float, float]:
    """(steady, refresh) seconds of one rank's optimizer step."""
    local_mode = scheme == "local"
    g = torch.Generator().manual_seed(0)
    tensors = []
    for p in params:
        if local_mode and p.dim():
            chunk = -(-p.shape[0] // world)
            p = p[min(p.shape[0], rank * chunk): min(p.shape[0], (rank + 1) * chunk)]
            if p.numel() == 0:
                continue
        t = torch.nn.Parameter(p.detach().clone())
        t.grad = torch.randn(t.shape, generator=g) * 1e-2
        tensors.append(t)
    opt = DistributedShampoo(tensors, lr=1e-3, betas=(0.9, 0.999), grafting="adam",
                             max_preconditioner_dim=args.max_preconditioner_dim,
                             precondition_frequency=10**6, start_preconditioning_step=10**6,
                             distributed="none")
    if scheme == "lossless":
        opt.distributor = SimulatedOwner(world, rank)
    elif scheme == "ddp":
        opt.distributor = SimulatedRank(world, rank)
    opt.step()  # allocates state (a grafting-only step)
    for group in opt.param_groups:  # the next step is the first refresh, then steady steps
        group["step"] = group["start_preconditioning_step"] - 1
    refresh = timed(opt.step, 1)[0]
    return median(timed(opt.step, args.repeats)), refresh


SCHEMES = {"DDP (all-gather)": ddp, "FSDP2 lossless (ours)": lossless,
           "FSDP2 local": local, "Meta lossless (2x all_to_all)": meta_lossless}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet50", "gpt2"])
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--max-preconditioner-dim", type=int, default=1024)
    parser.add_argument("--time", action="store_true", help="time the busiest rank's step")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"Hardware: {hardware()} (figures are computed, not timed)\n")
    for name in args.models:
        params = [p.detach() for p in build_model(name).parameters() if p.requires_grad]
        numel = sum(p.numel() for p in params)
        print(f"### {name}: {numel / 1e6:.1f}M parameters, max_preconditioner_dim "
              f"{args.max_preconditioner_dim}, Adam grafting, float32\n")
        print("| world | scheme | state MiB/rank (max) | buffers MiB/rank | MiB/step, all ranks "
              "| MiB/step, busiest rank |")
        print("|---|---|---|---|---|---|")
        for world in args.worlds:
            for scheme, fn in SCHEMES.items():
                r = fn(params, world, args.max_preconditioner_dim)
                buffers = "n/a" if r["buffers"] is None else f"{r['buffers'] / MIB:.0f}"
                print(f"| {world} | {scheme} | {r['state'] / MIB:.0f} | {buffers} | "
                      f"{r['total'] / MIB:.0f} | {r['rank'] / MIB:.0f} |")
        print()
        if not args.time:
            continue
        print(f"#### {name}: the busiest rank's optimizer step, 1 thread\n")
        print("| world | scheme | rank | steady step s | refresh step s |")
        print("|---|---|---|---|---|")
        for world in args.worlds:
            for label, scheme in (("DDP", "ddp"), ("FSDP2 lossless", "lossless"),
                                  ("FSDP2 local", "local")):
                rank = busiest(params, world, args.max_preconditioner_dim, scheme)
                steady, refresh = rank_times(params, world, rank, scheme, args)
                print(f"| {world} | {label} | {rank} | {steady:.3f} | {refresh:.2f} |",
                      flush=True)
        print()


if __name__ == "__main__":
    main()
