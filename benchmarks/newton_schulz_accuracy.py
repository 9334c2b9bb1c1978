"""How close Muon's orthogonalization comes to the polar factor ``U Vᵀ``: torch.optim.Muon's
own Newton–Schulz, ours with Muon's coefficients and ours with Polar Express's
(``newton_schulz_coefficients="polar_express"``, arXiv 2505.16932), 5 iterations each.

Matrices of GPT-2 small's hidden shapes, two kinds of spectrum: Gaussian (singular values
spread over about [0.1, 1] of the largest) and a gradient-like decaying one (singular values
log-spaced from 1 down to 1e-4). Per method and dtype it prints the relative Frobenius
distance to ``U Vᵀ`` (float64 SVD), the smallest and largest singular value of the result
(ignoring the 10 % smallest input directions, which no 5-step polynomial lifts), and the
distance of ours with Muon's coefficients to torch.optim.Muon's (the same iteration: the
rounding of its bfloat16 steps).

    python -m benchmarks.newton_schulz_accuracy
"""

from __future__ import annotations

import torch

from benchmarks.common import arguments, hardware, table_head, table_row
from hf_shampoo.orthogonalization import MUON, newton_schulz


def matrix(rows: int, cols: int, spectrum: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    if spectrum == "gaussian":
        return x
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    values = torch.logspace(0, -4, min(rows, cols), dtype=torch.float64)
    return (u * values) @ vh


def polar(x: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    return u @ vh


def torch_muon(x: torch.Tensor) -> torch.Tensor:
    from torch.optim._muon import _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz(x.float(), MUON, 5, 1e-7)


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--shapes", nargs="+", default=["768x768", "768x3072", "3072x768"])
    args = parser.parse_args()
    print(f"# Newton–Schulz against the polar factor, 5 iterations\n\n{hardware()}\n")
    print(table_head("shape", "spectrum", "method", "dtype", "‖Y − UVᵀ‖ / ‖UVᵀ‖",
                     "singular values of Y (top 90 %)", "vs torch.optim.Muon"))
    for text in args.shapes:
        rows, cols = (int(v) for v in text.split("x"))
        for spectrum in ("gaussian", "decaying"):
            x = matrix(rows, cols, spectrum, seed=rows + cols)
            exact = polar(x)
            keep = int(0.9 * min(rows, cols))
            reference = torch_muon(x).double()
            results = [("torch.optim.Muon", "bfloat16", reference)]
            for name in ("muon", "polar_express"):
                for dtype in (torch.float32, torch.bfloat16):
                    y = newton_schulz(x.float()[None], 5, name, dtype)[0].double()
                    results.append((f"ours, {name}", str(dtype).removeprefix("torch."), y))
            for method, dtype, y in results:
                values = torch.linalg.svdvals(y)[:keep]
                error = float((y - exact).norm() / exact.norm())
                versus = float((y - reference).norm() / reference.norm())
                print(table_row(text, spectrum, method, dtype, f"{error:.3f}",
                                f"{float(values.min()):.3f}–{float(values.max()):.3f}",
                                "–" if method.startswith("torch") else f"{versus:.3f}"))


if __name__ == "__main__":
    main()
