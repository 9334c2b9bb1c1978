"""What the stacking rule costs a steady step: ``stacking="balanced"`` (each kind cut into
at least 8 stacks, ``hf_shampoo/stacking.py``) against ``stacking="fused"`` (one stack per
kind, what one process ran before the rule), in one process, step for step.

Both optimizers run the same model's parameter shapes on fixed random gradients past a
first refresh (the step counter is set as in ``step_time.py``), then alternate steady steps
A, B, A, B, ...; it prints the stacks each has, the non-view ATen operators a steady step
dispatches (a ``TorchDispatchMode`` count: on a GPU, kernel launches), the medians and
their ratio. ``--layers`` changes GPT-2's depth (the launch count against depth).

    python -m benchmarks.stacking_cost --model gpt2 --threads 2
    python -m benchmarks.stacking_cost --model gpt2 --layers 2 6 12 --steps 0
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import OperatorCount, build_model, hardware, load_average, median, timed_once
from hf_shampoo import DistributedShampoo, stacking

F = 100_000


def _model(name: str, layers: int | None) -> torch.nn.Module:
    """``build_model(name)``, with ``layers`` transformer layers where given (GPT-2s)."""
    model = build_model(name)
    if layers is None:
        return model
    from transformers import GPT2LMHeadModel

    model.config.n_layer = layers
    return GPT2LMHeadModel(model.config)


def _optimizer(model_name: str, seed: int, config: dict, whole: bool,
               layers: int | None = None):
    torch.manual_seed(seed)
    params = [p for p in _model(model_name, layers).parameters() if p.requires_grad]
    grads = [torch.randn_like(p) * 1e-2 for p in params]
    opt = DistributedShampoo(params, lr=1e-3, max_preconditioner_dim=1024,
                             precondition_frequency=F, start_preconditioning_step=F,
                             distributed="none", stacking="fused" if whole else "balanced",
                             **config)

    def step():
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()

    step()  # lays out (the rule is read here) and allocates the state
    for group in opt.param_groups:
        group["step"] = F - 1  # the next step refreshes, the later ones are steady
    step()
    return opt, step


CONFIGS = {
    "shampoo + adam grafting": dict(grafting="adam", epsilon=1e-12),
    "SOAP": dict(preconditioner="eigenvalue_corrected", epsilon=1e-8),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["resnet50", "gpt2", "gpt2-tiny"], default="gpt2")
    parser.add_argument("--layers", type=int, nargs="*", default=None,
                        help="GPT-2 depths to run (default: the model's own)")
    parser.add_argument("--steps", type=int, default=8,
                        help="steady steps per optimizer (0: count operators only)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--min-stacks", type=int, default=stacking.MIN_STACKS,
                        help="the balanced rule's MIN_STACKS (to try others)")
    parser.add_argument("--stack-elements", type=int, default=stacking.STACK_ELEMENTS,
                        help="the balanced rule's STACK_ELEMENTS (to try others)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    stacking.MIN_STACKS, stacking.STACK_ELEMENTS = args.min_stacks, args.stack_elements
    print(f"Hardware: {hardware()}. {args.model} shapes; medians of {args.steps} interleaved "
          f"steady steps per optimizer; balanced with MIN_STACKS={stacking.MIN_STACKS}, "
          f"STACK_ELEMENTS={stacking.STACK_ELEMENTS}.\n")
    print("| configuration | layers | stacks: balanced / fused | operators per step: "
          "balanced / fused | balanced s | fused s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for layers in args.layers or [None]:
        for name in args.configs:
            rule, rule_step = _optimizer(args.model, 0, CONFIGS[name], False, layers)
            whole, whole_step = _optimizer(args.model, 0, CONFIGS[name], True, layers)
            counts = []
            for step in (rule_step, whole_step):
                with OperatorCount() as count:
                    step()
                counts.append(count.operators)
            times: dict[str, list[float]] = {"rule": [], "whole": []}
            for _ in range(args.steps):
                times["rule"].append(timed_once(rule_step))
                times["whole"].append(timed_once(whole_step))
            stacks = (f"{len(rule._ensure_layout().stacks)} / "
                      f"{len(whole._ensure_layout().stacks)}")
            timing = "— | — | —"
            if args.steps:
                a, b = median(times["rule"]), median(times["whole"])
                timing = f"{a:.3f} | {b:.3f} | {a / b:.3f}"
            depth = layers if layers is not None else "model's"
            print(f"| {name} | {depth} | {stacks} | {counts[0]} / {counts[1]} | {timing} |",
                  flush=True)
            del rule, whole, rule_step, whole_step
    print(load_average())


if __name__ == "__main__":
    main()
