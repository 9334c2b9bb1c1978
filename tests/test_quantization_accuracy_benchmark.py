"""``benchmarks/quantization_accuracy.py``'s float32-storage mode (``LosslessStorage``), on
which the 4-bit accuracy analysis rests: inside it, 4-bit Shampoo runs its own algorithm
(samples, decompositions, roots) with float32 numbers, so that sampling every step gives
32-bit Shampoo back; outside it nothing is changed."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from hf_shampoo import DistributedShampoo, quantization
from hf_shampoo.preconditioners.quantized import QuantizedFactors

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from quantization_accuracy import LosslessStorage  # noqa: E402


def _train(**options) -> torch.Tensor:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(128, 96))
    opt = DistributedShampoo([param], lr=1e-2, epsilon=1e-6, precondition_frequency=5,
                             grafting="adam", **options)
    g = torch.Generator().manual_seed(1)
    mixing = torch.randn(128, 128, generator=g) / 10
    for _ in range(30):
        param.grad = mixing @ torch.randn(128, 96, generator=g) + 0.1 * param.detach()
        opt.step()
    return param.detach().clone()


def test_float32_storage_with_a_sample_every_step_is_32bit_shampoo():
    shampoo = _train()
    every_step = dict(quantization="4bit", statistics_frequency=1)
    four_bit = _train(**every_step)
    with LosslessStorage():
        lossless = _train(**every_step)
    scale = shampoo.norm()
    assert (lossless - shampoo).norm() / scale < 1e-5
    # the 4-bit numbers are what separates the plain 4-bit run from 32 bits
    assert (four_bit - shampoo).norm() / scale > 1e-3


def test_float32_storage_changes_nothing_outside_it():
    saved = quantization.load, quantization.store, QuantizedFactors.eigenvectors
    before = _train(quantization="4bit")
    with LosslessStorage():
        assert quantization.load is not saved[0]
    assert (quantization.load, quantization.store, QuantizedFactors.eigenvectors) == saved
    assert torch.equal(_train(quantization="4bit"), before)
