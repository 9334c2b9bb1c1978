"""benchmarks/muon_step_time.py at toy size: one process and two gloo ranks print a row
each, and in every row ours and torch.optim.Muon computed the same parameters (bfloat16
rounding). Timings are printed, never asserted."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from tests.helpers import run

pytestmark = [pytest.mark.benchmarks,
              pytest.mark.skipif(not hasattr(torch.optim, "Muon"),
                                 reason="torch.optim.Muon needs torch 2.9+")]


def test_toy_run_prints_a_row_per_world_with_the_same_numbers():
    out = run([sys.executable, "-m", "benchmarks.muon_step_time", "--worlds", "1", "2",
               "--rounds", "2", "--warmup", "0", "--layers", "1", "--width", "32"])
    rows = [line for line in out.splitlines() if re.match(r"\| [12] \|", line)]
    assert len(rows) == 2, out
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == "4"  # the hidden matrices of one layer
        assert float(cells[-1]) < 1e-2  # same numbers as torch.optim.Muon
    assert rows[1].split("|")[3].strip() in ("2/2", "3/1", "1/3")  # matrices split
