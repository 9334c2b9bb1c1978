"""Set-up-free demo behind `make demo`: train a small MLP on scikit-learn's bundled digits.

It shows the `DistributedShampoo` constructor as a user types it (docs/design.md §7 keywords only),
prints test accuracy as training goes, and with `--compare-adamw` trains an identical
model with `torch.optim.AdamW` on the same batches for a side-by-side. The data ship with
scikit-learn (no download); the whole run takes well under a minute on two CPU cores.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from sklearn.datasets import load_digits
from torch import nn

from hf_shampoo import DistributedShampoo


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default: 300)")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (default: 3e-3)")
    p.add_argument("--batch-size", type=int, default=64, help="minibatch size (default: 64)")
    p.add_argument(
        "--preconditioner",
        choices=["shampoo", "eigenvalue_corrected"],
        default="shampoo",
        help="'shampoo' (Adam-grafted Shampoo) or 'eigenvalue_corrected' (SOAP)",
    )
    p.add_argument("--weight-decay", type=float, default=1e-4, help="decoupled weight decay")
    p.add_argument("--max-preconditioner-dim", type=int, default=64)
    p.add_argument("--precondition-frequency", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50, help="print a table row every N steps")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    p.add_argument(
        "--compare-adamw",
        action="store_true",
        help="also train with torch.optim.AdamW (same lr, betas, weight decay, batches)",
    )
    return p.parse_args()


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """8x8 digits as 64 features in [0, 1]; a seeded 80/20 train/test split."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_train = int(0.8 * len(y))
    train, test = perm[:n_train], perm[n_train:]
    return x[train], y[train], x[test], y[test]


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def make_shampoo(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    if args.preconditioner == "shampoo":
        # Adam grafting: Adam's step size per block, Shampoo's direction.
        return DistributedShampoo(
            model.parameters(),
            lr=args.lr,
            betas=(0.9, 0.999),
            epsilon=1e-12,
            grafting="adam",
            grafting_beta2=0.999,
            grafting_epsilon=1e-8,
            weight_decay=args.weight_decay,
            weight_decay_type="decoupled",
            precondition_frequency=args.precondition_frequency,
            max_preconditioner_dim=args.max_preconditioner_dim,
        )
    # Eigenvalue-corrected Shampoo (SOAP): Adam in the Kronecker eigenbasis, so Adam's
    # epsilon and betas and no grafting (docs/design.md §3).
    return DistributedShampoo(
        model.parameters(),
        lr=args.lr,
        betas=(0.9, 0.999),
        epsilon=1e-8,
        grafting=None,
        weight_decay=args.weight_decay,
        weight_decay_type="decoupled",
        precondition_frequency=args.precondition_frequency,
        max_preconditioner_dim=args.max_preconditioner_dim,
        preconditioner="eigenvalue_corrected",
    )


@torch.no_grad()
def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: nn.Module
) -> tuple[float, float]:
    logits = model(x)
    return loss_fn(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


class Run:
    """One model with its optimizer, step timer and start-of-training numbers."""

    def __init__(self, name: str, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.name, self.model, self.optimizer = name, model, optimizer
        self.step_seconds: list[float] = []
        self.start_loss = float("nan")
        self.width = len(name) + len(" loss")  # table column width

    def step(self, xb: torch.Tensor, yb: torch.Tensor, loss_fn: nn.Module) -> None:
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss_fn(self.model(xb), yb).backward()
        self.optimizer.step()
        self.step_seconds.append(time.perf_counter() - t0)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    x_train, y_train, x_test, y_test = load_data(args.seed)
    loss_fn = nn.CrossEntropyLoss()
    model = make_model()
    runs = [Run(args.preconditioner, model, make_shampoo(model, args))]
    if args.compare_adamw:
        twin = copy.deepcopy(model)  # same initial weights
        adamw = torch.optim.AdamW(
            twin.parameters(),
            lr=args.lr,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=args.weight_decay,
        )
        runs.append(Run("adamw", twin, adamw))

    print(
        f"digits: {len(y_train)} train / {len(y_test)} test, MLP 64-64-10, "
        f"{args.steps} steps, batch {args.batch_size}, lr {args.lr:g}, seed {args.seed}"
    )
    header = f"{'step':>6}" + "".join(
        f" | {r.name + ' loss':>{r.width}} {'test acc':>8}" for r in runs
    )
    print(header)
    print("-" * len(header))

    def log_row(step: int) -> None:
        row = f"{step:>6}"
        for r in runs:
            train_loss, _ = evaluate(r.model, x_train, y_train, loss_fn)
            _, test_acc = evaluate(r.model, x_test, y_test, loss_fn)
            if step == 0:
                r.start_loss = train_loss
            row += f" | {train_loss:>{r.width}.4f} {test_acc:>8.2%}"
        print(row, flush=True)

    log_row(0)
    # One seeded shuffle per epoch; every run sees the same batches.
    gen = torch.Generator().manual_seed(args.seed + 1)
    order, pos = torch.randperm(len(y_train), generator=gen), 0
    for step in range(1, args.steps + 1):
        if pos + args.batch_size > len(order):
            order, pos = torch.randperm(len(y_train), generator=gen), 0
        idx = order[pos : pos + args.batch_size]
        pos += args.batch_size
        for r in runs:
            r.step(x_train[idx], y_train[idx], loss_fn)
        if step % args.log_every == 0 or step == args.steps:
            log_row(step)

    print()
    for r in runs:
        end_loss, _ = evaluate(r.model, x_train, y_train, loss_fn)
        _, test_acc = evaluate(r.model, x_test, y_test, loss_fn)
        # The first step allocates optimizer state; report it apart from the mean.
        first_ms = 1e3 * r.step_seconds[0]
        rest = r.step_seconds[1:] or r.step_seconds
        mean_ms = 1e3 * sum(rest) / len(rest)
        print(
            f"summary {r.name}: train loss {r.start_loss:.4f} -> {end_loss:.4f}, "
            f"test accuracy {test_acc:.2%}, mean step time {mean_ms:.2f} ms "
            f"(forward+backward+step; first step {first_ms:.0f} ms)"
        )


if __name__ == "__main__":
    main()
