"""Does the cheaper refresh train as well? Loss curves on scikit-learn's digits (bundled,
no download) for ``eigh`` against warm-started QR (``eigendecomposition="qr"``, with and
without the adaptive criterion) and the staggered schedule, Shampoo and SOAP, with AdamW
as the baseline.

Every configuration trains the same models (an MLP and a small CNN) from the same
initialisation on the same batches, for several seeds; the table shows the training loss
averaged over windows of steps and over seeds, the final test accuracy, and for QR runs
with a tolerance the share of factor matrices that the criterion sent to a QR step.

    python -m benchmarks.convergence --steps 400 --seeds 3
"""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import torch
from torch import nn

from benchmarks.common import StaleCounter, arguments, hardware, table_row
from benchmarks.configs import ADAMW, SHAMPOO, SOAP
from benchmarks.harness import train_loop
from benchmarks.tasks import (
    classification_parts,
    digits_split,
    language_model_parts,
    make_digits_model,
    make_gpt2,
    text_tokens,
)
from hf_shampoo import DistributedShampoo


def configs(tolerances: list[float]) -> dict[str, dict | None]:
    """AdamW, then Shampoo and SOAP each with eigh, QR (τ = 0 and the given τ > 0),
    Shampoo with the staggered schedule, SOAP with ``eigenbasis_variant="descending"``, and
    KL-Shampoo (Adam grafting)."""
    out: dict[str, dict | None] = {"AdamW": None}
    for name, base in (("Shampoo", SHAMPOO), ("SOAP", SOAP)):
        out[f"{name} eigh"] = dict(base)
        for tolerance in [0.0, *tolerances]:
            out[f"{name} qr τ={tolerance:g}"] = dict(base, eigendecomposition="qr",
                                                     eigenbasis_tolerance=tolerance)
        if name == "Shampoo":
            out[f"{name} eigh staggered"] = dict(base, refresh_schedule="staggered")
    # SOAP with our former refresh (descending bases, D permuted; eigenbasis_variant)
    descending = dict(SOAP, eigenbasis_variant="descending")
    out["SOAP-desc eigh"] = dict(descending)
    for tolerance in [0.0, *tolerances]:
        out[f"SOAP-desc qr τ={tolerance:g}"] = dict(descending, eigendecomposition="qr",
                                                   eigenbasis_tolerance=tolerance)
    out["KL-Shampoo eigh"] = dict(SHAMPOO, preconditioner="kl_shampoo")
    # 4-bit state (docs/design.md §5): factors sampled at refresh steps, after a warm-up
    # that takes every gradient up to the first refresh
    # (preconditioners/quantized.py)
    out["Shampoo 4-bit eigh"] = dict(SHAMPOO, quantization="4bit")
    for every in (1, 2, 5):
        out[f"Shampoo 4-bit eigh, statistics every {every}"] = dict(
            SHAMPOO, quantization="4bit", statistics_frequency=every)
    out["Shampoo 4-bit qr, statistics every 2"] = dict(
        SHAMPOO, quantization="4bit", statistics_frequency=2, eigendecomposition="qr")
    out["SOAP 4-bit eigh"] = dict(SOAP, quantization="4bit")
    out["SOAP 4-bit eigh, statistics every 1"] = dict(SOAP, quantization="4bit",
                                                      statistics_frequency=1)
    return out


def make_optimizer(model: nn.Module, config: dict | None, args):
    """AdamW (``config`` None) or DistributedShampoo with ``config`` and ``--frequency``,
    same lr for both."""
    if config is None:
        return torch.optim.AdamW(model.parameters(), lr=args.lr, **ADAMW)
    return DistributedShampoo(model.parameters(), lr=args.lr,
                              **dict(config, precondition_frequency=args.frequency))


def train(kind: str, config: dict | None, seed: int, args) -> tuple[list[float], float, float]:
    """One run (``harness.train_loop``): training losses (``nan`` after a non-finite one,
    which ends the run), the final test accuracy on digits or, for ``gpt2``, the validation
    loss on 64 fixed windows (``nan`` for a diverged run), the stale share of QR refreshes."""
    if kind == "gpt2":
        model, metric = make_gpt2(seed), "val loss"
        sizes = SimpleNamespace(val_windows=64, text_batch_size=args.batch_size)
        batches, loss, evaluate = language_model_parts(sizes, *text_tokens())
    else:
        x, y, xt, yt = digits_split(seed)
        model, metric = make_digits_model(kind, seed), "test acc"
        batches, loss, evaluate = classification_parts(x, y, xt, yt, args.batch_size)
    opt = make_optimizer(model, config, args)
    with StaleCounter(count_tolerance_zero=False) as counter:
        run = train_loop(model, opt, batches(seed, args.steps), loss)
    metric = math.nan if run.diverged else evaluate(model)[metric]
    stale = counter.stale / counter.checked if counter.checked and kind != "gpt2" else math.nan
    return run.padded(args.steps), metric, stale


def main() -> None:
    parser = arguments(__doc__, steps=400, seeds=3, threads=1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--frequency", type=int, default=10, help="precondition_frequency")
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--tolerances", type=float, nargs="*", default=[0.05, 0.1, 0.2],
                        help="eigenbasis_tolerance values τ > 0 for the QR runs")
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"],
                        choices=["mlp", "cnn", "gpt2"],
                        help="gpt2: a 2-layer byte-level GPT-2 on Python's standard-library "
                             "sources (validation loss instead of test accuracy)")
    parser.add_argument("--configs", nargs="*", default=None,
                        help="only these optimizers (names as in the table)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    windows = list(range(0, args.steps, args.window))
    data = ("GPT-2 (2 layers, 128 wide, bytes, context 128) on Python's standard library"
            if args.models == ["gpt2"] else "Digits (1437 train / 360 test)")
    print(f"{data}, batch {args.batch_size}, lr {args.lr}, "
          f"precondition_frequency {args.frequency}, {args.steps} steps, mean of "
          f"{args.seeds} seeds; {hardware()}\n")
    for kind in args.models:
        head = "| optimizer | " + " | ".join(f"loss {w + 1}-{w + args.window}" for w in windows)
        metric = "val loss" if kind == "gpt2" else "test acc"
        print(f"#### {kind.upper()}\n\n{head} | {metric} | stale share |")
        print("|---" * (len(windows) + 3) + "|")
        for name, config in configs(args.tolerances).items():
            if args.configs is not None and name not in args.configs:
                continue
            runs = [train(kind, config, seed, args) for seed in range(args.seeds)]
            cells = []
            for w in windows:
                cells.append(statistics.mean(
                    statistics.mean(losses[w:w + args.window]) for losses, _, _ in runs))
            accuracy = statistics.mean(a for _, a, _ in runs)
            stale = statistics.mean(s for _, _, s in runs)
            stale_text = "–" if stale != stale else f"{stale:.0%}"
            spread = (max(a for _, a, _ in runs) - min(a for _, a, _ in runs)) / 2
            print(table_row(name, *(f"{c:.4f}" for c in cells), f"{accuracy:.3f} ± {spread:.3f}",
                            stale_text), flush=True)
        print()


if __name__ == "__main__":
    main()
