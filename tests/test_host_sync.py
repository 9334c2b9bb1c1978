"""A steady step (no refresh due) waits for the device once at most: for the check of the
gradients (``check_finite_gradients``, on by default), and not at all without it.

On a GPU, reading a tensor's value on the host (``.item()``, ``bool()``, ``.tolist()``,
``.cpu()``, ``nonzero()``, boolean-mask indexing) stops the CPU until every queued kernel
has run, so the next step's kernels cannot be queued ahead. These tests run steady steps of
every preconditioner kind with those entry points instrumented and assert that none is
reached from ``hf_shampoo``'s code. They run on any device; on CUDA, torch's own sync
debug mode is also set to ``"error"`` around the steady steps. (Refresh steps do
synchronise: they check every new factor for non-finite values before changing anything.)
The gradient check is one fused pass whose single answer is read on the host.
"""

from __future__ import annotations

import contextlib
import traceback

import pytest
import torch

from hf_shampoo import DistributedShampoo
from tests.helpers import TEST_DEVICE, generator

pytestmark = [pytest.mark.unit, pytest.mark.device]

SYNCING_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu",
                   "nonzero", "numpy")

KINDS = {
    "shampoo": {},
    "shampoo, weight decay, nesterov": dict(weight_decay=0.1, momentum=0.9, nesterov=True),
    "shampoo, l2, sgd grafting": dict(weight_decay=0.01, weight_decay_type="l2", grafting="sgd"),
    "shampoo, warm-started qr": dict(eigendecomposition="qr", eigenbasis_tolerance=0.01),
    "eigenvalue_corrected": dict(preconditioner="eigenvalue_corrected", grafting=None,
                                 epsilon=1e-8),
    "kl_shampoo": dict(preconditioner="kl_shampoo"),
    "shampoo, 4bit": dict(quantization="4bit"),
    "eigenvalue_corrected, 4bit": dict(preconditioner="eigenvalue_corrected", grafting=None,
                                       epsilon=1e-8, quantization="4bit",
                                       statistics_frequency=4),
    "sketchy": dict(preconditioner="sketchy", sketch_rank=2, sketch_threshold=3),
}


def _caller_in_package() -> str | None:
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace("\\", "/")
        if "/hf_shampoo/" in path:
            return f"hf_shampoo/{path.rsplit('/hf_shampoo/', 1)[-1]}:{frame.lineno}: {frame.line}"
    return None


@contextlib.contextmanager
def recorded_syncs():
    """Instrument the tensor methods that synchronise; yield the list of package sites."""
    sites: list[str] = []
    real = {name: getattr(torch.Tensor, name) for name in SYNCING_METHODS + ("__getitem__",)}
    depth = [0]  # a default device (``torch.set_default_device``, as on CUDA here) is a
    # torch-function mode, through which the real method calls the patched one again

    def wrap(name):
        def method(self, *args, **kwargs):
            if depth[0] == 0:
                site = _caller_in_package()
                if site:
                    sites.append(f"{name} at {site}")
            depth[0] += 1
            try:
                return real[name](self, *args, **kwargs)
            finally:
                depth[0] -= 1
        return method

    def getitem(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
            site = _caller_in_package()
            if site:
                sites.append(f"boolean-mask indexing at {site}")
        return real["__getitem__"](self, index)

    for name in SYNCING_METHODS:
        setattr(torch.Tensor, name, wrap(name))
    torch.Tensor.__getitem__ = getitem
    debug = torch.cuda.get_sync_debug_mode() if TEST_DEVICE.type == "cuda" else None
    if debug is not None:
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield sites
    finally:
        for name, method in real.items():
            setattr(torch.Tensor, name, method)
        if debug is not None:
            torch.cuda.set_sync_debug_mode(debug)


def _optimizer(**kw):
    g = generator(0)
    shapes = [(20, 12), (12,), (3, 4, 5), (40, 6)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g, device=TEST_DEVICE))
              for s in shapes]
    opt = DistributedShampoo(params, lr=1e-2, precondition_frequency=4,
                             start_preconditioning_step=4, max_preconditioner_dim=16,
                             distributed="none", **{"check_finite_gradients": False, **kw})
    grads = [[torch.randn(s, generator=g, device=TEST_DEVICE) for s in shapes]
             for _ in range(7)]
    return opt, params, grads


def _step(opt, params, grads):
    for p, grad in zip(params, grads):
        p.grad = grad.clone()
    opt.step()


@pytest.mark.parametrize("kind", list(KINDS))
def test_steady_steps_do_not_synchronise(kind):
    opt, params, grads = _optimizer(**KINDS[kind])
    for t in range(5):  # steps 1-5: grafting, then the first refresh at step 4
        _step(opt, params, grads[t])
    before = [p.detach().clone() for p in params]
    with recorded_syncs() as sites:
        _step(opt, params, grads[5])  # steps 6 and 7: steady (the next refresh is at 8)
        _step(opt, params, grads[6])
    assert not sites, "host synchronisation in a steady step:\n" + "\n".join(sites)
    assert all(not torch.equal(a, p) for a, p in zip(before, params))  # they did step


@pytest.mark.parametrize("default_device", [False, True])
def test_the_gradient_check_synchronises_once_per_step(default_device):
    """With ``check_finite_gradients`` (the default), a steady step reads one answer on the
    host, in the distributor's fused check, and nothing else; also counted once under a
    default device (a torch-function mode that re-enters the instrumented methods)."""
    opt, params, grads = _optimizer(check_finite_gradients=True)
    for t in range(5):
        _step(opt, params, grads[t])
    mode = torch.device(TEST_DEVICE) if default_device else contextlib.nullcontext()
    with mode, recorded_syncs() as sites:
        if TEST_DEVICE.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        _step(opt, params, grads[5])
    assert len(sites) == 1 and "distributors/base.py" in sites[0], sites


def test_the_check_sees_a_synchronisation(monkeypatch):
    """The instrument itself: a ``.item()`` slipped into the steady path is reported."""
    from hf_shampoo import update_rules

    real = update_rules.update_grafting_state

    def syncing(state, group, grad):
        grad.abs().max().item()
        return real(state, group, grad)

    monkeypatch.setattr(update_rules, "update_grafting_state", syncing)
    opt, params, grads = _optimizer()
    for t in range(5):
        _step(opt, params, grads[t])
    if TEST_DEVICE.type == "cuda":
        with pytest.raises(RuntimeError), recorded_syncs():
            _step(opt, params, grads[5])
        return
    with recorded_syncs() as sites:
        _step(opt, params, grads[5])
    # the patched stage is called from stack.py: the innermost package frame is named
    assert [s for s in sites if s.startswith("item at") and "stack.py" in s], sites


def test_a_refresh_step_is_allowed_to_synchronise():
    """Refresh steps check new factors for non-finite values (a sync); the steady test
    above would be empty if the instrument could not see those."""
    opt, params, grads = _optimizer()
    for t in range(3):
        _step(opt, params, grads[t])
    with recorded_syncs() as sites:
        if TEST_DEVICE.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        _step(opt, params, grads[3])  # step 4: the first refresh
    assert sites
