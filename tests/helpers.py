"""Shared helpers of the tests: deterministic gradients, an optimizer-vs-reference runner."""

from __future__ import annotations

import contextlib
import os

import torch

from tests.reference_shampoo import ReferenceShampoo

F64 = torch.float64


def _test_device() -> torch.device:
    name = os.environ.get("HF_SHAMPOO_TEST_DEVICE", "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"HF_SHAMPOO_TEST_DEVICE={name!r}: expected 'cpu', 'cuda' or 'cuda:N'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"HF_SHAMPOO_TEST_DEVICE={name!r}, but torch sees no CUDA device")
    return device


TEST_DEVICE = _test_device()  # tests/conftest.py: which tests run there


def generator(seed: int) -> torch.Generator:
    """A seeded generator on the test device (the same numbers as before on CPU)."""
    return torch.Generator(device=TEST_DEVICE).manual_seed(seed)


def random_tensors(shape, count, seed, scale=1.0):
    gen = generator(seed)
    return [scale * torch.randn(shape, generator=gen, dtype=F64) for _ in range(count)]


def run_against_reference(
    shape,
    config,
    steps=6,
    seed=0,
    grads=None,
    lrs=None,
    rtol=1e-9,
    atol=1e-12,
):
    """Step the optimizer and the reference on the same gradients; compare after every step.

    Returns the reference so that callers can look at its counters.
    """
    from hf_shampoo import DistributedShampoo

    (w0,) = random_tensors(shape, 1, seed + 1000)
    if grads is None:
        grads = random_tensors(shape, steps, seed)
    param = torch.nn.Parameter(w0.clone())
    opt = DistributedShampoo([param], factor_matrix_dtype=F64, **config)
    ref = ReferenceShampoo(w0, **config)
    for t, g in enumerate(grads, start=1):
        lr = None
        if lrs is not None:
            lr = lrs[t - 1]
            opt.param_groups[0]["lr"] = lr
        param.grad = None if g is None else g.clone()
        opt.step()
        ref.step(g, lr=lr)
        torch.testing.assert_close(
            param.detach(),
            ref.param,
            rtol=rtol,
            atol=atol,
            msg=lambda m, t=t: f"after step {t}: {m}",
        )
    # the parameter moved at all (guards against a test that compares two no-ops)
    assert not torch.equal(param.detach(), w0)
    return ref


@contextlib.contextmanager
def one_thread_per_process():
    """``OMP_NUM_THREADS=1`` for processes spawned inside (several ranks on 2 cores run
    10-20x slower oversubscribed), restored afterwards."""
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = previous
