"""``inv_factor_matrix_dtype``: Shampoo's inverse roots stored in a low precision, and the
steady step's preconditioning products run in it (Meta's option of that name; its numbers
are matched in ``tests/test_parity_meta.py``). Here: the roots are the full-precision roots
cast, the step is the low-precision product, the state is smaller, checkpoints resume
exactly, and bad values are refused."""

from __future__ import annotations

import io

import pytest
import torch

from hf_shampoo import DistributedShampoo
from hf_shampoo.integrations.transformers import parse_optim_args
from tests.helpers import TEST_DEVICE, generator

pytestmark = [pytest.mark.unit, pytest.mark.device]

SHAPES = [(12, 8), (5,)]


def _optimizer(seed=0, **kw):
    g = generator(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    config = dict(lr=0.1, betas=(0.0, 0.99), epsilon=1e-6, precondition_frequency=2,
                  max_preconditioner_dim=16, distributed="none")
    return params, DistributedShampoo(params, **{**config, **kw})


def _grads(steps, seed=1):
    g = generator(seed)
    return [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(steps)]


def _step(opt, params, grads):
    for p, grad in zip(params, grads):
        p.grad = grad.clone()
    opt.step()


def _roots(opt):
    return {(i, name): tensor for i, stack in enumerate(opt._layout.owned)
            for name, tensor in stack.state.items() if name.startswith("inverse_root_")}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_roots_are_the_full_precision_roots_cast(dtype):
    grads = _grads(2)
    params_f, full = _optimizer()
    params_l, low = _optimizer(inv_factor_matrix_dtype=dtype)
    for t in range(2):  # step 2: the first refresh (nothing preconditioned before it)
        _step(full, params_f, grads[t])
        _step(low, params_l, grads[t])
    roots_f, roots_l = _roots(full), _roots(low)
    assert roots_f.keys() == roots_l.keys() and roots_f
    for key, root in roots_l.items():
        assert root.dtype == dtype
        assert torch.equal(root, roots_f[key].to(dtype)), key
        assert 2 * root.nbytes == roots_f[key].nbytes


def test_the_step_is_the_bfloat16_product():
    """Without grafting or momentum the update is ``-lr · (R_1 G R_2)``, each product
    rounded to bfloat16, in float32 parameters."""
    grads = _grads(3)
    params, opt = _optimizer(inv_factor_matrix_dtype=torch.bfloat16)
    params_f, full = _optimizer()
    for t in range(2):
        _step(opt, params, grads[t])
        _step(full, params_f, grads[t])
    (left, right), = [[r for (i, _), r in sorted(_roots(opt).items()) if i == k]
                      for k, stack in enumerate(opt._layout.owned) if stack.shape == (12, 8)]
    before = params[0].detach().clone()
    before_f = params_f[0].detach().clone()
    _step(opt, params, grads[2])
    _step(full, params_f, grads[2])
    g = grads[2][0].to(torch.bfloat16)
    expected = -0.1 * (left[0] @ g @ right[0].mT).float()
    moved, moved_f = params[0].detach() - before, params_f[0].detach() - before_f
    # on a CPU the same kernels round alike; a GPU may pick another bf16 kernel for the
    # batched product (a bfloat16 rounding apart, 2^-8)
    rtol = 0.0 if TEST_DEVICE.type == "cpu" else 2**-7
    torch.testing.assert_close(moved, expected, rtol=rtol, atol=1e-6)
    # and it is not the float32 step (the low-precision path was taken)
    assert (moved - moved_f).abs().max() > 1e-4 * moved_f.abs().max()


def test_checkpoint_resumes_exactly_and_refuses_another_dtype():
    grads = _grads(6)
    params, opt = _optimizer(inv_factor_matrix_dtype=torch.bfloat16)
    for t in range(3):
        _step(opt, params, grads[t])
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    saved = [p.detach().clone() for p in params]
    for t in range(3, 6):
        _step(opt, params, grads[t])

    resumed_params, resumed = _optimizer(inv_factor_matrix_dtype=torch.bfloat16)
    with torch.no_grad():
        for p, s in zip(resumed_params, saved):
            p.copy_(s)
    resumed.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    for t in range(3, 6):
        _step(resumed, resumed_params, grads[t])
    for a, b in zip(resumed_params, params):
        assert torch.equal(a, b)

    _, other = _optimizer()
    with pytest.raises(ValueError, match="inv_factor_matrix_dtype"):
        other.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))


@pytest.mark.parametrize("kw, message", [
    (dict(inv_factor_matrix_dtype=torch.int8), "expected one of None, torch.float32"),
    (dict(inv_factor_matrix_dtype="bfloat16"), "expected one of None, torch.float32"),
    (dict(inv_factor_matrix_dtype=torch.bfloat16, preconditioner="eigenvalue_corrected"),
     "preconditioner='shampoo' without quantization"),
    (dict(inv_factor_matrix_dtype=torch.bfloat16, quantization="4bit"),
     "preconditioner='shampoo' without quantization"),
])
def test_bad_values_are_refused(kw, message):
    with pytest.raises(ValueError, match="inv_factor_matrix_dtype") as error:
        _optimizer(**kw)
    assert message in str(error.value)


def test_diagonal_groups_accept_it():
    """Module rules put biases and norms in 'diagonal' groups and pass every keyword to
    each group: there the option has nothing to act on, and is accepted."""
    grads = _grads(3)
    params, opt = _optimizer(preconditioner="diagonal", grafting="adam",
                             inv_factor_matrix_dtype=torch.bfloat16)
    params_f, full = _optimizer(preconditioner="diagonal", grafting="adam")
    for t in range(3):
        _step(opt, params, grads[t])
        _step(full, params_f, grads[t])
    for a, b in zip(params, params_f):
        assert torch.equal(a, b)


def test_reachable_from_optim_args():
    assert parse_optim_args("inv_factor_matrix_dtype=bfloat16").kwargs == {
        "inv_factor_matrix_dtype": torch.bfloat16}
    assert parse_optim_args("inv_factor_matrix_dtype=none").kwargs == {
        "inv_factor_matrix_dtype": None}
