"""Per-rank optimizer-step time and state memory of data-parallel Shampoo (docs/design.md §4).

Every rank's share of the work is timed on its own (one thread per rank, as the ranks of
one machine would run), with the same gradients: steady and refresh step, the rank's state
and the all-gather volume per step. ``--e2e`` adds one rank's forward + backward (random
inputs), AdamW's step (every DDP rank runs all of it) and the overhead
``(fwd+bwd + Shampoo) / (fwd+bwd + AdamW) - 1`` with the slowest rank's Shampoo step
amortized over ``--precondition-frequency`` steps; the all-gather is not timed.

    python -m benchmarks.distributed_scaling --model resnet50 --worlds 1 2 4 8
    python -m benchmarks.distributed_scaling --model gpt2 --worlds 1 2 4 8 --repeats 1 --e2e
"""

from __future__ import annotations

import sys

import torch

from benchmarks.common import (
    MIB,
    SimulatedRank,
    arguments,
    build_model,
    hardware,
    median,
    parameters_with_grads,
    simulated_step,
    table_head,
    table_row,
    timed,
    trainable,
)


def rank_figures(model_name: str, world: int, rank: int, args) -> dict:
    params = parameters_with_grads(build_model(model_name))
    opt, refresh, steady = simulated_step(params, SimulatedRank(world, rank),
                                          args.max_preconditioner_dim, args.repeats)
    state_bytes = sum(t.numel() * t.element_size()
                      for entry in opt.local_state_dict()["state"].values() for t in entry.values())
    blocks = sum(r["owned"] for r in opt.describe_blocks())
    return {"steady": steady, "refresh": refresh, "state_bytes": state_bytes,
            "blocks": blocks, "gather_bytes": opt.distributor.all_gather_bytes()}


def model_inputs(model_name: str, args, generator: torch.Generator):
    if model_name == "resnet50":
        x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator)
        y = torch.randint(0, 1000, (args.batch_size,), generator=generator)
        return lambda model: torch.nn.functional.cross_entropy(model(x), y)
    tokens = torch.randint(0, 50257, (args.batch_size, args.seq_len), generator=generator)
    return lambda model: model(input_ids=tokens, labels=tokens).loss


def e2e_baselines(model_name: str, args) -> dict:
    """Median seconds of forward + backward and of AdamW (foreach, fused) steps."""
    model = build_model(model_name)
    loss_of = model_inputs(model_name, args, torch.Generator().manual_seed(0))

    def forward_backward() -> None:
        model.zero_grad(set_to_none=False)
        loss_of(model).backward()

    forward_backward()
    figures = {"fwd_bwd": median(timed(forward_backward, args.e2e_repeats))}
    params = trainable(model)
    for flavour in ("foreach", "fused"):
        opt = torch.optim.AdamW(params, lr=1e-3, **{flavour: True})
        opt.step()
        figures[flavour] = median(timed(opt.step, args.e2e_repeats))
    return figures


def main() -> None:
    parser = arguments(__doc__, model="resnet50", worlds=[1, 2, 4, 8], repeats=3, threads=1)
    parser.add_argument("--max-preconditioner-dim", type=int, default=1024)
    parser.add_argument("--e2e", action="store_true", help="add forward+backward and AdamW")
    parser.add_argument("--precondition-frequency", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank (--e2e)")
    parser.add_argument("--image-size", type=int, default=64, help="ResNet-50 inputs (--e2e)")
    parser.add_argument("--seq-len", type=int, default=128, help="GPT-2 inputs (--e2e)")
    parser.add_argument("--e2e-repeats", type=int, default=3)
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
    print(table_head("world", "blocks/rank (max)", "steady step s", "refresh step s",
                     "state MiB/rank (max)", "all-gather MiB/step"))
    for world, figures, slowest in rows:
        print(table_row(world, max(f["blocks"] for f in figures), f"{slowest['steady']:.3f}",
                  f"{max(f['refresh'] for f in figures):.2f}",
                  f"{max(f['state_bytes'] for f in figures) / MIB:.1f}",
                  f"{figures[0]['gather_bytes'] / MIB:.1f}"))
    if not args.e2e:
        return
    base = e2e_baselines(args.model, args)
    f = args.precondition_frequency
    what = (f"{args.batch_size} images of {args.image_size}²" if args.model == "resnet50"
            else f"{args.batch_size} × {args.seq_len} tokens")
    print(f"\n### {args.model}: end to end per rank, precondition_frequency {f}\n")
    print(f"Forward + backward of {what} per rank (random inputs), {args.threads} thread(s) "
          f"per rank: {base['fwd_bwd']:.3f} s; AdamW step: foreach {base['foreach']:.3f} s, "
          f"fused {base['fused']:.3f} s. Shampoo: the slowest rank's steady step plus its "
          f"refresh spread over {f} steps.\n")
    print(table_head("world", "Shampoo step s (amortized)", "step total s (fwd+bwd+opt)",
                     "overhead vs AdamW foreach", "vs AdamW fused"))
    for world, figures, _slowest in rows:
        amortized = max(r["steady"] + (r["refresh"] - r["steady"]) / f for r in figures)
        total = base["fwd_bwd"] + amortized
        print(table_row(world, f"{amortized:.3f}", f"{total:.3f}",
                  f"{total / (base['fwd_bwd'] + base['foreach']) - 1:+.0%}",
                  f"{total / (base['fwd_bwd'] + base['fused']) - 1:+.0%}"))


if __name__ == "__main__":
    main()
