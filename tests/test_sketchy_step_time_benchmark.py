"""benchmarks/sketchy_step_time.py at toy size: a row for Shampoo and one per rank and
statistics frequency; the mean step over a refresh period is built from the measured steps
(``mean_step``). Timings are printed, never asserted."""

from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import pytest

from benchmarks.sketchy_step_time import mean_step
from tests.helpers import run

pytestmark = pytest.mark.benchmarks


def test_toy_run_prints_shampoo_and_each_sketch():
    out = run([sys.executable, "-m", "benchmarks.sketchy_step_time", "--ranks", "4",
               "--every", "1", "5", "--rounds", "1", "--steady", "1"])
    rows = [line for line in out.splitlines() if re.match(r"\| (Shampoo|Sketchy)", line)]
    assert [r.split("|")[1].strip() for r in rows] == [
        "Shampoo", "Sketchy, rank 4", "Sketchy, rank 4, statistics every 5"]
    assert rows[0].split("|")[-2].strip() == "1.00×"
    assert rows[2].split("|")[3].strip() != "–"  # steps without a sample were timed


def test_mean_step_weights_each_kind_of_step_over_a_period():
    runner = SimpleNamespace(frequency=10, every=5, steady=[2.0], skipped=[1.0],
                             refresh=[7.0])
    assert mean_step(runner) == pytest.approx((7.0 + 1 * 2.0 + 8 * 1.0) / 10)
    runner = SimpleNamespace(frequency=10, every=1, steady=[2.0], skipped=[], refresh=[7.0])
    assert mean_step(runner) == pytest.approx((7.0 + 9 * 2.0) / 10)
