"""Sketchy's step time against Shampoo's at the same blocks (docs/benchmarks/sketchy.md#step-time).

Both optimizers run on the same parameter shapes, the same fixed random gradients and the
same blocks, in interleaved rounds (machine load hits them alike; medians reported). The
step counter is set as in ``step_time.py`` so that the timed steps are refreshes (the
first: ``eigh`` of every Shampoo factor; Sketchy's roots come from its sketches) and
steady steps. Shampoo's factor update is a product; Sketchy's is a thin SVD of every
sketched dim's ``d × (k + m)`` matrix, every step, so its cost is in the steady step.
With ``statistics_frequency = s`` the sketches take the gradient every ``s`` steps (and at
refreshes): the table gives the steady steps that sample and those that do not, the
refresh step, and the mean step over a refresh period ``f`` (``mean_step``).

Shapes: ``ablation`` is the ablation's and the fine-tune's GPT-2 (2 layers, 128 wide,
blocks of 128, ``f = 10``); ``gpt2-layer`` one layer of GPT-2 small (768 wide: c_attn,
attention c_proj, c_fc, MLP c_proj; blocks of 1024, ``f = 100``).

    python -m benchmarks.sketchy_step_time --shapes ablation --ranks 8 16
    python -m benchmarks.sketchy_step_time --shapes gpt2-layer --ranks 64 256 --rounds 3
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import command_line, hardware, load_average, median, table_head, table_row
from benchmarks.step_time import F, ours
from benchmarks.tasks import make_gpt2

SHAPES = {
    # (shapes, max_preconditioner_dim, refresh period f, default statistics frequencies)
    "ablation": (None, 128, 10, (1, 2, 5, 10)),
    "gpt2-layer": ([(768, 2304), (768, 768), (768, 3072), (3072, 768)], 1024, 100, (1, 10)),
}


def shapes_of(name: str) -> list[tuple[int, ...]]:
    shapes = SHAPES[name][0]
    if shapes is None:
        return [tuple(p.shape) for p in make_gpt2(0, n_embd=128).parameters()]
    return shapes


def build(name: str, shapes, block: int, frequency: int, rank: int | None = None,
          every: int = 1):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes]
    grads = [torch.randn(s, generator=g) * 1e-2 for s in shapes]
    kind = {} if rank is None else dict(preconditioner="sketchy", sketch_rank=rank,
                                        epsilon=1e-7, statistics_frequency=every)
    runner = ours(params, grads, name=name, max_preconditioner_dim=block, **kind)
    runner.frequency, runner.every, runner.skipped = frequency, every, []
    return runner


def mean_step(runner) -> float:
    """The mean step over a refresh period ``f``: one refresh, ``f/s − 1`` steady steps that
    sample the gradient into the sketches and ``f − f/s`` that do not (medians of each)."""
    f, s = runner.frequency, runner.every
    sampled, refresh = median(runner.steady), median(runner.refresh)
    skipped = median(runner.skipped) if runner.skipped else sampled
    return (refresh + (f // s - 1) * sampled + (f - f // s) * skipped) / f


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=list(SHAPES), default="ablation")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--every", type=int, nargs="+", default=None,
                        help="Sketchy's statistics_frequency values (default: 1 and divisors "
                             "of f, per --shapes)")
    parser.add_argument("--rounds", type=int, default=5, help="refresh + steady steps each")
    parser.add_argument("--steady", type=int, default=3, help="steady steps per round")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    _, block, frequency, everies = SHAPES[args.shapes]
    shapes = shapes_of(args.shapes)
    runners = [build("Shampoo", shapes, block, frequency)]
    runners += [build(f"Sketchy, rank {k}" + (f", statistics every {s}" if s > 1 else ""),
                      shapes, block, frequency, k, s)
                for k in args.ranks for s in (args.every or everies)]
    for runner in runners:  # warm-up: state allocated, a first refresh done
        runner.set_step(F - 1)
        runner.step()
        runner.step()
    for _ in range(args.rounds):
        for runner in runners:
            runner.set_step(F - 1)  # the next step refreshes (F is a multiple of every s)
            runner.refresh.append(runner.step())
            for t in range(F + 1, F + 1 + max(args.steady, runner.every)):
                (runner.steady if t % runner.every == 0 else runner.skipped).append(
                    runner.step())
    print(f"`{command_line()}`; {hardware()}")
    print(f"\n{len(shapes)} parameters, {sum(torch.Size(s).numel() for s in shapes) / 1e6:.2f}M "
          f"elements, blocks of {block}; medians of {args.rounds} rounds\n")
    base = None
    print(table_head("optimizer", "steady step ms", "steady step without a sample ms",
                     "refresh step ms", f"mean step ms (f = {frequency})",
                     "× Shampoo's mean step"))
    for runner in runners:
        mean = mean_step(runner)
        base = base or mean
        skipped = f"{median(runner.skipped) * 1e3:.1f}" if runner.skipped else "–"
        print(table_row(runner.name, f"{median(runner.steady) * 1e3:.1f}", skipped,
                        f"{median(runner.refresh) * 1e3:.1f}", f"{mean * 1e3:.1f}",
                        f"{mean / base:.2f}×"))
    print(load_average())


if __name__ == "__main__":
    main()
