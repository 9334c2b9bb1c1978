"""Optimizer-state memory: AdamW, 32-bit and 4-bit Shampoo, eigenvalue-corrected Shampoo
with and without 4-bit state, on ResNet-50 and GPT-2-small shapes, per rank at world
1/2/4/8 under DDP and FSDP2 (lossless), plus a bar chart.

Computed, not sampled: every state tensor the optimizer would allocate (``expected_state``
of each block, with its dtype), placed on ranks by the same assignment code the optimizer
runs (``distributed.greedy_assignment`` for DDP, the lossless FSDP2 planner of
``distributors/fsdp.py`` through ``sharded_scaling.simulated_sharded``). AdamW keeps two float32
moments per parameter, sharded evenly under FSDP2 and replicated under DDP. Workspace and
communication buffers are not state and are not counted (``sharded_scaling.py`` has them).

    python -m benchmarks.memory                         # tables
    python -m benchmarks.memory --plot benchmarks/figures/memory.png
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.common import block_shape, blocks_of, build_model, simulated_sharded
from hf_shampoo.config import DEFAULTS
from hf_shampoo.distributors import block_cost, greedy_assignment
from hf_shampoo.stack import BlockStack

MIB = 2.0**20
BASE = {**DEFAULTS, "betas": (0.9, 0.999), "lr": 1e-3}
CONFIGS = {
    "Shampoo 32-bit (Adam grafting)": dict(grafting="adam"),
    "Shampoo 4-bit (Adam grafting)": dict(grafting="adam", quantization="4bit"),
    "SOAP 32-bit": dict(preconditioner="eigenvalue_corrected"),
    "SOAP 4-bit": dict(preconditioner="eigenvalue_corrected", quantization="4bit",
                       statistics_frequency=1),
}


def state_bytes(shape: tuple[int, ...], group: dict) -> tuple[int, int]:
    """(all state, the Kronecker part: everything but grafting state, M and D) of a block."""
    stack = BlockStack(0, shape, [], torch.float32)
    total = kronecker = 0
    for name, nbytes in stack.state_bytes(group).items():
        total += nbytes
        if name not in ("grafting_state", "filtered_grad", "momentum", "corrected_eigenvalues"):
            kronecker += nbytes
    return total, kronecker


def per_rank(params, group: dict, world: int, mode: str, max_dim: int) -> list[int]:
    """State bytes on each rank."""
    blocks = blocks_of(params, max_dim)
    shapes = [block_shape(b) for b in blocks]
    if mode == "ddp":
        owners = greedy_assignment([block_cost(s) for s in shapes], world)
    else:
        owners = simulated_sharded(world).assign(blocks, shapes)
    ranks = [0] * world
    for shape, owner in zip(shapes, owners):
        ranks[owner] += state_bytes(shape, group)[0]
    return ranks


def tables(model_name: str, max_dim: int, worlds: list[int]) -> tuple[list[str], dict]:
    torch.manual_seed(0)
    params = [p for p in build_model(model_name).parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    blocks = blocks_of(params, max_dim)
    rows = {"AdamW": (8 * n, 0)}
    for name, config in CONFIGS.items():
        group = {**BASE, **config}
        sums = [state_bytes(block_shape(b), group) for b in blocks]
        rows[name] = (sum(s for s, _ in sums), sum(k for _, k in sums))
    lines = [f"#### {model_name} ({n / 1e6:.1f}M parameters, max_preconditioner_dim {max_dim})",
             "", "| optimizer | state MiB | bytes / parameter | beyond AdamW's 8 B/param: "
             "Kronecker state MiB | Kronecker bytes / parameter |", "|---|---|---|---|---|"]
    for name, (total, kron) in rows.items():
        lines.append(f"| {name} | {total / MIB:.0f} | {total / n:.2f} | {kron / MIB:.0f} | "
                     f"{kron / n:.2f} |")
    for kind in ("Shampoo", "SOAP"):
        full = rows[f"{kind} 32-bit" + (" (Adam grafting)" if kind == "Shampoo" else "")][1]
        four = rows[f"{kind} 4-bit" + (" (Adam grafting)" if kind == "Shampoo" else "")][1]
        lines.append(f"\n- {kind}: 4-bit cuts the Kronecker state {full / four:.2f}× "
                     f"({full / MIB:.0f} → {four / MIB:.0f} MiB)")
    lines += ["", "Busiest rank's state, MiB (DDP keeps all of AdamW's state on every rank; "
              "FSDP2 shards it):", "",
              "| optimizer | " + " | ".join(f"DDP {w}" for w in worlds) + " | "
              + " | ".join(f"FSDP2 {w}" for w in worlds) + " |",
              "|---|" + "---|" * (2 * len(worlds))]
    adamw = ["%.0f" % (8 * n / MIB) for _ in worlds] + \
        ["%.0f" % (8 * n / w / MIB) for w in worlds]
    lines.append("| AdamW | " + " | ".join(adamw) + " |")
    for name, config in CONFIGS.items():
        group = {**BASE, **config}
        cells = [max(per_rank(params, group, w, mode, max_dim)) / MIB
                 for mode in ("ddp", "fsdp") for w in worlds]
        lines.append(f"| {name} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    return lines, {name: total / n for name, (total, _) in rows.items()}


def plot(per_param: dict[str, dict[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(per_param)
    names = list(next(iter(per_param.values())))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [m + (i - (len(names) - 1) / 2) * width for m in range(len(models))]
        values = [per_param[model][name] for model in models]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("optimizer state, bytes per parameter (one rank)")
    ax.set_title("Optimizer state: AdamW, Shampoo and SOAP, 32-bit and 4-bit")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["resnet50", "gpt2"])
    parser.add_argument("--max-dim", type=int, default=1024)
    parser.add_argument("--worlds", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--plot", default=None, help="write the bar chart (PNG) here")
    args = parser.parse_args()
    per_param = {}
    for model in args.models:
        lines, per_param[model] = tables(model, args.max_dim, args.worlds)
        print("\n".join(lines) + "\n")
    if args.plot:
        plot(per_param, args.plot)
        print(f"bar chart: {args.plot}")


if __name__ == "__main__":
    main()
