"""Inverse-root refresh on a model's factor matrices: ``eigh`` against Meta's coupled
iterations (``root_inverse="coupled_newton"`` / ``"coupled_higher_order"``).

The factors are those of ``DistributedShampoo(model.parameters())`` with blocks of 1024,
filled with ``F = Σ_t G_t G_tᵀ / T`` of ``--samples`` random gradients (the same for every
solver), ε = 1e-12; each solver computes every root ``(F + εI)^(-1/(2k))`` batched as the
optimizer batches them, in interleaved rounds (medians). Accuracy: the median over factors
of ``‖X − X_64‖_F / ‖X_64‖_F`` against a float64 eigh root.

    python -m benchmarks.root_solvers --threads 2
    python -m benchmarks.root_solvers --device cuda --dtype float32
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import (
    arguments,
    build_model,
    hardware,
    median,
    synchronize,
    table_head,
    table_row,
)
from hf_shampoo import DistributedShampoo, linalg, root_solvers

EPSILON = 1e-12


def factor_stacks(model: torch.nn.Module, samples: int, device, dtype
                  ) -> list[tuple[torch.Tensor, int]]:
    """The model's factor matrices ``Σ G Gᵀ / T`` of random gradients, one stack per
    (size, root ``2k``)."""
    opt = DistributedShampoo(model.parameters(), max_preconditioner_dim=1024)
    g = torch.Generator().manual_seed(0)
    stacks: dict[tuple[int, int], list[torch.Tensor]] = {}
    for row in opt.describe_blocks():
        shape = tuple(row["shape"])
        if row["preconditioner"] != "shampoo":
            continue
        numel = int(torch.tensor(shape).prod().item())
        for d in shape:
            if d < 2:
                continue
            grads = torch.randn(samples, d, numel // d, generator=g, dtype=torch.float64,
                                device="cpu")
            factor = torch.einsum("tik,tjk->ij", grads, grads) / samples
            stacks.setdefault((d, 2 * len(shape)), []).append(factor)
    return [(torch.stack(fs).to(device, dtype), root)
            for (_, root), fs in sorted(stacks.items())]


def eigh_roots(stack: torch.Tensor, root: int) -> torch.Tensor:
    eig = linalg.batched_eigh(stack + EPSILON * torch.eye(stack.shape[-1], dtype=stack.dtype,
                                                          device=stack.device))
    values = linalg.regularized_eigenvalues(eig.eigenvalues, EPSILON)
    return linalg.inverse_root_from_eigen(values, eig.eigenvectors, 1.0 / root)


SOLVERS = {
    "eigh": eigh_roots,
    "coupled_newton": lambda s, p: root_solvers.coupled_newton(s, p, EPSILON)[0],
    "coupled_higher_order": lambda s, p: root_solvers.coupled_higher_order(
        s, p, 0.0, EPSILON)[0],
}


def main(argv=None) -> None:
    parser = arguments(__doc__, model="resnet50", rounds=3, threads=2)
    parser.add_argument("--samples", type=int, default=16, help="gradients per factor")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--solvers", nargs="*", default=list(SOLVERS), choices=list(SOLVERS))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    stacks = factor_stacks(build_model(args.model), args.samples, args.device, dtype)
    count = sum(len(s) for s, _ in stacks)
    exact = [eigh_roots(s.double(), p) for s, p in stacks]  # on the device, as the rest
    times: dict[str, list[float]] = {name: [] for name in args.solvers}
    errors: dict[str, float] = {}
    for _ in range(args.rounds):
        for name in args.solvers:
            synchronize(args.device)
            start = time.perf_counter()
            roots = [SOLVERS[name](s, p) for s, p in stacks]
            synchronize(args.device)
            times[name].append(time.perf_counter() - start)
            rel = torch.cat([((r.double() - x).norm(dim=(-2, -1)) / x.norm(dim=(-2, -1))).cpu()
                             for r, x in zip(roots, exact)])
            errors[name] = rel.nan_to_num(float("inf")).median().item()
    base = median(times["eigh"]) if "eigh" in times else None
    largest = max(s.shape[-1] for s, _ in stacks)
    print(f"{args.model}: {count} factor matrices in {len(stacks)} stacks "
          f"(largest {largest}), {args.dtype}, {hardware()}, {args.rounds} interleaved "
          f"rounds\n")
    print(table_head("root solver", "refresh (s, median)", "vs eigh",
                     "median relative error vs float64 eigh"))
    for name in args.solvers:
        t = median(times[name])
        ratio = f"{t / base:.2f}×" if base else "–"
        print(table_row(name, f"{t:.3f}", ratio, f"{errors[name]:.1e}"))


if __name__ == "__main__":
    main()
