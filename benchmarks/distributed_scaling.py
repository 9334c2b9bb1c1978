"""Per-rank optimizer-step time and state memory of data-parallel Shampoo (issue: SPEC §4).

For each world size, every rank's share of the work is timed on its own (one thread per
rank on a CPU, as the ranks of one machine would run), with the same gradients: the
steady step (factor update + preconditioning + applying every block's update), the
refresh step (eigendecompositions of the rank's factors), the rank's optimizer state,
and the all-gather volume per step. Prints a markdown table; ``--write`` puts it into
BENCHMARKS.md between markers.

    python benchmarks/distributed_scaling.py --model resnet50 --worlds 1 2 4 8
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SimulatedRank, build_model, hardware, median, parameters_with_grads, timed  # noqa: E402

from hf_shampoo import DistributedShampoo  # noqa: E402


def rank_figures(model_name: str, world: int, rank: int, args) -> dict:
    model = build_model(model_name)
    params = parameters_with_grads(model)
    opt = DistributedShampoo(params, lr=1e-3, betas=(0.9, 0.999), grafting="adam",
                             max_preconditioner_dim=args.max_preconditioner_dim,
                             precondition_frequency=10**6, start_preconditioning_step=10**6,
                             distributed="none")
    opt._distributor = SimulatedRank(world, rank)  # before the first step builds the layout
    opt.step()  # allocates state (a grafting-only step)
    for group in opt.param_groups:  # next step is t = s: the first refresh; then steady steps
        group["step"] = group["start_preconditioning_step"] - 1
    refresh = timed(opt.step, 1)[0]
    steady = timed(opt.step, args.repeats)
    state_bytes = sum(t.numel() * t.element_size()
                      for entry in opt.local_state_dict()["state"].values() for t in entry.values())
    blocks = sum(len(s.members) for s in opt._layout.owned)
    return {"steady": median(steady), "refresh": refresh, "state_bytes": state_bytes,
            "blocks": blocks, "gather_bytes": opt._distributor.all_gather_bytes()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["resnet50", "gpt2"], default="resnet50")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-preconditioner-dim", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for world in args.worlds:
        figures = [rank_figures(args.model, world, r, args) for r in range(world)]
        slowest = max(figures, key=lambda f: f["steady"])
        rows.append((world, figures, slowest))
        refresh = max(f["refresh"] for f in figures)
        print(f"world {world}: steady max {slowest['steady']:.3f}s, refresh max {refresh:.2f}s",
              file=sys.stderr)
    print(f"\n### {args.model}: per-rank optimizer step (max over ranks)\n")
    print(f"Hardware: {hardware()}; max_preconditioner_dim {args.max_preconditioner_dim}, "
          "Adam grafting, float32 communication.\n")
    head = "| world | blocks/rank (max) | steady step s | refresh step s | state MiB/rank (max) | all-gather MiB/step |"
    print(head)
    print("|" + "---|" * 6)
    for world, figures, slowest in rows:
        refresh = max(f["refresh"] for f in figures)
        print(f"| {world} | {max(f['blocks'] for f in figures)} | {slowest['steady']:.3f} | "
              f"{refresh:.2f} | {max(f['state_bytes'] for f in figures) / 2**20:.1f} | "
              f"{figures[0]['gather_bytes'] / 2**20:.1f} |")


if __name__ == "__main__":
    main()
