"""Per-rank optimizer step, bytes and state with pipeline stages (docs/parallelism.md).

GPT-2 small's parameters on 8 gloo ranks, two layouts of the same world:

- ``pp``: 2 pipeline stages x (dp_shard 2 x tp 2), from one ``("pp", "dp_shard", "tp")``
  mesh; stage 0 holds the embeddings and the first half of the blocks, stage 1 the rest
  and the final norm; one optimizer per stage, its blocks spread over the stage's 4 ranks;
- ``flat``: every parameter on a ``(dp_shard 4, tp 2)`` mesh, one optimizer over all
  8 ranks (FSDP2 x TP without pipelining).

Placements as ``benchmarks/parallel_step.py`` (Megatron-style TP, FSDP2's ``Shard(0)`` or
``_StridedShard`` on top; the vocabulary padded to a multiple of 8 rows, as Megatron pads
it). Each rank takes the same steady step (Adam grafting, blocks of
1024, no refresh) on gradients placed like its parameters: the optimizer alone, not the
model's forward and backward. Bytes per rank: measured (``bytes_last_step``) and computed
from the plan (``planned_bytes``).

    python -m benchmarks.pipeline_step --steps 3 --layers 4
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist

from benchmarks.common import MIB, arguments, hardware, table_head, table_row
from benchmarks.parallel_step import CONFIG, named_gpt2, placed, spawn_each, steady_step_times
from hf_shampoo import DistributedShampoo

WORLD = 8


def stage_of(name: str, layers: int) -> int:
    """Stage 0: embeddings and blocks ``[0, layers / 2)``; stage 1: the rest."""
    if ".h." in f".{name}":
        block = int(name.split(".h.")[1].split(".")[0])
        return 0 if block < layers // 2 else 1
    return 0 if "wte" in name or "wpe" in name else 1


def run_rank(rank: int, layout: str, init_file: str, out: str, steps: int,
             layers: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    # the vocabulary padded to a multiple of 8 rows, as Megatron pads it: torch's
    # distribute_tensor places uneven _StridedShard rows otherwise than FSDP2 does
    named = [(n, torch.cat([t, t.new_zeros((-t.shape[0]) % 8, *t.shape[1:])])
              if n.endswith("wte.weight") else t) for n, t in named_gpt2(layers)]
    if layout == "pp":
        world = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp_shard", "tp"))
        stage = world["pp"].get_local_rank()
        mesh = world["dp_shard", "tp"]
        named = [(n, t) for n, t in named if stage_of(n, layers) == stage]
    else:
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp_shard", "tp"))
    full = [t for _, t in named]
    params, place_grads = placed(named, mesh)
    opt = DistributedShampoo(params, **CONFIG)
    times = steady_step_times(opt, full, place_grads, steps)
    state = sum(t.numel() * t.element_size()
                for entry in opt.local_state_dict()["state"].values() for t in entry.values())
    torch.save({"median": statistics.median(times),
                "measured": opt.distributor.bytes_last_step,
                "planned": opt.distributor.planned_bytes(), "state": state,
                "group": list(opt.distributor.group.ranks),
                "elements": sum(t.numel() for t in full)},
               os.path.join(out, f"{layout}{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = arguments(__doc__, steps=3)
    parser.add_argument("--layers", type=int, default=4,
                        help="GPT-2 small's blocks to keep (an even number; 12: all)")
    parser.add_argument("--layouts", nargs="+", default=["pp", "flat"],
                        choices=["pp", "flat"])
    args = parser.parse_args()
    rows = spawn_each(run_rank, args.layouts, args.steps, args.layers, WORLD,
                      "hf_shampoo_pipeline_step_")
    print(f"# Optimizer step on 8 gloo ranks, GPT-2 small's shapes ({args.layers} of 12 "
          f"blocks) ({hardware()}, one thread per rank)\n")
    names = {"pp": "2 stages x (dp_shard 2 x tp 2), one optimizer per stage",
             "flat": "dp_shard 4 x tp 2, one optimizer (no pipeline)"}
    print(table_head("layout", "blocks spread over", "step s (slowest rank, median)",
                     "MiB/step per rank, measured (max)", "MiB/step per rank, computed (max)",
                     "state MiB/rank (max)", "state MiB (all ranks)"))
    for layout, got in rows:
        groups = sorted({tuple(g["group"]) for g in got})
        print(table_row(names[layout], " and ".join(str(list(g)) for g in groups),
                        f"{max(g['median'] for g in got):.3f}",
                        f"{max(g['measured'] for g in got) / MIB:.1f}",
                        f"{max(g['planned'] for g in got) / MIB:.1f}",
                        f"{max(g['state'] for g in got) / MIB:.0f}",
                        f"{sum(g['state'] for g in got) / MIB:.0f}"))


if __name__ == "__main__":
    main()
