"""``apply_precision="tf32"``: the products that apply the preconditioner take TF32 operands
(``hf_shampoo/matmul_precision.py``; on a CPU emulated, which these tests use), nothing
else changes; the emulation is the calling thread's only; refusals."""

from __future__ import annotations

import struct

import pytest
import torch

from hf_shampoo import DistributedShampoo
from hf_shampoo.matmul_precision import EmulatedTF32, check, to_tf32

pytestmark = pytest.mark.unit


def _tf32_reference(value: float) -> float:
    """TF32 rounding of one float32 by integer arithmetic in Python: nearest, ties to even."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    low, high = bits & 0x1FFF, bits & ~0x1FFF & 0xFFFFFFFF
    if low > 0x1000 or (low == 0x1000 and (high >> 13) & 1):
        high = (high + 0x2000) & 0xFFFFFFFF
    return struct.unpack("<f", struct.pack("<I", high))[0]


def test_to_tf32_rounds_to_nearest_even_on_ten_mantissa_bits():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4000, generator=generator) * torch.logspace(-20, 20, 4000)
    # ties and near-ties: a value halfway between two TF32 neighbours, either parity
    ties = torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11, -(1 + 2 ** -11), 1 + 2 ** -11 + 2 ** -23])
    x = torch.cat([x, ties, torch.tensor([0.0, -0.0, float("inf"), float("nan")])])
    got = to_tf32(x)
    expected = torch.tensor([_tf32_reference(float(v)) for v in x[:-2]])
    assert torch.equal(got[:-2], expected)
    assert got[-2] == float("inf") and torch.isnan(got[-1])
    assert (got[:-2].view(torch.int32) & 0x1FFF).eq(0).all()


def test_emulated_products_multiply_rounded_operands():
    generator = torch.Generator().manual_seed(1)
    a, b = (torch.randn(3, 20, 20, generator=generator) for _ in range(2))
    c = torch.randn(3, 20, 20, generator=generator)
    with EmulatedTF32():
        got = torch.bmm(a, b)
        added = torch.baddbmm(c, a, b)
    assert torch.equal(got, torch.bmm(to_tf32(a), to_tf32(b)))
    assert torch.equal(added, torch.baddbmm(c, to_tf32(a), to_tf32(b)))  # c is not rounded
    assert not torch.equal(got, torch.bmm(a, b))


def _run(precision: str, steps: int = 6, **extra) -> tuple[list[torch.Tensor], object]:
    generator = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(*s, generator=generator))
              for s in ((24, 16), (16,), (8, 4, 3))]
    grads = [[torch.randn(p.shape, generator=generator) for p in params] for _ in range(steps)]
    opt = DistributedShampoo(params, lr=0.01, precondition_frequency=2,
                             start_preconditioning_step=2, epsilon=1e-8,
                             apply_precision=precision, distributed="none", **extra)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g
        opt.step()
    return [p.detach().clone() for p in params], opt


@pytest.mark.parametrize("kind, bound", [
    ({}, 1e-2),  # Shampoo: 4e-3 measured
    ({"preconditioner": "eigenvalue_corrected"}, 5e-2),  # SOAP: 1.5e-2 (Adam in the
    # eigenbasis divides by the second moment of the rounded projections)
])
def test_tf32_moves_the_step_by_tf32_rounding_only(kind, bound):
    ieee, _ = _run("ieee", **kind)
    tf32, _ = _run("tf32", **kind)
    start, _ = _run("ieee", steps=0, **kind)
    for a, b, s in zip(ieee, tf32, start):
        moved = (a - s).norm()
        gap = (a - b).norm() / moved
        assert 0 < gap < bound, float(gap)


def test_tf32_emulation_is_the_calling_threads_only():
    """With refresh_delay, the worker's refresh products stay float32: the run equals the
    same delayed refreshes computed at once, in the step's thread, outside the products."""
    background, _ = _run("tf32", refresh_delay=1)
    generator = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(*s, generator=generator))
              for s in ((24, 16), (16,), (8, 4, 3))]
    grads = [[torch.randn(p.shape, generator=generator) for p in params] for _ in range(6)]
    opt = DistributedShampoo(params, lr=0.01, precondition_frequency=2,
                             start_preconditioning_step=2, epsilon=1e-8,
                             apply_precision="tf32", refresh_delay=1, distributed="none")
    opt.background_refresh = False
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g
        opt.step()
    for a, b in zip(background, params):
        assert torch.equal(a, b.detach())


def test_tf32_with_a_refresh_delay_is_refused_on_cuda():
    group = {"apply_precision": "tf32", "refresh_delay": 1}
    with pytest.raises(ValueError, match=r"apply_precision='tf32' with refresh_delay=1.*'ieee'"):
        check(group, torch.device("cuda"))
    check(group, torch.device("cpu"))  # emulated, the worker's products untouched
    check({"apply_precision": "tf32", "refresh_delay": 0}, torch.device("cuda"))


def test_an_invalid_value_is_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"apply_precision.*'ieee'.*'tf32'"):
        DistributedShampoo([torch.nn.Parameter(torch.zeros(3))], apply_precision="bf16")


def test_cuda_switch_is_restored_through_the_api_the_process_uses():
    """The switch is flipped and restored from any state a process may have set (torch
    raises when a process reads the legacy ``allow_tf32`` after setting
    ``fp32_precision="tf32"``: that state is left untouched, TF32 already). The flags
    exist without a GPU, so this runs anywhere."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from hf_shampoo.matmul_precision import _cuda_tf32\n"
        "m = torch.backends.cuda.matmul\n"
        "for start in ('none', 'ieee', 'tf32'):\n"
        "    if start != 'none':\n"
        "        m.fp32_precision = start\n"
        "    with _cuda_tf32():\n"
        "        assert m.fp32_precision == 'tf32'\n"
        "    assert m.fp32_precision == ('tf32' if start == 'tf32' else 'ieee'), start\n"
        "    if start != 'tf32':\n"
        "        assert m.allow_tf32 is False\n"
        "m.allow_tf32 = True\n"  # the legacy API: TF32 already, left as it is
        "with _cuda_tf32():\n"
        "    assert m.allow_tf32\n"
        "assert m.allow_tf32\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]
