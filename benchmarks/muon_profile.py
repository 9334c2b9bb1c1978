"""Where Muon's optimizer step goes in the Trainer, on the CPU: GPT-2 small's optimizer as
``TrainingArguments(optim="distributed_muon")`` builds it (``Trainer.create_optimizer``),
stepped on the gradients of one real backward.

On one H200 that step took 46.6 ms against 7.5 ms for Newton-Schulz on the hidden matrices
alone (BENCHMARKS.md, "On a GPU"). A GPU runs each operator as a kernel launch of its own,
and a step of many small operators is bound by the host's launch rate, not by the device.
So besides the step's time split into Newton-Schulz and the rest (both timed around
``orthogonalization.newton_schulz``), this prints the operators a step dispatches (non-view
ATen operators, a ``TorchDispatchMode`` count) inside and outside Newton-Schulz, under
``stacking="balanced"`` and ``"fused"``, and this host's cost of dispatching one small
operator (``torch.add_`` on one element), whose product with the count is the host time a
GPU would need at least to launch that step's kernels. These are CPU figures: the host
overhead is a CPU measurement, not a GPU one.

    python -m benchmarks.muon_profile --threads 2
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from benchmarks.common import OperatorCount, command_line, hardware, median
from hf_shampoo import orthogonalization
from hf_shampoo.preconditioners import spectral_descent


class _Timed:
    """``newton_schulz`` timed (and its operators told apart) wherever the step calls it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.count: OperatorCount | None = None
        self.original = spectral_descent.newton_schulz

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        if self.count is not None:
            self.count.where = "newton_schulz"
        try:
            return self.original(*args, **kwargs)
        finally:
            if self.count is not None:
                self.count.where = "rest"
            self.seconds += time.perf_counter() - start


def _trainer_optimizer(stacking: str):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    import hf_shampoo.integrations.transformers  # noqa: F401 - registers the names

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())
    args = TrainingArguments(output_dir="/tmp/hf_shampoo_muon_profile", optim="distributed_muon",
                             optim_args=f"stacking={stacking}", report_to=[], use_cpu=True,
                             learning_rate=1e-3)
    trainer = Trainer(model=model, args=args)
    optimizer = trainer.create_optimizer()
    tokens = torch.randint(0, model.config.vocab_size, (2, 64))
    model(tokens, labels=tokens).loss.backward()
    return model, optimizer


def _dispatch_cost(repeats: int = 20000) -> float:
    x = torch.zeros(1)
    start = time.perf_counter()
    for _ in range(repeats):
        x.add_(1.0)
    return (time.perf_counter() - start) / repeats


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    per_op = _dispatch_cost()
    print(f"`{command_line()}`; {hardware()}. GPT-2 small, the Trainer's `distributed_muon` "
          f"optimizer, gradients of one backward (2 × 64 tokens); medians of {args.steps} "
          f"steps. One small operator dispatched on this host: {per_op * 1e6:.1f} µs.\n")
    print("| stacking | stacks | step s | Newton-Schulz s | rest s | operators: "
          "Newton-Schulz / rest | operators × dispatch cost ms |")
    print("|---|---|---|---|---|---|---|")
    timed = _Timed()
    with contextlib.ExitStack() as stack:
        stack.callback(setattr, spectral_descent, "newton_schulz", timed.original)
        spectral_descent.newton_schulz = timed
        for stacking in ("balanced", "fused"):
            model, optimizer = _trainer_optimizer(stacking)
            optimizer.step()  # lays out and allocates
            count = OperatorCount()
            count.where = "rest"
            timed.count = count
            with count:
                optimizer.step()
            timed.count = None
            totals, inside = [], []
            for _ in range(args.steps):
                timed.seconds = 0.0
                start = time.perf_counter()
                optimizer.step()
                totals.append(time.perf_counter() - start)
                inside.append(timed.seconds)
            step, ns = median(totals), median(inside)
            ns_ops = count.by_part.get("newton_schulz", 0)
            rest_ops = count.by_part.get("rest", 0)
            stacks = len(optimizer._ensure_layout().stacks)
            print(f"| {stacking} | {stacks} | {step:.3f} | {ns:.3f} | {step - ns:.3f} | "
                  f"{ns_ops} / {rest_ops} | {count.operators * per_op * 1e3:.1f} |", flush=True)
            del model, optimizer
    assert orthogonalization.newton_schulz is timed.original


if __name__ == "__main__":
    main()
