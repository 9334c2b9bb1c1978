"""docs/design.md §1: merging small dims and splitting into blocks (hf_shampoo.blocking)."""

import pytest

from hf_shampoo.blocking import block_shapes, merged_shape
from tests.reference_shampoo import reference_block_slices, reference_merged_shape

pytestmark = [pytest.mark.unit, pytest.mark.device]


@pytest.mark.parametrize(
    ("shape", "max_dim", "expected"),
    [
        ((10, 3, 3, 3), 128, (10, 27)),  # docs/design.md §1 example
        ((6, 4), 1024, (24,)),  # docs/design.md §1: full-matrix AdaGrad on the flat vector
        ((), 1024, (1,)),  # 0-d tensor
        ((1,), 8, (1,)),
        ((1, 1), 8, (1,)),
        ((1, 5, 1, 3), 1024, (15,)),  # size-1 dims dropped before merging
        ((1, 5, 1, 3), 4, (5, 3)),
        ((2, 3, 4), 12, (2, 12)),  # last-to-first: a first-to-last walk would give (6, 4)
        ((4, 5, 6), 30, (4, 30)),  # first-to-last would give (20, 6)
        ((2, 2, 2, 2), 4, (4, 4)),
        ((32, 32), 1024, (1024,)),  # product equal to the limit still merges
        ((33, 32), 1024, (33, 32)),
        ((300, 200), 128, (300, 200)),
        ((2000,), 1024, (2000,)),
        ((3, 2000), 1024, (3, 2000)),
    ],
)
def test_merged_shape(shape, max_dim, expected):
    assert tuple(merged_shape(shape, max_dim)) == expected
    # the test-suite's own reference blocking agrees (it is used by the equality tests)
    assert reference_merged_shape(shape, max_dim) == expected


def test_block_shapes_spec_example():
    assert [tuple(s) for s in block_shapes((300, 200), 128)] == [
        (128, 128),
        (128, 72),
        (128, 128),
        (128, 72),
        (44, 128),
        (44, 72),
    ]


@pytest.mark.parametrize(
    ("shape", "max_dim", "expected"),
    [
        ((), 1024, [(1,)]),
        ((10, 3, 3, 3), 128, [(10, 27)]),
        ((7,), 3, [(3,), (3,), (1,)]),
        ((2000,), 1024, [(1024,), (976,)]),
        ((3, 1, 4), 2, [(2, 2), (2, 2), (1, 2), (1, 2)]),
        ((7, 5), 3, [(3, 3), (3, 2), (3, 3), (3, 2), (1, 3), (1, 2)]),
        ((2, 3, 4), 3, [(2, 3, 3), (2, 3, 1)]),
        ((4, 4), 4, [(4, 4)]),
    ],
)
def test_block_shapes(shape, max_dim, expected):
    assert [tuple(s) for s in block_shapes(shape, max_dim)] == expected


@pytest.mark.parametrize(
    ("shape", "max_dim"),
    [((5, 1, 7, 2), 6), ((9, 9), 4), ((3, 3, 3), 9), ((1, 1, 1), 1), ((11,), 11), ((6, 10), 7)],
)
def test_block_shapes_match_reference_and_cover_param(shape, max_dim):
    got = [tuple(s) for s in block_shapes(shape, max_dim)]
    import torch

    merged = torch.zeros(reference_merged_shape(shape, max_dim))
    expected = [tuple(merged[idx].shape) for idx in reference_block_slices(shape, max_dim)]
    assert got == expected
    numel = 1
    for d in shape:
        numel *= d
    assert sum(torch.Size(s).numel() for s in got) == numel
    assert all(max(s) <= max_dim for s in got if len(s))
