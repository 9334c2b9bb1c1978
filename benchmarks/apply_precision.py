"""How accurate the products that apply Shampoo's roots are in lower precision: float32
(today's steady step), TF32 (emulated: every product's operands rounded to TF32's 10-bit
mantissa, accumulated in float32, as a GPU's tensor cores do) and bfloat16 roots
(``inv_factor_matrix_dtype=torch.bfloat16``: roots stored and ``P`` computed in bfloat16,
Meta's option), each against the same product in float64.

The blocks are GPT-2 small's (768 × 768, 768 × 1024, 1024 × 768 with
``max_preconditioner_dim=1024``); their factors are accumulated (β2 = 0.999, bias-corrected)
over ``--steps`` gradients with a power-law spectrum (singular values ``k^-α``, random
singular vectors each moving by ``--drift`` a step), and the roots are computed in float64
and stored in float32 (bfloat16 for that row). The table gives, per shape and precision,
the relative error ``‖P − P₆₄‖ / ‖P₆₄‖`` of the preconditioned gradient and the cosine between them
(median over ``--trials``), and, for scale, how far the direction moves when the roots are
one refresh stale (computed ``--stale`` steps earlier): the error Shampoo already accepts
with ``precondition_frequency``. No GPU is needed; a GPU's TF32 rounds its operands the same
way (round to nearest), so the emulation is a model of it, not a measurement on one.

    python -m benchmarks.apply_precision
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import command_line, hardware, median
from hf_shampoo.kronecker import multi_mode_product
from hf_shampoo.matmul_precision import to_tf32

SHAPES = [(768, 768), (768, 1024), (1024, 768)]


def tf32_product(g: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``L G Rᵀ`` with every product's operands in TF32, accumulated in float32."""
    inner = to_tf32(left) @ to_tf32(g)
    return to_tf32(inner) @ to_tf32(right).mT


def inverse_root(factor: torch.Tensor, exponent: float, epsilon: float) -> torch.Tensor:
    values, vectors = torch.linalg.eigh(factor)
    values = values.clamp_min(0) + epsilon
    return (vectors * values.pow(-exponent)) @ vectors.mT


def factors(shape, steps: int, alpha: float, generator: torch.Generator, drift: float):
    """Bias-corrected EMA factors of ``steps`` gradients, and the last gradient; float64."""
    m, n = shape
    rank = min(m, n)
    spectrum = torch.arange(1, rank + 1, dtype=torch.float64).pow(-alpha)
    u = torch.linalg.qr(torch.randn(m, rank, dtype=torch.float64, generator=generator))[0]
    v = torch.linalg.qr(torch.randn(n, rank, dtype=torch.float64, generator=generator))[0]
    left, right, beta2 = torch.zeros(m, m, dtype=torch.float64), \
        torch.zeros(n, n, dtype=torch.float64), 0.999
    history = []
    for t in range(1, steps + 1):
        # each singular vector moves by about ``drift`` per step
        drift_u = torch.randn(m, rank, dtype=torch.float64, generator=generator) * drift / m ** 0.5
        drift_v = torch.randn(n, rank, dtype=torch.float64, generator=generator) * drift / n ** 0.5
        u = torch.linalg.qr(u + drift_u)[0]
        v = torch.linalg.qr(v + drift_v)[0]
        g = (u * spectrum) @ v.mT + 1e-3 * torch.randn(m, n, dtype=torch.float64,
                                                        generator=generator)
        left = beta2 * left + (1 - beta2) * g @ g.mT
        right = beta2 * right + (1 - beta2) * g.mT @ g
        bc = 1 - beta2 ** t
        history.append((left / bc, right / bc))
    return history, g


def relative(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a, b = a.double(), b.double()
    error = float((a - b).norm() / b.norm())
    cosine = float((a * b).sum() / (a.norm() * b.norm()))
    return error, cosine


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="gradients per factor")
    parser.add_argument("--stale", type=int, default=10,
                        help="steps between the stale roots and the fresh ones")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--alpha", type=float, default=1.0, help="spectrum k^-alpha")
    parser.add_argument("--epsilon", type=float, default=1e-12)
    parser.add_argument("--drift", type=float, default=0.05,
                        help="how far each singular vector moves per step")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"`{command_line()}`; {hardware()}; Shampoo roots (exponent 1/4 per side), "
          f"{args.steps} gradients with spectrum k^-{args.alpha:g} and singular vectors moving "
          f"{args.drift:g} a step, epsilon {args.epsilon:g}; medians over {args.trials} "
          "trials.\n")
    print("| block | float32 error | TF32 (emulated) error | bfloat16 roots error | "
          f"roots {args.stale} steps stale | cosine TF32 / bf16 |")
    print("|---|---|---|---|---|---|")
    for shape in SHAPES:
        rows: dict[str, list[float]] = {k: [] for k in
                                        ("f32", "tf32", "bf16", "stale", "cos_tf32", "cos_bf16")}
        for trial in range(args.trials):
            generator = torch.Generator().manual_seed(1000 * trial + shape[0] + shape[1])
            history, g = factors(shape, args.steps, args.alpha, generator, args.drift)
            left64, right64 = (inverse_root(f, 0.25, args.epsilon) for f in history[-1])
            stale_left, stale_right = (inverse_root(f, 0.25, args.epsilon)
                                       for f in history[-1 - args.stale])
            left, right, g32 = left64.float(), right64.float(), g.float()
            exact = left.double() @ g32.double() @ right.double().mT  # the stored roots
            f32 = multi_mode_product(g32[None], [left[None], right[None]])[0]
            tf32 = tf32_product(g32, left, right)
            bf16 = multi_mode_product(g32.bfloat16()[None], [left.bfloat16()[None],
                                                             right.bfloat16()[None]])[0]
            stale = stale_left @ g @ stale_right.mT
            for key, value in (("f32", f32), ("tf32", tf32), ("bf16", bf16)):
                error, cosine = relative(value, exact)
                rows[key].append(error)
                if key != "f32":
                    rows[f"cos_{key}"].append(cosine)
            rows["stale"].append(relative(stale, left64 @ g @ right64.mT)[0])
        m = {k: median(v) for k, v in rows.items()}
        print(f"| {shape[0]} × {shape[1]} | {m['f32']:.1e} | {m['tf32']:.1e} | "
              f"{m['bf16']:.1e} | {m['stale']:.1e} | {m['cos_tf32']:.6f} / "
              f"{m['cos_bf16']:.6f} |", flush=True)


if __name__ == "__main__":
    main()
