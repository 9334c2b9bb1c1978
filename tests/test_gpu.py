"""On a GPU (``HF_SHAMPOO_TEST_DEVICE=cuda``): what the device-generic suite cannot say.

- The optimizer on CUDA (cuSOLVER's eigendecompositions, CUDA matmuls) gives the CPU's
  numbers: float64 runs of every unquantised kind agree to round-off. (4-bit state is left
  out: a round-off difference may flip a 4-bit code, which is not a device bug.)
- A checkpoint saved on the GPU resumes on the CPU, and one saved on the CPU resumes on the
  GPU, continuing the same run.
- The Trainer with ``fsdp_config={"fsdp_version": 2}`` and ``optim="distributed_shampoo"``
  on one GPU: FSDP2 set up by the Trainer itself (NCCL, no switching as on CPU), saved at
  step 4 and resumed, bit for bit.
"""

from __future__ import annotations

import io

import pytest
import torch

from hf_shampoo import DistributedShampoo
from tests.helpers import TEST_DEVICE, assert_trainer_resumed_exactly, run_trainer_fsdp_worker

pytestmark = [pytest.mark.unit, pytest.mark.device]
needs_cuda = pytest.mark.skipif(TEST_DEVICE.type != "cuda",
                                reason="needs HF_SHAMPOO_TEST_DEVICE=cuda and a GPU")

F64 = torch.float64
# Every factor is full rank, and well conditioned, before its first root (6 gradients by the
# step preconditioning starts): a rank-deficient factor's null space is scaled by
# epsilon^(-1/p), which turns the devices' round-off (1e-16 in an eigenvalue) into percent
# differences; then the two devices' numbers are not expected to agree (docs/gpu.md).
SHAPES = [(8, 6), (4,), (3, 4, 5), (40, 6)]
KINDS = {
    "shampoo": {},
    "shampoo, staggered, weight decay": dict(refresh_schedule="staggered", weight_decay=0.1),
    "shampoo, warm-started qr": dict(eigendecomposition="qr", eigenbasis_tolerance=0.01),
    "shampoo, cholesky qr": dict(eigendecomposition="qr", orthogonalization="cholesky_qr"),
    "eigenvalue_corrected": dict(preconditioner="eigenvalue_corrected", grafting=None,
                                 epsilon=1e-8),
    "kl_shampoo": dict(preconditioner="kl_shampoo"),
}


def _run(device, kind, steps=12, start=None, state=None):
    """``steps`` steps of a float64 run on ``device`` (gradients made on the CPU, so both
    devices see the same numbers); optionally starting from a saved ``start``."""
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g, dtype=F64, device="cpu") for s in SHAPES]
    grads = [[torch.randn(s, generator=g, dtype=F64, device="cpu") for s in SHAPES]
             for _ in range(steps)]
    params = [torch.nn.Parameter((p if start is None else q).clone().to(device))
              for p, q in zip(init, start or init)]
    opt = DistributedShampoo(params, lr=1e-2, precondition_frequency=3,
                             start_preconditioning_step=7, max_preconditioner_dim=16,
                             factor_matrix_dtype=F64,
                             distributed="none", **KINDS[kind])
    first = 0
    if state is not None:
        opt.load_state_dict(torch.load(io.BytesIO(state), weights_only=True))
        first = opt.param_groups[0]["step"]
    for t in range(first, steps):
        for p, grad in zip(params, grads[t]):
            p.grad = grad.to(device)
        opt.step()
    return [p.detach().cpu() for p in params], opt


def _saved(opt) -> bytes:
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_comparison_survives_round_off_in_the_eigendecompositions(kind, monkeypatch):
    """On the CPU: ``eigh`` of each factor perturbed by 1e-15 of its largest entry (the
    size of two libraries' round-off) moves no parameter by more than the tolerance the
    CUDA test allows. With rank-deficient factors at the first root (the test's first
    version) it moved them by up to 40, and that test failed on an H200 for this reason."""
    real = torch.linalg.eigh
    gen = torch.Generator().manual_seed(1)

    def perturbed(a, *args, **kwargs):
        noise = torch.randn(a.shape, generator=gen, dtype=a.dtype, device="cpu").to(a.device)
        noise = (noise + noise.mT) * a.abs().amax(dim=(-2, -1), keepdim=True) * 1e-15
        return real(a + noise, *args, **kwargs)

    exact, _ = _run("cpu", kind)
    monkeypatch.setattr(torch.linalg, "eigh", perturbed)
    moved, _ = _run("cpu", kind)
    for a, b in zip(moved, exact):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)


@needs_cuda
@pytest.mark.parametrize("kind", list(KINDS))
def test_cuda_gives_the_cpu_numbers(kind):
    on_cpu, _ = _run("cpu", kind)
    on_gpu, opt = _run(TEST_DEVICE, kind)
    for stack in opt._layout.owned:
        assert {t.device.type for t in stack.state.values()} == {"cuda"}
    for a, b in zip(on_gpu, on_cpu):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@needs_cuda
@pytest.mark.parametrize("kind", ["shampoo", "eigenvalue_corrected"])
@pytest.mark.parametrize("saved_on, resumed_on", [("cuda", "cpu"), ("cpu", "cuda")])
def test_checkpoint_moves_between_devices(kind, saved_on, resumed_on):
    device = {"cuda": TEST_DEVICE, "cpu": torch.device("cpu")}
    whole, _ = _run(device[resumed_on], kind)
    half, opt = _run(device[saved_on], kind, steps=8)
    resumed, _ = _run(device[resumed_on], kind, start=half, state=_saved(opt))
    for a, b in zip(resumed, whole):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@needs_cuda
@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_trainer_fsdp2_on_one_gpu_resumes_exactly(tmp_path, state_dict_type):
    result = run_trainer_fsdp_worker(tmp_path, state_dict_type, nproc=1, device="cuda",
                                     timeout=600)
    assert result["distributed_type"] == "DistributedType.FSDP"
    assert result["fsdp_version"] == 2 and result["backend"] == "nccl"
    assert result["param_devices"] == ["cuda:0"]
    assert_trainer_resumed_exactly(result)
