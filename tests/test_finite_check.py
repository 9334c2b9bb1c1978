"""The every-step non-finite gradient check (``check_finite_gradients``): a fused L2 norm per
gradient, then an exact look only where that norm is not finite. It must flag exactly the
gradients that hold a nan or an inf (anywhere, in any dtype) and never a finite one, however
large (a norm that overflows is not a non-finite gradient)."""

import pytest
import torch

from hf_shampoo import DistributedShampoo, ShampooNumericalError
from hf_shampoo.distributors.base import confirmed_nonfinite, maybe_nonfinite

pytestmark = pytest.mark.unit

BAD = [float("nan"), float("inf"), -float("inf")]
SHAPES = [(7,), (1,), (0,), (33, 5), (4, 3, 2), (300, 17)]


def _flags(tensors):
    fast = maybe_nonfinite(tensors)
    return confirmed_nonfinite(tensors, fast.tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16,
                                   torch.float16])
def test_a_single_bad_element_anywhere_is_found(dtype):
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
    assert _flags(tensors) == [False] * len(tensors)
    for t, tensor in enumerate(tensors):
        n = tensor.numel()
        for position in sorted({0, n // 2, n - 1}) if n else []:
            for value in BAD:
                poisoned = [x.clone() for x in tensors]
                poisoned[t].view(-1)[position] = value
                expected = [k == t for k in range(len(tensors))]
                assert _flags(poisoned) == expected, (t, position, value)


@pytest.mark.parametrize("dtype,big", [(torch.float32, 3e38), (torch.float64, 1e300),
                                       (torch.bfloat16, 3e38), (torch.float16, 6e4)])
def test_large_finite_gradients_are_not_flagged(dtype, big):
    """Their norm overflows (the fast test flags them; float16's is taken in float32 and
    does not), the exact look clears them."""
    large = torch.full((64, 9), big, dtype=dtype)
    large[::2] *= -1
    tensors = [torch.ones(5, dtype=dtype), large]
    overflows = dtype != torch.float16
    assert maybe_nonfinite(tensors).tolist() == [False, overflows]
    assert confirmed_nonfinite(tensors, [False, True]) == [False, False]
    large[3, 4] = float("nan")
    assert _flags(tensors) == [False, True]


def test_mixed_dtypes_keep_their_positions():
    tensors = [torch.ones(3), torch.ones(4, dtype=torch.float64), torch.ones(2),
               torch.ones(5, dtype=torch.bfloat16)]
    tensors[2][1] = float("inf")
    assert _flags(tensors) == [False, False, True, False]
    assert maybe_nonfinite([]) is None


@pytest.mark.parametrize("preconditioner", ["shampoo", "spectral_descent"])
def test_a_step_with_huge_finite_gradients_is_not_refused(preconditioner):
    """3e38 in every element of a float32 gradient: finite, so the step is taken (the fast
    test's overflow must not refuse it); one nan next to it is refused, naming it."""
    named = [("a", torch.nn.Parameter(torch.ones(6, 4))),
             ("b", torch.nn.Parameter(torch.ones(5, 3)))]
    opt = DistributedShampoo(named, lr=0.01, precondition_frequency=100,
                             preconditioner=preconditioner)
    named[0][1].grad = torch.randn(6, 4)
    named[1][1].grad = torch.full((5, 3), 3e38)
    opt.step()
    assert opt.param_groups[0]["step"] == 1
    named[0][1].grad[2, 3] = float("nan")
    with pytest.raises(ShampooNumericalError, match="'a'") as info:
        opt.step()
    assert "'b'" not in str(info.value)
    assert opt.param_groups[0]["step"] == 1
