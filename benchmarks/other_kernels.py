"""Does a parameter move when another joins its stack, on other kernels of the same libraries?

The user's case of issue 53: plain ``DistributedShampoo([a, b], ...)`` on two vectors of
``n`` elements with fixed gradients, 5 steps (``epsilon=1e-10``, Adam grafting, refreshes
every 2 steps from step 2), against the same run of ``b`` alone. With stacks cut by a rule
of the blocks alone (``hf_shampoo/stacking.py``) the two compute ``b``'s block in the same
call and ``b`` ends bit for bit the same, whatever the library; before the rule ``b``'s
block was computed in a stack of two instead of one, and a library that rounds a batch by
its size moved it (a rank-deficient root amplifies one ulp).

Each row runs the case in a fresh process on one set of kernels: the default ones, MKL's
AVX2 and SSE4.2 code paths (``MKL_ENABLE_INSTRUCTIONS``; the SSE4.2 one is what ``make
test-other-blas`` uses), which may batch differently from the default ones as another CPU's
library does, and, where Debian's ``qemu-user`` is installed, an AMD EPYC's own: the same
Python under ``qemu-x86_64 -cpu EPYC-Milan`` (``benchmarks/emulated_cpu.py``), on which MKL
and ATen choose the kernels they choose on that CPU. ``--tree`` runs another checkout (an
older commit, to see the proxies find what an AMD EPYC found):

    python -m benchmarks.other_kernels
    git worktree add /tmp/before c43882a^ && python -m benchmarks.other_kernels --tree /tmp/before
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import emulated_cpu
from benchmarks.common import cpu_name

ROOT = Path(__file__).resolve().parents[1]

KERNELS = {
    "default": {},
    "MKL AVX2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "MKL SSE4.2": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}

#: the row run as on an AMD EPYC (``emulated_cpu``), where qemu-x86_64 is installed
EMULATED = f"AMD {emulated_cpu.MODEL} (qemu)"

SIZES = (5, 16, 17, 31, 130)

CASE = """
import sys, torch
from hf_shampoo import DistributedShampoo
torch.set_num_threads(1)
for n in map(int, sys.argv[1:]):
    gen = torch.Generator().manual_seed(0)
    grads = [[torch.randn(n, generator=gen) for _ in range(5)] for _ in range(2)]
    def run(with_a):
        gen = torch.Generator().manual_seed(1)
        a, b = (torch.nn.Parameter(torch.randn(n, generator=gen)) for _ in range(2))
        opt = DistributedShampoo([a, b] if with_a else [b], lr=0.01, epsilon=1e-10,
                                 grafting="adam", max_preconditioner_dim=32,
                                 precondition_frequency=2, start_preconditioning_step=2,
                                 distributed="none")
        for t in range(5):
            a.grad, b.grad = grads[0][t].clone(), grads[1][t].clone()
            opt.step()
        return b.detach()
    print((run(True) - run(False)).abs().max().item())
"""


def run_case(tree: Path, env: dict[str, str], sizes, python=None) -> tuple[list[float], str]:
    """``max |b with a - b alone|`` for each size, in a fresh process on ``env``'s kernels
    (``python``: the command that runs Python, ``emulated_cpu.python_command()`` for an AMD
    EPYC's; this interpreter by default), and the code path MKL chose (where ``env`` sets
    ``MKL_VERBOSE=1``; else "")."""
    full = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", **env}
    out = subprocess.run([*(python or [sys.executable]), "-c", CASE, *map(str, sizes)],
                         env=full, cwd=tree, capture_output=True, text=True,
                         check=True).stdout
    values = [float(line) for line in out.splitlines() if not line.startswith("MKL_VERBOSE")]
    return values, emulated_cpu.mkl_path(out)


def moved(tree: Path, env: dict[str, str], sizes, python=None) -> list[float]:
    """``run_case``'s values."""
    return run_case(tree, env, sizes, python)[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=ROOT,
                        help="the checkout whose hf_shampoo runs (default: this one)")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    args = parser.parse_args(argv)
    print(f"{cpu_name()}; hf_shampoo from {args.tree}; one thread")
    print("max |b beside a - b alone| after 5 steps, by vector size")
    print("| kernels | " + " | ".join(f"n = {n}" for n in args.sizes) + " |")
    print("|---|" + "---|" * len(args.sizes))
    rows = [(name, env, None) for name, env in KERNELS.items()]
    if emulated_cpu.qemu():
        rows.append((EMULATED, {}, emulated_cpu.python_command()))
    else:
        print(f"(no {EMULATED} row: qemu-x86_64 is not installed: {emulated_cpu.INSTALL})")
    for name, env, python in rows:
        values = moved(args.tree.resolve(), env, args.sizes, python)
        print(f"| {name} | " + " | ".join(f"{v:.1e}" if v else "0" for v in values) + " |")


if __name__ == "__main__":
    main()
