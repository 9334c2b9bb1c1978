"""A/B steady-step times: this checkout's hf_shampoo against another revision of it, in one
process, step for step, so that machine load hits both alike (for refactors that must not
slow the step down).

The other revision is imported from a checkout under another module name (the package
uses relative imports only), e.g. a git worktree of the commit before a change:

    git worktree add /tmp/before HEAD~1
    python -m benchmarks.ab_step_time --baseline-path /tmp/before --steps 20

Each configuration runs both optimizers on the same parameter shapes and fixed random
gradients, past a refresh (the step counter is set as in ``step_time.py``), then alternates
steady steps A, B, A, B, ...; medians and their ratio are printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import torch

import hf_shampoo
from benchmarks.common import build_model, hardware, median

F = 100_000

CONFIGS = {
    "shampoo + adam grafting": dict(grafting="adam", epsilon=1e-12),
    "SOAP (eigenvalue-corrected)": dict(preconditioner="eigenvalue_corrected", epsilon=1e-8),
    "KL-Shampoo + adam grafting": dict(preconditioner="kl_shampoo", grafting="adam",
                                      epsilon=1e-12),
    "shampoo, wd + nesterov momentum": dict(grafting="adam", epsilon=1e-12, weight_decay=1e-2,
                                            momentum=0.9, nesterov=True),
}


def load_baseline(path: str):
    """The hf_shampoo package of another checkout, as module ``hf_shampoo_baseline``."""
    init = os.path.join(os.path.abspath(path), "hf_shampoo", "__init__.py")
    spec = importlib.util.spec_from_file_location(
        "hf_shampoo_baseline", init, submodule_search_locations=[os.path.dirname(init)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["hf_shampoo_baseline"] = module
    spec.loader.exec_module(module)
    return module


def make(package, params, config, **extra):
    opt = package.DistributedShampoo(
        params, lr=1e-3, betas=(0.9, 0.999), max_preconditioner_dim=1024,
        precondition_frequency=F, start_preconditioning_step=F, distributed="none", **config,
        **extra)
    return opt


def step(opt, params, grads, t: int | None = None) -> float:
    for p, g in zip(params, grads):
        p.grad = g
    if t is not None:
        for group in opt.param_groups:
            group["step"] = t
    start = time.perf_counter()
    opt.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-path", required=True, help="checkout of the other revision")
    parser.add_argument("--model", choices=["resnet50", "gpt2"], default="resnet50")
    parser.add_argument("--steps", type=int, default=12, help="steady steps per optimizer")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--without-gradient-check", action="store_true",
                        help="this checkout with check_finite_gradients=False (to compare "
                             "the rest of the step with a revision that had no such check)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    baseline = load_baseline(args.baseline_path)
    torch.manual_seed(0)
    model = build_model(args.model)
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=g) * 1e-2 for p in params]

    print(f"Hardware: {hardware()}. {args.model} shapes; medians of {args.steps} interleaved "
          f"steady steps per optimizer.\n")
    print(f"| configuration | this checkout s | baseline ({args.baseline_path}) s | ratio |")
    print("|---|---|---|---|")
    for name in args.configs:
        runs = {}
        for label, package in (("new", hf_shampoo), ("old", baseline)):
            extra = ({"check_finite_gradients": False}
                     if label == "new" and args.without_gradient_check else {})
            opt = make(package, params, CONFIGS[name], **extra)
            step(opt, params, grads)  # state
            step(opt, params, grads, F - 1)  # the first refresh
            runs[label] = (opt, [])
        for _ in range(args.steps):
            for opt, times in runs.values():
                times.append(step(opt, params, grads))
        new, old = median(runs["new"][1]), median(runs["old"][1])
        print(f"| {name} | {new:.3f} | {old:.3f} | {new / old:.3f} |", flush=True)
        runs.clear()
    print(f"\nLoad average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}.")


if __name__ == "__main__":
    main()
