"""What ``optimizer.metrics()`` costs against a step, on the demo's model (docs/metrics.md).

ResNet-50 (timm, random weights) under ``make_optimizer`` with the demo's settings, fixed
random gradients; after a warm-up (the first refresh included), each round times one
steady ``step()`` and one ``metrics()`` call right after it, interleaved. The table gives
the medians and the ratio; the Trainer calls ``metrics()`` once per logging step, so the
cost per step is this ratio divided by ``logging_steps``.

    python -m benchmarks.metrics_cost --model resnet50 --rounds 10
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common import arguments, build_model, hardware, table_head, table_row
from hf_shampoo import make_optimizer


def main() -> None:
    parser = arguments(__doc__, model="resnet50", rounds=10, threads=1)
    parser.add_argument("--frequency", type=int, default=100,
                        help="precondition_frequency (the demo's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args.model)
    preset = "cnn" if args.model == "resnet50" else "transformer"
    opt = make_optimizer(model, preset, lr=1e-3, precondition_frequency=args.frequency)
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=g) * 1e-3 for p in params]
    for p, grad in zip(params, grads):
        p.grad = grad
    opt.step()  # warm-up, then the first refresh: steady preconditioned steps after
    for group in opt.param_groups:
        group["step"] = args.frequency - 1
    opt.step()
    opt.metrics()
    steps, metrics = [], []
    for _ in range(args.rounds):
        start = time.perf_counter()
        opt.step()
        steps.append(time.perf_counter() - start)
        start = time.perf_counter()
        values = opt.metrics()
        metrics.append(time.perf_counter() - start)
    step, cost = statistics.median(steps), statistics.median(metrics)
    print(f"# metrics() against a steady step, {args.model} ({hardware()}, "
          f"{args.threads} thread(s), {len(values)} metrics)\n")
    print(table_head("model", "step s (median)", "metrics() ms (median)",
                     "metrics() / step"))
    print(table_row(args.model, f"{step:.3f}", f"{cost * 1e3:.2f}", f"{cost / step:.2%}"))


if __name__ == "__main__":
    main()
