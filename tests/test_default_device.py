"""The step does not depend on torch's default device.

A script that calls ``torch.set_default_device("cuda")`` (or runs under ``with
torch.device(...)``) changes where every tensor made without ``device=`` lands. The
optimizer's bookkeeping tensors (success flags, index lists, the 4-bit code's levels) are
made on the CPU on purpose and its state on the parameter's device, so neither may follow
the default device. Found on a GPU (tests ran with ``set_default_device("cuda")``): the 4-bit
refresh mixed a CUDA flag tensor with CPU indices and raised. Here the default device is
``meta``, which holds no data: any tensor of the step that followed it fails loudly, on a
CPU-only machine. Every kind must give the numbers it gives without a default device,
bit for bit, including ``metrics()`` and a state-dict round trip.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from hf_shampoo import DistributedShampoo, quantization

pytestmark = pytest.mark.unit

SHAPES = [(8, 6), (4,), (3, 4, 5), (40, 6)]
KINDS = {
    "shampoo": {},
    "shampoo, staggered, weight decay": dict(refresh_schedule="staggered", weight_decay=0.1),
    "shampoo, warm-started qr": dict(eigendecomposition="qr", eigenbasis_tolerance=0.01),
    "shampoo, coupled newton": dict(root_inverse="coupled_newton"),
    "shampoo, pseudo-inverse": dict(rank_deficient="pseudo_inverse", epsilon=0.0),
    "eigenvalue_corrected": dict(preconditioner="eigenvalue_corrected", grafting=None,
                                 epsilon=1e-8),
    "eigenvalue_corrected, qr, tolerance": dict(
        preconditioner="eigenvalue_corrected", grafting=None, epsilon=1e-8,
        eigendecomposition="qr", eigenbasis_tolerance=0.01),
    "kl_shampoo": dict(preconditioner="kl_shampoo"),
    "shampoo, 4bit": dict(quantization="4bit"),
    "eigenvalue_corrected, 4bit, qr, staggered": dict(
        preconditioner="eigenvalue_corrected", epsilon=1e-8, eigendecomposition="qr",
        quantization="4bit", statistics_frequency=1, refresh_schedule="staggered"),
    "shampoo, schedule-free": dict(iterate_averaging="schedule_free", momentum=0.0),
    "shampoo, gpa": dict(iterate_averaging="gpa"),
    "sketchy, staggered": dict(preconditioner="sketchy", sketch_rank=2, sketch_threshold=3,
                               refresh_schedule="staggered"),
}


def _run(kind: str, default_device):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, device="cpu"))
              for s in SHAPES]
    grads = [[torch.randn(s, generator=gen, device="cpu") for s in SHAPES] for _ in range(8)]
    context = contextlib.nullcontext() if default_device is None else torch.device(
        default_device)
    with context:
        opt = DistributedShampoo(params, lr=1e-2, precondition_frequency=3,
                                 max_preconditioner_dim=4, distributed="none", **KINDS[kind])
        for t in range(5):
            for p, grad in zip(params, grads[t]):
                p.grad = grad.clone()
            opt.step()
        saved = opt.state_dict()
        opt.load_state_dict(saved)
        for t in range(5, 8):
            for p, grad in zip(params, grads[t]):
                p.grad = grad.clone()
            opt.step()
        metrics = opt.metrics()
    return [p.detach() for p in params], metrics


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_default_device_changes_nothing(kind, monkeypatch):
    monkeypatch.setattr(quantization, "MIN_QUANTIZED_ELEMENTS", 16)
    expected, expected_metrics = _run(kind, None)
    got, metrics = _run(kind, "meta")
    assert all(p.device.type == "cpu" for p in got)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    assert metrics.keys() == expected_metrics.keys()
    for key, value in expected_metrics.items():
        if key.endswith("refresh_seconds"):
            continue
        assert metrics[key] == value or (math.isnan(metrics[key]) and math.isnan(value)), key
