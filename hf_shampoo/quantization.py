"""4-bit storage of stacks of matrices (docs/design.md §5; arXiv 2405.18144).

Block-wise absmax scaling over 64 consecutive elements of a row, and the "linear-square"
code: 16 levels ``sign(x)·x²`` over ``linspace(-1, 1, 16)`` (``-1/225`` replaced by an
exact 0), each element rounded to the nearest level. Two codes share a byte (even column
in the low nibble). A row whose length is not a multiple of 64 is padded with zeros to
one, so that a block never spans two rows
(for an eigenvector matrix stored with eigenvectors as rows, a block lies within one
eigenvector, as the paper requires). Storage: 4 bits per element plus one float32 scale
per 64 elements (4.5 bits per element).

``bjorck`` restores orthogonality of a dequantised eigenvector matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .linalg import syrk

BLOCK = 64
# matrices with fewer elements stay in float32 (docs/design.md §5)
MIN_QUANTIZED_ELEMENTS = 4096


def linear_square_levels(dtype: torch.dtype = torch.float32,
                         device: torch.device | str = "cpu") -> Tensor:
    """The 16 levels ``sign(x)·x²``, ``x`` in ``linspace(-1, 1, 16)``, ascending, with the
    level ``-1/225`` replaced by 0 (as the paper's code does), so that zeros stay exact:
    the identity a factor starts from, the padding of short rows, empty blocks."""
    x = torch.linspace(-1, 1, 16, dtype=torch.float64, device="cpu")
    levels = x.sign() * x.square()
    levels[7] = 0.0
    return levels.to(dtype=dtype, device=device)


def max_rounding_error() -> float:
    """Largest ``|x - dequantize(quantize(x))|`` for ``|x| <= 1`` (half the widest gap)."""
    levels = linear_square_levels(torch.float64)
    return float((levels[1:] - levels[:-1]).max()) / 2


@dataclass
class Quantized:
    """A stack of ``rows × cols`` matrices in 4 bits: ``codes`` (uint8, two per byte) and
    ``scales`` (float32, one per block of 64 elements of a row)."""

    codes: Tensor  # (..., rows, padded_cols / 2) uint8
    scales: Tensor  # (..., rows, padded_cols / 64) float32
    cols: int


def padded(cols: int) -> int:
    return -(-cols // BLOCK) * BLOCK


def storage_shapes(rows: int, cols: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of one matrix's codes and scales."""
    width = padded(cols)
    return (rows, width // 2), (rows, width // BLOCK)


def quantize(x: Tensor) -> Quantized:
    """Quantise a stack of matrices ``(..., rows, cols)`` (any float dtype)."""
    cols = x.shape[-1]
    width = padded(cols)
    values = x.float()
    if width != cols:
        values = torch.nn.functional.pad(values, (0, width - cols))
    blocks = values.reshape(*values.shape[:-1], width // BLOCK, BLOCK)
    scales = blocks.abs().amax(dim=-1)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    normalized = blocks / safe.unsqueeze(-1)
    levels = linear_square_levels(device=x.device)
    midpoints = (levels[1:] + levels[:-1]) / 2
    codes = torch.bucketize(normalized, midpoints).to(torch.uint8)
    codes = codes.reshape(*values.shape[:-1], width)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return Quantized(packed, scales, cols)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32, out: Tensor | None = None
               ) -> Tensor:
    """The matrices ``(..., rows, cols)`` that ``q`` stores."""
    low = q.codes & 15
    high = q.codes >> 4
    codes = torch.stack((low, high), dim=-1).reshape(*q.codes.shape[:-1], -1)
    levels = linear_square_levels(device=q.codes.device)
    values = levels[codes.long()]
    blocks = values.reshape(*values.shape[:-1], -1, BLOCK) * q.scales.unsqueeze(-1)
    result = blocks.reshape(*values.shape)[..., : q.cols]
    if out is not None:
        return out.copy_(result)
    return result.to(dtype)


def bjorck(v: Tensor, iterations: int) -> Tensor:
    """``V ← 1.5 V − 0.5 V Vᵀ V`` (Björck–Bowie): one gradient step on ``‖VᵀV − I‖²``
    per iteration, which brings a nearly orthogonal stack back to orthogonality."""
    if v.dim() == 2:
        return bjorck(v.unsqueeze(0), iterations)[0]
    for _ in range(iterations):
        # V Vᵀ is symmetric: a symmetric product, about 60% of a full one at d = 1024
        gram = syrk(v.new_empty(v.shape[0], v.shape[-2], v.shape[-2]), v)
        v = torch.baddbmm(v, gram, v, beta=1.5, alpha=-0.5)
    return v


# ----------------------------------------------------------- matrices in a state dict
def state_shapes(name: str, rows: int, cols: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The state entries that hold a ``rows × cols`` matrix ``name`` in 4 bits."""
    codes, scales = storage_shapes(rows, cols)
    return {f"{name}_codes": (codes, torch.uint8), f"{name}_scales": (scales, torch.float32)}


def load(state: dict, name: str, cols: int) -> Tensor:
    """The stack of matrices ``name`` from its 4-bit entries in ``state``."""
    return dequantize(Quantized(state[f"{name}_codes"], state[f"{name}_scales"], cols))


def store(state: dict, name: str, matrices: Tensor, rows: Tensor | None = None) -> None:
    """Quantise ``matrices`` into the entries of ``name`` (only ``rows`` of the stack if
    given)."""
    q = quantize(matrices)
    for suffix, value in (("codes", q.codes), ("scales", q.scales)):
        target = state[f"{name}_{suffix}"]
        if rows is None:
            target.copy_(value)
        else:
            target.index_copy_(0, rows, value)
