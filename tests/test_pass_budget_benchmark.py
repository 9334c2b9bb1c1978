"""benchmarks/pass_budget.py at toy size: every kind prints its table, the non-finite check
reads every gradient once and writes nothing, the parameters are read and written by one
``add_``, and the gradients are stacked by one copy (the step never makes them views of its
stacks: they stay the user's). Counts, not timings, are asserted."""

from __future__ import annotations

import re
import sys

import pytest

from tests.helpers import run

pytestmark = pytest.mark.benchmarks


def test_toy_run_prints_the_budget_of_every_kind():
    out = run([sys.executable, "-m", "benchmarks.pass_budget", "--layers", "1", "--width", "16"])
    for kind in ("shampoo", "soap", "muon", "diagonal"):
        assert f"**{kind}**" in out, out
    rows = re.findall(r"^\| (\w[\w ]*) \| ([\w ]+) \| `(\w+)` \| (\d+) \| ([\d.]+) \| ([\d.]+) \|",
                      out, flags=re.M)
    check = [r for r in rows if r[0] == "check"]
    assert len(check) == 4 and all(float(r[4]) == 1.0 and float(r[5]) == 0.0
                                   for r in check), check
    applied = [r for r in rows if r[0] == "apply"]
    assert len(applied) == 4 and all(r[2] == "add_" and float(r[4]) == 2.0
                                     and float(r[5]) == 1.0 for r in applied), applied
    gathered = [r for r in rows if r[0] == "gather"]
    assert len(gathered) == 4 and all(float(r[4]) == 1.0 and float(r[5]) == 1.0
                                      for r in gathered), gathered
