"""Does the cheaper refresh train as well? Loss curves on scikit-learn's digits (bundled,
no download) for ``eigh`` against warm-started QR (``eigendecomposition="qr"``, with and
without the adaptive criterion) and the staggered schedule, Shampoo and SOAP, with AdamW
as the baseline.

Every configuration trains the same models (an MLP and a small CNN) from the same
initialisation on the same batches, for several seeds; the table shows the training loss
averaged over windows of steps and over seeds, the final test accuracy, and for QR runs
with a tolerance the share of factor matrices that the criterion sent to a QR step.

    python benchmarks/convergence.py --steps 400 --seeds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from sklearn.datasets import load_digits
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import StaleCounter, hardware  # noqa: E402

from hf_shampoo import DistributedShampoo  # noqa: E402

SHAMPOO = dict(betas=(0.9, 0.999), epsilon=1e-12, grafting="adam", grafting_beta2=0.999,
               grafting_epsilon=1e-8, weight_decay=1e-4, max_preconditioner_dim=128)
SOAP = dict(betas=(0.9, 0.999), epsilon=1e-8, preconditioner="eigenvalue_corrected",
            weight_decay=1e-4, max_preconditioner_dim=128)


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
    return out


def load_data(seed: int):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_train = int(0.8 * len(y))
    return x[perm[:n_train]], y[perm[:n_train]], x[perm[n_train:]], y[perm[n_train:]]


def make_model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                             nn.Linear(128, 10))
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(), nn.Linear(64, 10))


def train(kind: str, config: dict | None, seed: int, args) -> tuple[list[float], float, float]:
    x, y, xt, yt = load_data(seed)
    model = make_model(kind, seed)
    if config is None:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999),
                                weight_decay=1e-4)
    else:
        opt = DistributedShampoo(model.parameters(), lr=args.lr,
                                 precondition_frequency=args.frequency, **config)
    g = torch.Generator().manual_seed(seed + 1)
    losses = []
    with StaleCounter(count_tolerance_zero=False) as counter:
        for _ in range(args.steps):
            index = torch.randint(0, len(y), (args.batch_size,), generator=g)
            loss = nn.functional.cross_entropy(model(x[index]), y[index])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    with torch.no_grad():
        accuracy = (model(xt).argmax(1) == yt).float().mean().item()
    stale = counter.stale / counter.checked if counter.checked else float("nan")
    return losses, accuracy, stale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--frequency", type=int, default=10, help="precondition_frequency")
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tolerances", type=float, nargs="*", default=[0.05, 0.1, 0.2],
                        help="eigenbasis_tolerance values τ > 0 for the QR runs")
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=["mlp", "cnn"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    windows = list(range(0, args.steps, args.window))
    print(f"Digits (1437 train / 360 test), batch {args.batch_size}, lr {args.lr}, "
          f"precondition_frequency {args.frequency}, {args.steps} steps, mean of "
          f"{args.seeds} seeds; {hardware()}\n")
    for kind in args.models:
        head = "| optimizer | " + " | ".join(f"loss {w + 1}-{w + args.window}" for w in windows)
        print(f"#### {kind.upper()}\n\n{head} | test acc | stale share |")
        print("|---" * (len(windows) + 3) + "|")
        for name, config in configs(args.tolerances).items():
            runs = [train(kind, config, seed, args) for seed in range(args.seeds)]
            cells = []
            for w in windows:
                cells.append(statistics.mean(
                    statistics.mean(losses[w:w + args.window]) for losses, _, _ in runs))
            accuracy = statistics.mean(a for _, a, _ in runs)
            stale = statistics.mean(s for _, _, s in runs)
            stale_text = "–" if stale != stale else f"{stale:.0%}"
            print(f"| {name} | " + " | ".join(f"{c:.4f}" for c in cells)
                  + f" | {accuracy:.3f} | {stale_text} |", flush=True)
        print()


if __name__ == "__main__":
    main()
