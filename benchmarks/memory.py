"""Optimizer-state memory of AdamW, Shampoo and SOAP (32-bit and 4-bit; 32-bit Shampoo
with ``refresh_delay``), per rank under DDP and FSDP2, plus a bar chart.

Computed, not sampled: every state tensor each block would allocate, with its dtype,
placed on ranks by the optimizer's own assignment code (``common.owners``). AdamW keeps two
float32 moments per parameter, sharded under FSDP2 and replicated under DDP. Workspace and
communication buffers are not state (``sharded_scaling.py`` has them).

    python -m benchmarks.memory                         # tables
    python -m benchmarks.memory --plot benchmarks/figures/memory.png
"""

from __future__ import annotations

import os

import torch

from benchmarks.common import (
    MIB,
    arguments,
    block_shape,
    blocks_of,
    build_model,
    owners,
    state_bytes,
    table_head,
    table_row,
    trainable,
)
from hf_shampoo.config import DEFAULTS
from hf_shampoo.optional import require

BASE = {**DEFAULTS, "betas": (0.9, 0.999), "lr": 1e-3}
CONFIGS = {
    "Shampoo 32-bit (Adam grafting)": dict(grafting="adam"),
    "Shampoo 4-bit (Adam grafting)": dict(grafting="adam", quantization="4bit"),
    "SOAP 32-bit": dict(preconditioner="eigenvalue_corrected"),
    "SOAP 4-bit": dict(preconditioner="eigenvalue_corrected", quantization="4bit",
                       statistics_frequency=1),
    # refresh_delay >= 1 keeps, between steps, only the step each block's pending result
    # applies at (checkpoints hold the results themselves)
    "Shampoo 32-bit, refresh_delay=1": dict(grafting="adam", refresh_delay=1),
}
NOT_KRONECKER = ("grafting_state", "filtered_grad", "momentum", "corrected_eigenvalues")


def block_bytes(shape: tuple[int, ...], group: dict) -> tuple[int, int]:
    """(all state, the Kronecker part: everything but grafting state, M and D) of a block."""
    entries = state_bytes(shape, group)
    return (sum(entries.values()),
            sum(n for name, n in entries.items() if name not in NOT_KRONECKER))


def per_rank(params, group: dict, world: int, mode: str, max_dim: int) -> list[int]:
    """State bytes on each rank."""
    ranks = [0] * world
    for shape, owner in owners(params, world, mode, max_dim):
        ranks[owner] += block_bytes(shape, group)[0]
    return ranks


def tables(model_name: str, max_dim: int, worlds: list[int]) -> tuple[list[str], dict]:
    torch.manual_seed(0)
    params = trainable(build_model(model_name))
    n = sum(p.numel() for p in params)
    blocks = blocks_of(params, max_dim)
    rows = {"AdamW": (8 * n, 0)}
    for name, config in CONFIGS.items():
        group = {**BASE, **config}
        sums = [block_bytes(block_shape(b), group) for b in blocks]
        rows[name] = (sum(s for s, _ in sums), sum(k for _, k in sums))
    lines = [f"#### {model_name} ({n / 1e6:.1f}M parameters, max_preconditioner_dim {max_dim})",
             "", table_head("optimizer", "state MiB", "bytes / parameter",
                            "beyond AdamW's 8 B/param: Kronecker state MiB",
                            "Kronecker bytes / parameter")]
    for name, (total, kron) in rows.items():
        lines.append(table_row(name, f"{total / MIB:.0f}", f"{total / n:.2f}", f"{kron / MIB:.0f}",
                         f"{kron / n:.2f}"))
    for kind in ("Shampoo", "SOAP"):
        full = rows[f"{kind} 32-bit" + (" (Adam grafting)" if kind == "Shampoo" else "")][1]
        four = rows[f"{kind} 4-bit" + (" (Adam grafting)" if kind == "Shampoo" else "")][1]
        lines.append(f"\n- {kind}: 4-bit cuts the Kronecker state {full / four:.2f}× "
                     f"({full / MIB:.0f} → {four / MIB:.0f} MiB)")
    lines += ["", "Busiest rank's state, MiB (DDP keeps all of AdamW's state on every rank; "
              "FSDP2 shards it):", "",
              table_head("optimizer", *(f"DDP {w}" for w in worlds),
                         *(f"FSDP2 {w}" for w in worlds))]
    lines.append(table_row("AdamW", *(f"{8 * n / MIB:.0f}" for _ in worlds),
                     *(f"{8 * n / w / MIB:.0f}" for w in worlds)))
    for name, config in CONFIGS.items():
        group = {**BASE, **config}
        cells = [max(per_rank(params, group, w, mode, max_dim)) / MIB
                 for mode in ("ddp", "fsdp") for w in worlds]
        lines.append(table_row(name, *(f"{c:.0f}" for c in cells)))
    return lines, {name: total / n for name, (total, _) in rows.items()}


def plot(per_param: dict[str, dict[str, float]], path: str) -> None:
    matplotlib = require("matplotlib", "the plot of benchmarks.memory")
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
    parser = arguments(__doc__, models=["resnet50", "gpt2"], worlds=[1, 2, 4, 8])
    parser.add_argument("--max-dim", type=int, default=1024)
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
