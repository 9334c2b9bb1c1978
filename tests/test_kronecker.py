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


def _stack_sizes_agree(fn, rows: torch.Tensor, *others: torch.Tensor) -> bool:
    """``fn`` of a stack, row by row, equals ``fn`` of each smaller stack holding that row
    (1, 2 and 3 rows from several starts) to the dtype's round-off: no row reads another.
    Not bit for bit: a library may round a row by its batch (benchmarks/batch_invariance.py
    reports where), and the optimizer never relies on it (docs/design.md §4)."""
    whole = fn(rows, *others)
    tol = 1e-5 if rows.dtype == torch.float32 else 1e-12
    for size in (1, 2, 3):
        for start in range(0, rows.shape[0] - size + 1, 2):
            part = fn(rows[start:start + size], *(o[start:start + size] for o in others))
            scale = max(1.0, float(whole.abs().max())) if whole.numel() else 1.0
            if not torch.allclose(part, whole[start:start + size], rtol=tol, atol=tol * scale):
                return False
    return True


def _generated_shapes(seed: int, count: int):
    """Seeded block shapes: 1-D to 4-D, vectors up to 70 long (one-column products round
    by stack size from 31 on with bmm), size-1 dims."""
    import random

    rng = random.Random(seed)
    for _ in range(count):
        order = rng.choice([1, 1, 2, 3, 4])
        yield tuple(rng.choice([1, 2, 3, 7, 16, 31, 33, 70] if order == 1 else [1, 2, 3, 5, 8])
                    for _ in range(order))


@pytest.mark.parametrize("batch_variant", [False, True], ids=["library", "batch_variant"])
@pytest.mark.parametrize("seed", range(4))
def test_products_do_not_mix_the_blocks_of_their_stack(seed, batch_variant):
    """A block's factor update and preconditioning read only that block: its result in a
    stack equals its result in smaller stacks to round-off, with the library at hand and
    with products that round by batch (``tests/batch_variant.py``)."""
    from contextlib import nullcontext

    from tests.batch_variant import BatchVariantProducts
    from tests.helpers import TEST_DEVICE

    with BatchVariantProducts() if batch_variant else nullcontext():
        _check_products(seed, TEST_DEVICE)


def _check_products(seed: int, device) -> None:
    gen = torch.Generator().manual_seed(seed)
    for shape in _generated_shapes(seed, 8):
        for dtype in (torch.float32, torch.float64):
            g = torch.randn(7, *shape, generator=gen, dtype=dtype, device="cpu").to(device)
            for j, d in enumerate(shape):
                f = torch.randn(7, d, d, generator=gen, dtype=dtype, device="cpu").to(device)
                for beta in (0.0, 0.9, 1.0):
                    assert _stack_sizes_agree(
                        lambda g, f, j=j, beta=beta: kronecker.update_factor(
                            f.clone(), g, j, beta), g, f), (shape, j, beta, dtype)
                assert _stack_sizes_agree(lambda g, f, j=j: kronecker.mode_product(g, f, j),
                                          g, f), (shape, j, dtype)
            mats = [torch.randn(7, d, d, generator=gen, dtype=dtype, device="cpu").to(device)
                    for d in shape]
            for transpose in (False, True):
                assert _stack_sizes_agree(
                    lambda g, *m, t=transpose: kronecker.multi_mode_product(g, list(m), t),
                    g, *mats), (shape, transpose, dtype)
