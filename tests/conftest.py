"""The suite's layers and its test-device switch.

Every test module declares its layer with a marker (``pytestmark``), registered in
pyproject.toml; a module without one is a collection error, so that ``-m`` selects the
whole suite:

- ``unit``: single-process numerics, validation, checkpoints, the package's layout;
- ``distributed``: gloo process groups and torchrun launches (DDP, FSDP2, TP, nodes, faults);
- ``integrations``: the Trainer, Accelerate, timm, peft, DeepSpeed, the docs' snippets;
- ``reference``: against reference implementations (Meta's ``distributed_shampoo`` when
  ``HF_SHAMPOO_META_PATH`` is set, the dense float64 reference, torch's optimizers and
  their ``OptimizerInfo`` contracts);
- ``benchmarks``: the benchmark scripts at toy size.

``device`` marks the device-generic modules. ``HF_SHAMPOO_TEST_DEVICE=cuda pytest -m device``
runs them on a GPU: their tests run with ``torch.set_default_device`` set to the selected
device, so that their parameters, gradients and references are created there; their random
numbers come from ``tests.helpers.generator``, a generator on the same device. The modules
without ``device`` launch gloo process groups or CPU-only tools (torchrun workers, the Trainer
with ``use_cpu``, the docs' scripts) and are skipped on another device, with the reason.
Unset, or ``cpu``, changes nothing: the suite runs on CPU exactly as before.
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

LAYERS = ("unit", "distributed", "integrations", "reference", "benchmarks")


def pytest_report_header(config):
    return f"hf_shampoo test device: {TEST_DEVICE} (HF_SHAMPOO_TEST_DEVICE)"


def pytest_collection_modifyitems(config, items):
    unlayered = sorted({item.module.__name__ for item in items
                        if not any(item.get_closest_marker(layer) for layer in LAYERS)})
    if unlayered:
        raise pytest.UsageError(f"test modules without a layer marker ({', '.join(LAYERS)}): "
                                f"{', '.join(unlayered)}; add `pytestmark = pytest.mark.LAYER`")
    if TEST_DEVICE.type == "cpu":
        return
    skip = pytest.mark.skip(reason=f"runs on CPU only (gloo / subprocess / use_cpu); "
                                   f"HF_SHAMPOO_TEST_DEVICE={TEST_DEVICE}")
    for item in items:
        if item.get_closest_marker("device") is None:
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
