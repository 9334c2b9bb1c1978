"""Parity with Meta's ``distributed_shampoo`` (opt-in): every case of
``benchmarks/parity.py`` within 1e-6 of the parameter movement, in float64 (float16
inverse roots: 1e-5).

Runs when ``HF_SHAMPOO_META_PATH`` points at a checkout of facebookresearch/optimizers
(Meta's code is imported from there, never vendored); skipped otherwise.
"""

from __future__ import annotations

import os

import pytest

META = os.environ.get("HF_SHAMPOO_META_PATH")
pytestmark = [pytest.mark.reference, pytest.mark.device,
              pytest.mark.skipif(not META, reason="set HF_SHAMPOO_META_PATH to a checkout of "
                                 "facebookresearch/optimizers to compare with Meta's numbers")]


def _cases():
    if not META:
        return []
    from benchmarks import parity

    return parity.cases(parity.load_meta(META))


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.name)
def test_within_1e6_of_meta(case):
    from benchmarks import parity

    assert parity.run_case(case, steps=27) <= (case.tolerance or 1e-6)
