"""Which learning rate do the defaults take? The best validation loss over a learning-rate
grid on scikit-learn's digits (bundled, no download): an MLP, 150 minibatch steps, for
AdamW, ``make_optimizer(model, lr=...)`` (AdamW's learning rate: Adam grafting, AdamW's
betas) and ``make_optimizer(model, lr=..., defaults="meta")`` (the class's defaults, which
are Meta's). About a minute of CPU.

    python -m benchmarks.digits_defaults
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn

from benchmarks.tasks import digits_split, make_digits_model
from hf_shampoo import make_optimizer

GRIDS = {
    "AdamW": [1e-3, 3e-3, 1e-2, 3e-2],
    "make_optimizer (defaults='adamw')": [1e-3, 3e-3, 1e-2, 3e-2],
    "make_optimizer (defaults='meta')": [1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1],
}


def build(name: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    if name == "AdamW":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    defaults = "meta" if "meta" in name else "adamw"
    return make_optimizer(model, lr=lr, defaults=defaults)


def run(name: str, lr: float, steps: int, batch: int, seed: int) -> float:
    """The best validation loss seen every 10 steps (inf once it is not finite)."""
    xtr, ytr, xva, yva = digits_split(seed)
    model = make_digits_model("mlp", seed)
    optimizer = build(name, model, lr)
    order = torch.Generator().manual_seed(seed + 1)
    best = math.inf
    for step in range(1, steps + 1):
        idx = torch.randint(len(ytr), (batch,), generator=order)
        loss = nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
        if not torch.isfinite(loss):
            return best
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 0:
            with torch.no_grad():
                val = nn.functional.cross_entropy(model(xva), yva).item()
            if not math.isfinite(val):
                return best
            best = min(best, val)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"digits MLP, {args.steps} steps of batch {args.batch}, seed {args.seed}: best "
          "validation loss per learning rate")
    widest = max(GRIDS.values(), key=len)
    print("| optimizer | " + " | ".join(f"lr {lr:g}" for lr in widest) + " |")
    for name, grid in GRIDS.items():
        cells = [f"{run(name, lr, args.steps, args.batch, args.seed):.3f}" for lr in grid]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
