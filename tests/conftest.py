"""Test-device switch: ``HF_SHAMPOO_TEST_DEVICE=cuda pytest`` runs the device-generic tests
on a GPU.

The device-generic modules (``DEVICE_GENERIC``: single-process numerics, checkpoints,
validation) run with ``torch.set_default_device`` set to the selected device, so that their
parameters, gradients and references are created there; their random numbers come from
``tests.helpers.generator``, a generator on the same device. The other modules launch gloo
process groups or CPU-only tools (torchrun workers, the Trainer with ``use_cpu``, the docs'
scripts) and are skipped on another device, with the reason. Unset, or ``cpu``, changes
nothing: the suite runs on CPU exactly as before.
"""

from __future__ import annotations

import os

import pytest
import torch

# DeepSpeed (a test dependency) is imported by transformers' Trainer when it is installed;
# on a machine without a GPU it would print an accelerator warning into the output of
# every script the tests run: name its CPU accelerator, for this process and its children
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

try:
    from tests.helpers import TEST_DEVICE
except ValueError as error:  # a bad HF_SHAMPOO_TEST_DEVICE: say so, not a traceback
    raise pytest.UsageError(str(error)) from None

DEVICE_GENERIC = {
    "test_blocking", "test_checkpoint", "test_eigendecomposed", "test_gpu", "test_host_sync",
    "test_inverse_root_dtype", "test_kronecker", "test_linalg", "test_optimizer_behaviour",
    "test_parity_meta", "test_performance_options", "test_quantization",
    "test_reference_equality", "test_root_solvers", "test_step_time_benchmark",
    "test_torch_equivalence",
    "test_validation",
}


def pytest_report_header(config):
    return f"hf_shampoo test device: {TEST_DEVICE} (HF_SHAMPOO_TEST_DEVICE)"


def pytest_collection_modifyitems(config, items):
    if TEST_DEVICE.type == "cpu":
        return
    skip = pytest.mark.skip(reason=f"runs on CPU only (gloo / subprocess / use_cpu); "
                                   f"HF_SHAMPOO_TEST_DEVICE={TEST_DEVICE}")
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] not in DEVICE_GENERIC:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _default_device():
    """Tensors created without a device land on the test device (only when it is not CPU)."""
    if TEST_DEVICE.type == "cpu":
        yield
        return
    torch.set_default_device(TEST_DEVICE)
    try:
        yield
    finally:
        torch.set_default_device("cpu")
