"""``benchmarks/batch_invariance.py`` reports, per operation, whether a block gets the same
bits in a stack of 8 as alone: what the library at hand does, which differs between CPUs
(an Intel Xeon said yes everywhere at one thread, an AMD EPYC did not for the row-form
matvec at 130) and between thread counts and devices. Nothing rests on it
(docs/design.md §4: stacks are cut by a rule of the blocks alone), so the test asserts
the report, not the library: a row for every operation, size and dtype, and a **no**
wherever the products round by batch (``tests/batch_variant.py``)."""

from __future__ import annotations

import pytest

from benchmarks import batch_invariance
from tests.batch_variant import BatchVariantProducts
from tests.helpers import torch_threads

pytestmark = pytest.mark.benchmarks

PRODUCTS = ("factor update (syrk)", "preconditioning (bmm)", "matvec (row form)")


def test_a_row_per_operation_size_and_dtype(capsys):
    with torch_threads(1):
        rows = batch_invariance.rows("cpu", ["float32", "float64"], sizes=(16, 40, 130))
        batch_invariance.main(["--device", "cpu", "--dtypes", "float64", "--sizes", "16"])
    assert len(rows) == 2 * 3 * 6
    assert {r[0] for r in rows} == {*PRODUCTS, "eigh", "qr basis (householder)", "cholesky"}
    table = capsys.readouterr().out
    assert "thread(s)" in table and table.count("\n| ") == 1 + 6


def test_products_that_round_by_batch_are_reported():
    with torch_threads(1), BatchVariantProducts():
        rows = batch_invariance.rows("cpu", ["float32"], sizes=(16, 40))
    reported = {(r[0], r[1]): r[3] for r in rows}
    for name in PRODUCTS:
        assert not any(equal for (op, _), equal in reported.items() if op == name), name
