"""benchmarks/refresh_delay.py at toy size: a row per setting (the "all" and staggered
schedules without a delay, "all" with d = f/2 and d = f), each with a median and a slowest
step. Timings are printed, never asserted."""

from __future__ import annotations

import re
import sys

import pytest

from tests.helpers import run

pytestmark = pytest.mark.benchmarks


def test_toy_run_prints_a_row_per_setting():
    out = run([sys.executable, "-m", "benchmarks.refresh_delay", "--steps", "4",
               "--width", "16", "--batch", "8", "--frequency", "4"])
    rows = [line for line in out.splitlines() if re.match(r"\| (all|staggered) \|", line)]
    assert [tuple(c.strip() for c in r.strip("|").split("|")[:2]) for r in rows] == [
        ("all", "0"), ("staggered", "0"), ("all", "2"), ("all", "4")], out
    for row in rows:
        median, slowest = (float(c) for c in row.strip("|").split("|")[2:4])
        assert 0 < median <= slowest
