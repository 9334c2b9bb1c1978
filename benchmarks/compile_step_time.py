"""Steady optimizer step, eager against ``compile=True``, on a model's parameter shapes.

Two optimizers of the same configuration, one eager and one compiled, run on their own
copies of the parameters with the same fixed random gradients, the step counter past
``start_preconditioning_step`` between refreshes (every timed step is steady, no
eigendecomposition), timed in interleaved steps; medians. The ``--warmup`` steps, where
the compiled optimizer compiles its kernels, are not timed as steady: ``compile s`` is the
compiled warm-up's time minus the eager one's. The learning rate changes every step, as
under a scheduler: the graphs added in the timed steps should be none.

    python -m benchmarks.compile_step_time --models resnet50 gpt2 --threads 2
    python -m benchmarks.compile_step_time --models gpt2-tiny --steps 3   # a smoke run
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import (
    arguments,
    build_model,
    hardware,
    load_average,
    median,
    table_head,
    table_row,
    trainable,
)
from hf_shampoo import DistributedShampoo, compiled

F = 100_000  # precondition_frequency = start_preconditioning_step; steps F+1.. are steady

CONFIGS = {
    "adam grafting": dict(grafting="adam"),
    "adam grafting, wd + nesterov momentum": dict(grafting="adam", weight_decay=1e-2,
                                                  momentum=0.9, nesterov=True),
}


def make(params, compile_option, config: dict) -> DistributedShampoo:
    opt = DistributedShampoo(params, lr=1e-3, betas=(0.9, 0.999), epsilon=1e-12,
                             grafting_beta2=0.999, grafting_epsilon=1e-8,
                             max_preconditioner_dim=1024, precondition_frequency=F,
                             start_preconditioning_step=F, distributed="none",
                             compile=compile_option, **config)
    for group in opt.param_groups:
        group["step"] = F  # the next steps precondition and refresh nothing
    return opt


def step_seconds(opt: DistributedShampoo, params, grads, lr: float) -> float:
    for p, g in zip(params, grads):
        p.grad = g
    for group in opt.param_groups:
        group["lr"] = lr
    start = time.perf_counter()
    opt.step()
    return time.perf_counter() - start


def graph_counts() -> tuple[int, int]:
    """The compiled kernels' graphs so far in this process: in all, and the most of one
    kernel (torch recompiles a kernel at most ``recompile_limit`` times, 8 by default)."""
    counts = compiled.graph_counts()
    return sum(counts.values()), max(counts.values())


def measure(model_name: str, config_name: str, compile_option, warmup: int, steps: int
            ) -> dict:
    torch._dynamo.reset()
    shapes = [p.shape for p in trainable(build_model(model_name))]
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=g) * 1e-2 for s in shapes]
    runs = {}
    for name, option in (("eager", False), ("compiled", compile_option)):
        params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(1)))
                  for s in shapes]
        runs[name] = (params, make(params, option, CONFIGS[config_name]), [], [])
    lrs = [1e-3 / (1 + 0.01 * t) for t in range(warmup + steps)]  # changes every step
    for t in range(warmup + steps):
        for name in (("eager", "compiled") if t % 2 == 0 else ("compiled", "eager")):
            params, opt, first, steady = runs[name]
            (first if t < warmup else steady).append(step_seconds(opt, params, grads, lrs[t]))
        if t == warmup - 1:
            after_warmup = graph_counts()
    final = graph_counts()
    a = torch.cat([p.detach().flatten() for p in runs["eager"][0]])
    b = torch.cat([p.detach().flatten() for p in runs["compiled"][0]])
    return {
        "eager": median(runs["eager"][3]), "compiled": median(runs["compiled"][3]),
        "compile": sum(runs["compiled"][2]) - sum(runs["eager"][2]),
        "graphs": after_warmup[0], "most": after_warmup[1],
        "later graphs": final[0] - after_warmup[0], "params": sum(s.numel() for s in shapes),
        "stacks": len({r["stack"] for r in runs["eager"][1].describe_blocks() if r["owned"]}),
        "difference": float((a - b).abs().max() / a.abs().max()),
    }


def main() -> None:
    parser = arguments(__doc__, models=["resnet50", "gpt2"], threads=2, steps=10)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--backend", default=None,
                        help="torch.compile backend (default: torch's, inductor)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    option = True if args.backend is None else {"backend": args.backend}
    lines = [f"Hardware: {hardware()}.", f"compile={option!r}; steady steps, medians of "
             f"{args.steps} interleaved steps each after {args.warmup} warm-up steps.", "",
             table_head("model", "configuration", "stacks", "eager ms", "compiled ms",
                        "compiled / eager", "compile s", "graphs (most of one kernel)",
                        "graphs after warm-up", "max rel. difference")]
    for model in args.models:
        for config in args.configs:
            r = measure(model, config, option, args.warmup, args.steps)
            lines.append(table_row(
                f"{model} ({r['params'] / 1e6:.1f}M)", config, r["stacks"],
                f"{r['eager'] * 1e3:.1f}", f"{r['compiled'] * 1e3:.1f}",
                f"{r['compiled'] / r['eager']:.3f}", f"{r['compile']:.1f}",
                f"{r['graphs']} ({r['most']})", r["later graphs"], f"{r['difference']:.1e}"))
            print(lines[-1], flush=True)
    lines.append(load_average())
    print("\n".join(lines))


if __name__ == "__main__":
    main()
