"""Per-rank optimizer state and bytes communicated per step under FSDP2 (docs/design.md §8).

Computed for simulated ranks of 1-D FSDP2 meshes (the real block assignment and
communication plan of ``hf_shampoo.distributors.sharded``, no process group): the largest
rank's state (Shampoo with Adam grafting, float32) and per-step buffers, and the bytes all
ranks send in a step (gradients in, directions out) and the busiest rank's sent + received,
for DDP (one all-gather of every direction), FSDP2 lossless (ours: only rows the owner
lacks travel), FSDP2 local (nothing beyond FSDP's) and Meta's lossless distributor (whole
parameters owned, greedy by size; two all_to_all moving every row its owner lacks).
``--time`` adds the busiest rank's steady and refresh step, one thread (collectives not
timed).

    python -m benchmarks.sharded_scaling --models resnet50 gpt2 --worlds 2 4 8
    python -m benchmarks.sharded_scaling --models resnet50 --worlds 2 4 8 --time
"""

from __future__ import annotations

import math

import torch

from benchmarks.common import (
    MIB,
    SimulatedOwner,
    SimulatedRank,
    arguments,
    block_shape,
    blocks_of,
    build_model,
    hardware,
    owners,
    row_counts,
    simulated_sharded,
    simulated_step,
    state_bytes,
    table_head,
    table_row,
)
from hf_shampoo.blocking import ParamBlocking
from hf_shampoo.config import DEFAULTS
from hf_shampoo.distributors import greedy_assignment

GROUP = {**DEFAULTS, "grafting": "adam", "betas": (0.9, 0.999), "lr": 1e-3}


def block_state(shape: tuple[int, ...]) -> int:
    return sum(state_bytes(shape, GROUP).values())


def shard_state(p, world: int, max_dim: int) -> list[int]:
    """Each rank's state bytes for its FSDP2 shard of ``p`` (its rows) preconditioned alone."""
    state = [0] * world
    for r, n in enumerate(row_counts(p.shape[0] if p.dim() else 1, world)):
        if n:
            shape = (n, *p.shape[1:]) if p.dim() else ()
            state[r] += sum(block_state(s) for s in ParamBlocking.of(shape, max_dim).block_shapes)
    return state


def rank_state(params, world: int, max_dim: int, scheme: str) -> list[int]:
    """State bytes per rank: blocks owned (``ddp``, ``lossless``) or shards (``local``)."""
    if scheme == "local":
        return [sum(s) for s in zip(*(shard_state(p, world, max_dim) for p in params))]
    state = [0] * world
    for shape, owner in owners(params, world, "ddp" if scheme == "ddp" else "fsdp", max_dim):
        state[owner] += block_state(shape)
    return state


def exchange(sent: list[int], received: list[int], a: int, b: int, nbytes: int) -> None:
    """``nbytes`` from rank ``a`` to ``b`` and as many back (gradient in, direction out)."""
    for src, dst in ((a, b), (b, a)):
        sent[src] += nbytes
        received[dst] += nbytes


def lossless(params, world: int, max_dim: int) -> dict:
    d = simulated_sharded(world)
    blocks = blocks_of(params, max_dim)
    buffers, sent, received = [0] * world, [0] * world, [0] * world
    for block, owner in zip(blocks, d.assign(blocks, [block_shape(b) for b in blocks])):
        buffers[owner] += 2 * math.prod(block_shape(block)) * 4  # gathered gradient + direction
        for cut in d.cuts(block):
            holder = cut.ranks[0]  # one holder per part on a 1-D mesh
            if holder != owner:
                exchange(sent, received, holder, owner, cut.numel * 4)
    return {"state": max(rank_state(params, world, max_dim, "lossless")),
            "buffers": max(buffers), "total": sum(sent),
            "rank": max(s + r for s, r in zip(sent, received))}


def ddp(params, world: int, max_dim: int) -> dict:
    own = [0] * world
    for shape, owner in owners(params, world, "ddp", max_dim):
        own[owner] += math.prod(shape)
    segment = max(own) * 4  # the all-gather moves one equal segment per rank
    return {"state": max(rank_state(params, world, max_dim, "ddp")), "buffers": world * segment,
            "total": world * (world - 1) * segment, "rank": world * segment}


