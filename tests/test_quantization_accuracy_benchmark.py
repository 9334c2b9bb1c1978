"""``benchmarks/quantization_accuracy.py``'s float32-storage mode (``LosslessStorage``), on
which the 4-bit accuracy analysis rests: inside it, 4-bit Shampoo runs its own algorithm
(samples, decompositions, roots) with float32 numbers, so that sampling every step gives
32-bit Shampoo back, and so does the default warm-up up to the first refresh; outside it
nothing is changed."""

from __future__ import annotations

import pytest
import torch

from benchmarks.quantization_accuracy import LosslessStorage
from hf_shampoo import DistributedShampoo, quantization
from hf_shampoo.preconditioners.quantized import QuantizedFactors

pytestmark = pytest.mark.benchmarks


def _train(steps: int = 30, **options) -> torch.Tensor:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(128, 96))
    opt = DistributedShampoo([param], lr=1e-2, epsilon=1e-6, precondition_frequency=5,
                             grafting="adam", **options)
    g = torch.Generator().manual_seed(1)
    mixing = torch.randn(128, 128, generator=g) / 10
    for _ in range(steps):
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


def test_float32_storage_with_the_default_warmup_is_32bit_shampoo_until_samples_thin():
    """precondition_frequency=5: steps 1-5 take every gradient, the roots of step 5 serve
    steps 6-9 (as in 32 bits), the sample at step 10 stands for steps 6-10."""
    with LosslessStorage():
        warm = _train(steps=9, quantization="4bit")
        cold = _train(steps=9, quantization="4bit", statistics_warmup=0)
        later = _train(steps=12, quantization="4bit")
    shampoo, shampoo_later = _train(steps=9), _train(steps=12)
    assert (warm - shampoo).norm() / shampoo.norm() < 1e-5
    assert (cold - shampoo).norm() / shampoo.norm() > 1e-4
    assert (later - shampoo_later).norm() / shampoo_later.norm() > 1e-4
