"""The suite's layers and its test-device switch.

Every test module declares its layer with a marker (``pytestmark``), registered in
pyproject.toml; a module without one is a collection error, so that ``-m`` selects the
whole suite:

- ``unit``: single-process numerics, validation, checkpoints, the package's layout: the test
  runs in this one process, with no process group; it may run a plain subprocess that is no
  launcher (a build, a fresh interpreter, a tool);
- ``distributed``: gloo process groups and torchrun launches (DDP, FSDP2, TP, nodes, faults);
- ``integrations``: the Trainer, Accelerate, timm, peft, DeepSpeed, the docs' snippets;
- ``reference``: against reference implementations (Meta's ``distributed_shampoo`` when
  ``HF_SHAMPOO_META_PATH`` is set, the dense float64 reference, torch's optimizers and
  their ``OptimizerInfo`` contracts);
- ``benchmarks``: the benchmark scripts at toy size.

A test's layers are the layer markers on it and its module. A module of one layer may mark
the few tests of another with a per-test marker (``@pytest.mark.distributed`` on a test that
spawns ranks in a ``unit`` module): such a test carries both, so ``-m unit`` selects it too and
``-m "unit and not distributed"`` leaves it out. The ``unit`` rule is enforced: while a test
whose only layer is ``unit`` sets up and runs, ``torch.multiprocessing.spawn`` /
``start_processes``, ``torch.distributed.init_process_group`` and a subprocess launched through
``torch.distributed.run`` / ``torchrun`` (``--nproc_per_node``) fail with "a unit test started
...: mark it distributed" (a plain subprocess, such as a wheel build or a fresh interpreter,
is allowed; what it does itself is not watched).

``device`` marks the device-generic modules. ``HF_SHAMPOO_TEST_DEVICE=cuda pytest -m device``
runs them on a GPU: their tests run with ``torch.set_default_device`` set to the selected
device, so that their parameters, gradients and references are created there; their random
numbers come from ``tests.helpers.generator``, a generator on the same device. The modules
without ``device`` launch gloo process groups or CPU-only tools (torchrun workers, the Trainer
with ``use_cpu``, the docs' scripts) and are skipped on another device, with the reason.
Unset, or ``cpu``, changes nothing: the suite runs on CPU exactly as before.
"""

from __future__ import annotations

import contextlib
import os
import subprocess

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
                        if not layers_of(item)})
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


def layers_of(item) -> set[str]:
    """The layer markers on a test and its module."""
    return {layer for layer in LAYERS if item.get_closest_marker(layer)}


LAUNCHER_ARGUMENTS = ("torch.distributed.run", "torchrun", "--nproc_per_node", "--nproc-per-node")


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"a unit test started {what}: mark it distributed "
                           "(tests/conftest.py, the layers)")
    return refuse


@contextlib.contextmanager
def _one_process(item):
    """For a test whose only layer is ``unit``: no spawned ranks, process group or launcher."""
    if layers_of(item) != {"unit"}:
        yield
        return
    import torch.distributed
    import torch.multiprocessing

    popen = subprocess.Popen

    class Popen(popen):  # type: ignore[misc,valid-type]
        def __init__(self, args, *rest, **kwargs):
            words = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
            for word in words:
                word = os.fsdecode(word) if isinstance(word, (bytes, os.PathLike)) else str(word)
                if (os.path.basename(word) in LAUNCHER_ARGUMENTS
                        or word.split("=")[0] in LAUNCHER_ARGUMENTS):
                    _refuse(f"a distributed launch ({word} in {words!r})")()
            super().__init__(args, *rest, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.multiprocessing, "spawn",
                      _refuse("processes (torch.multiprocessing.spawn)"))
        patch.setattr(torch.multiprocessing, "start_processes",
                      _refuse("processes (torch.multiprocessing.start_processes)"))
        if torch.distributed.is_available():
            patch.setattr(torch.distributed, "init_process_group",
                          _refuse("a process group (torch.distributed.init_process_group)"))
        patch.setattr(subprocess, "Popen", Popen)
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """The setup of its fixtures too (a module's fixture sets up with its first test)."""
    with _one_process(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _one_process(item):
        yield


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
