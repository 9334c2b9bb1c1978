"""``benchmarks/batch_invariance.py`` on the CPU at one thread (torchrun's default per
process, and how the distributed tests run): every operation gives a block the same bits in
a stack of 8 as alone, which is what makes distributed runs bit-identical to one process.
With two threads the batched products of some sizes do not (docs/design.md §13), and on
CUDA float32 products do not (docs/gpu.md#bit-identity)."""

from __future__ import annotations

import pytest

from benchmarks import batch_invariance
from tests.helpers import torch_threads

pytestmark = pytest.mark.benchmarks


def test_every_operation_is_batch_invariant_on_the_cpu(capsys):
    with torch_threads(1):
        rows = batch_invariance.rows("cpu", ["float32", "float64"], sizes=(16, 40, 130))
        batch_invariance.main(["--device", "cpu", "--dtypes", "float64", "--sizes", "16"])
    assert len(rows) == 2 * 3 * 6
    assert [r for r in rows if not r[3]] == []
    table = capsys.readouterr().out
    assert table.count("| yes |") == 6 and "**no**" not in table
