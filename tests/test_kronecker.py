"""Tests for kronecker.py: factor statistics and mode products against einsum."""

import pytest
import torch

from hf_shampoo import kronecker

pytestmark = [pytest.mark.unit, pytest.mark.device]


@pytest.mark.parametrize("shape", [(5,), (4, 3), (3, 4, 2), (2, 3, 2, 2)])
def test_update_factor_matches_contraction(shape):
    g = torch.randn(3, *shape, dtype=torch.float64)
    letters = "abcdef"[: len(shape)]
    for j, d in enumerate(shape):
        f = torch.randn(3, d, d, dtype=torch.float64)
        other = letters[:j] + "x" + letters[j + 1 :]
        expected = 0.9 * f + 0.1 * torch.einsum(f"n{letters},n{other}->n{letters[j]}x", g, g)
        out = kronecker.update_factor(f.clone(), g, j, 0.9)
        torch.testing.assert_close(out, expected)
        out_of_place = kronecker.update_factor(f, g, j, 1.0, out_of_place=True)
        torch.testing.assert_close(
            out_of_place, f + torch.einsum(f"n{letters},n{other}->n{letters[j]}x", g, g)
        )


@pytest.mark.parametrize("shape", [(5,), (4, 3), (3, 4, 2)])
@pytest.mark.parametrize("transpose", [False, True])
def test_multi_mode_product_matches_einsum(shape, transpose):
    x = torch.randn(2, *shape, dtype=torch.float64)
    mats = [torch.randn(2, d, d, dtype=torch.float64) for d in shape]
    expected = x
    for j, m in enumerate(mats):
        m = m.mT if transpose else m
        expected = torch.movedim(torch.einsum("nil,n...l->n...i",
                                              m, torch.movedim(expected, j + 1, -1)), -1, j + 1)
    torch.testing.assert_close(kronecker.multi_mode_product(x, mats, transpose), expected)
    # None leaves a dim alone
    partial = kronecker.multi_mode_product(x, [None] + mats[1:], transpose)
    if len(shape) == 1:
        torch.testing.assert_close(partial, x)
