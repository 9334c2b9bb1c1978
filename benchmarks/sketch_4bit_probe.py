"""Would 4-bit sketches pay? The ablation's GPT-2 trained with Sketchy whose sketch bases
are stored in 4 bits as 4-bit Shampoo stores eigenvectors (``quantization.py``: blocks of 64,
linear-square levels, one Björck step on loading), simulated by quantizing and
dequantizing each basis after every Frequent-Directions update (the refreshed root takes
its basis from the sketch, so it is quantized too). Nothing else changes: the numbers to
compare are the same run's loss with 32-bit bases (``python -m benchmarks.ablation --tasks
gpt2 --optimizers "Sketchy (rank 16)"``) and the bytes a 4-bit basis would save.

    python -m benchmarks.sketch_4bit_probe --out outputs/sketch-4bit
"""

from __future__ import annotations

import sys

from benchmarks import ablation
from hf_shampoo import quantization
from hf_shampoo.preconditioners import sketchy

_update = sketchy.frequent_directions


def quantized_frequent_directions(basis, values, mass, x, beta2):
    """``frequent_directions`` whose new basis goes through 4-bit storage (its columns, the
    sketch's directions, quantized as rows, as 4-bit Shampoo's eigenvectors)."""
    basis, values, mass, ok = _update(basis, values, mass, x, beta2)
    rows = quantization.dequantize(quantization.quantize(basis.mT))
    return quantization.bjorck(rows, 1).mT.to(basis.dtype), values, mass, ok


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    sketchy.frequent_directions = quantized_frequent_directions
    defaults = ["--tasks", "gpt2", "--lr", "0.003", "--optimizers", "Sketchy (rank 16)"]
    ablation.main(defaults + argv)


if __name__ == "__main__":
    main()
