"""The slowest step of a training loop with and without ``refresh_delay``.

A one-thread training loop (forward, backward and the optimizer step of an MLP on a fixed
batch, ``torch.set_num_threads(1)``) with Shampoo's "all" schedule: every block refreshes
on the same steps, which today makes those steps the slowest by far. With
``refresh_delay = d`` the refresh runs in the optimizer's worker thread, on the machine's
other core, while the next ``d`` steps train. It prints, per setting, the median step, the
slowest step after the warm-up, their ratio and the refresh's own time (the worker's work,
measured as ``d = 0``'s refresh steps minus the median).

    python -m benchmarks.refresh_delay --steps 64

The model is sized so that a refresh fits in ``f/2`` steps on one core (the condition
under which a delay can hide it); a GPU run would time the side stream instead (not
measured here).
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import arguments, hardware, load_average, median, table_head, table_row
from hf_shampoo import DistributedShampoo


def model(width: int, depth: int) -> torch.nn.Module:
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def run(width: int, depth: int, batch: int, frequency: int, delay: int, schedule: str,
        steps: int, warmup: int) -> list[float]:
    torch.manual_seed(0)
    net = model(width, depth)
    x = torch.randn(batch, width)
    y = torch.randn(batch, width)
    opt = DistributedShampoo(net.parameters(), lr=1e-3, grafting="adam", epsilon=1e-8,
                             precondition_frequency=frequency, refresh_delay=delay,
                             refresh_schedule=schedule, max_preconditioner_dim=width,
                             distributed="none")
    times = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times[warmup:]


def main() -> None:
    parser = arguments(__doc__, steps=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--frequency", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    f = args.frequency
    settings = [("all", 0), ("staggered", 0), ("all", f // 2), ("all", f)]
    print(f"# refresh_delay: slowest step of a one-thread training loop\n\n{hardware()}; "
          f"MLP {args.depth} x Linear({args.width}, {args.width}), "
          f"batch {args.batch}, Shampoo with Adam grafting, precondition_frequency={f}, "
          f"{args.steps} steps after {2 * f} warm-up steps\n")
    print(table_head("schedule", "refresh_delay", "median step (ms)", "slowest step (ms)",
                     "slowest / median"))
    for schedule, delay in settings:
        times = run(args.width, args.depth, args.batch, f, delay, schedule, args.steps, 2 * f)
        mid, worst = median(times), max(times)
        print(table_row(schedule, delay, f"{1e3 * mid:.1f}", f"{1e3 * worst:.1f}",
                        f"{worst / mid:.2f}x"))
    print(load_average())


if __name__ == "__main__":
    main()