def local(params, world: int, max_dim: int) -> dict:
    return {"state": max(rank_state(params, world, max_dim, "local")), "buffers": 0,
            "total": 0, "rank": 0}


def meta_lossless(params, world: int, max_dim: int) -> dict:
    """Whole parameters to owners by size (greedy), full gradients gathered to the owner and
    the updated rows sent back: two all_to_all moving every row its owner lacks."""
    state, sent, received = [0] * world, [0] * world, [0] * world
    for p, owner in zip(params, greedy_assignment([float(p.numel()) for p in params], world)):
        state[owner] += sum(block_state(s) for s in ParamBlocking.of(p.shape, max_dim).block_shapes)
        rows = p.shape[0] if p.dim() else 1
        for r, n in enumerate(row_counts(rows, world)):
            if r != owner and n:
                exchange(sent, received, r, owner, n * (p.numel() // rows) * 4)
    return {"state": max(state), "buffers": None, "total": sum(sent),
            "rank": max(s + r for s, r in zip(sent, received))}


def rank_times(params, world: int, rank: int, scheme: str, args) -> tuple[float, float]:
    """(steady, refresh) seconds of one rank's optimizer step."""
    g = torch.Generator().manual_seed(0)
    tensors = []
    for p in params:
        if scheme == "local" and p.dim():
            chunk = -(-p.shape[0] // world)
            p = p[min(p.shape[0], rank * chunk): min(p.shape[0], (rank + 1) * chunk)]
            if p.numel() == 0:
                continue
        t = torch.nn.Parameter(p.detach().clone())
        t.grad = torch.randn(t.shape, generator=g) * 1e-2
        tensors.append(t)
    distributor = {"lossless": SimulatedOwner, "ddp": SimulatedRank}.get(scheme)
    _, refresh, steady = simulated_step(tensors, distributor and distributor(world, rank),
                                        args.max_preconditioner_dim, args.repeats)
    return steady, refresh


SCHEMES = {"DDP (all-gather)": ddp, "FSDP2 lossless (ours)": lossless,
           "FSDP2 local": local, "Meta lossless (2x all_to_all)": meta_lossless}


def main() -> None:
    parser = arguments(__doc__, models=["resnet50", "gpt2"], worlds=[2, 4, 8], repeats=3)
    parser.add_argument("--max-preconditioner-dim", type=int, default=1024)
    parser.add_argument("--time", action="store_true", help="time the busiest rank's step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"Hardware: {hardware()} (figures are computed, not timed)\n")
    for name in args.models:
        params = [p.detach() for p in build_model(name).parameters() if p.requires_grad]
        numel = sum(p.numel() for p in params)
        print(f"### {name}: {numel / 1e6:.1f}M parameters, max_preconditioner_dim "
              f"{args.max_preconditioner_dim}, Adam grafting, float32\n")
        print(table_head("world", "scheme", "state MiB/rank (max)", "buffers MiB/rank",
                         "MiB/step, all ranks", "MiB/step, busiest rank"))
        for world in args.worlds:
            for scheme, fn in SCHEMES.items():
                r = fn(params, world, args.max_preconditioner_dim)
                buffers = "n/a" if r["buffers"] is None else f"{r['buffers'] / MIB:.0f}"
                print(table_row(world, scheme, f"{r['state'] / MIB:.0f}", buffers,
                          f"{r['total'] / MIB:.0f}", f"{r['rank'] / MIB:.0f}"))
        print()
        if not args.time:
            continue
        print(f"#### {name}: the busiest rank's optimizer step, 1 thread\n")
        print(table_head("world", "scheme", "rank", "steady step s", "refresh step s"))
        for world in args.worlds:
            for label, scheme in (("DDP", "ddp"), ("FSDP2 lossless", "lossless"),
                                  ("FSDP2 local", "local")):
                state = rank_state(params, world, args.max_preconditioner_dim, scheme)
                rank = max(range(world), key=state.__getitem__)  # the busiest
                steady, refresh = rank_times(params, world, rank, scheme, args)
                print(table_row(world, label, rank, f"{steady:.3f}", f"{refresh:.2f}"), flush=True)
        print()


if __name__ == "__main__":
    main()
