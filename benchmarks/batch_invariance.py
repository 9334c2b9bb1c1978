"""Does a block's result depend on the other blocks of its stack? One table per device.

A report of what the library at hand does, not a promise the optimizer rests on: stacks
are cut by a rule of the blocks alone (``hf_shampoo/stacking.py``, docs/design.md §4), so
one process and every layout compute each block in the same call beside the same blocks,
whatever a library does with a batch. It prints, per operation, shape and dtype, whether
matrix ``i`` of a stack of 8 equals the same matrix computed alone, and the largest
difference. Libraries differ: on an Intel Xeon at one thread every row said yes; on an AMD
EPYC the row-form matvec at 130 did not; with two threads, and on GPUs (cuBLAS, cuSOLVER
pick kernels by batch size), many do not.

    python -m benchmarks.batch_invariance --device cuda
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import cpu_name
from hf_shampoo import eigenbasis, kronecker, linalg


def _spd(n: int, d: int, dtype, gen) -> torch.Tensor:
    x = torch.randn(n, d, 2 * d, generator=gen, dtype=torch.float64)
    return (x @ x.mT / (2 * d)).to(dtype)


def _eig(result) -> tuple[torch.Tensor, torch.Tensor]:
    return result.eigenvalues, result.eigenvectors


SIZES = (16, 40, 128, 512, 1024)


def cases(device: str, dtype: torch.dtype, gen, sizes=SIZES):
    """(name, shape, function of a stack → a tensor or a tuple, the stack's inputs)."""
    for d in sizes:
        g = torch.randn(8, d, max(d // 2, 8), generator=gen, dtype=torch.float64).to(dtype)
        f = _spd(8, d, dtype, gen)
        spd = f.to(device)
        yield "factor update (syrk)", (d, g.shape[-1]), \
            lambda g, f: kronecker.update_factor(f.clone(), g, 0, 0.9), (g.to(device), spd)
        yield "preconditioning (bmm)", (d, g.shape[-1]), \
            lambda g, f: kronecker.mode_product(g, f, 0), (g.to(device), spd)
        yield "matvec (row form)", (d,), \
            lambda v, f: kronecker.batched_matvec(f, v), (g[..., 0].contiguous().to(device), spd)
        yield "eigh", (d, d), lambda f: _eig(linalg.batched_eigh(f)), (spd,)
        yield "qr basis (householder)", (d, d), lambda f: eigenbasis.orthonormal_basis(f), (spd,)
        yield "cholesky", (d, d), lambda f: torch.linalg.cholesky(f), (spd,)


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def rows(device: str, dtypes, sizes=SIZES) -> list[tuple[str, tuple, str, bool, float]]:
    """``(operation, shape, dtype, equal, largest difference)`` for matrices 0, 3 and 7 of
    a stack of 8 against each computed alone (eigenvectors compared up to column signs)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for name, shape, fn, inputs in cases(device, dtype, gen, sizes):
            together = _as_tuple(fn(*inputs))
            equal, worst = True, 0.0
            for i in (0, 3, 7):
                alone = _as_tuple(fn(*(x[i:i + 1].clone() for x in inputs)))
                for a, b in zip(alone, together):
                    a, b = a[0], b[i]
                    if name.startswith(("eigh", "qr")) and a.dim() == 2:  # column signs
                        a = a * torch.sign((a * b).sum(0, keepdim=True))
                    equal &= torch.equal(a, b)
                    worst = max(worst, (a.double() - b.double()).abs().max().item())
            out.append((name, shape, dtype_name, equal, worst))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    parser.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    args = parser.parse_args(argv)
    where = torch.cuda.get_device_name() if args.device == "cuda" else \
        f"{cpu_name()}, {torch.get_num_threads()} thread(s)"
    print(f"### Batch invariance on {where}, torch {torch.__version__}\n")
    print("| operation | shape | dtype | equal alone and in a stack of 8 | max abs difference |")
    print("|---|---|---|---|---|")
    for name, shape, dtype_name, equal, worst in rows(args.device, args.dtypes, args.sizes):
        print(f"| {name} | {'×'.join(map(str, shape))} | {dtype_name} | "
              f"{'yes' if equal else '**no**'} | {worst:.1e} |", flush=True)

if __name__ == "__main__":
    main()
