"""``benchmarks/step_time.py`` end to end at toy size: the tables it prints are complete and
made of measured, finite numbers, on the device the suite runs on (``--device``); a bad
``--device`` is refused before anything is built."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import TEST_DEVICE

pytestmark = [pytest.mark.benchmarks, pytest.mark.device]

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "benchmarks.step_time", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def _rows(text: str, first_cell: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in text.splitlines() if line.startswith(f"| {first_cell}")]


def test_toy_run_prints_every_table():
    done = _run("--model", "gpt2-tiny", "--device", str(TEST_DEVICE), "--threads", "1",
                "--rounds", "2", "--steady", "1", "--no-meta", "--staggered", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    (ours,) = _rows(out, "hf_shampoo |")
    steady, refresh, second = (float(x) for x in ours[1:4])
    assert 0 < steady and 0 < refresh and math.isfinite(second)  # (no order: load varies)
    assert _rows(out, "torch.optim.AdamW (fused)")
    floor = re.search(r"refresh floor .*?: ([\d.]+) \+ ([\d.]+) = ([\d.]+) s", out)
    assert floor and float(floor.group(1)) > 0
    schedules = {row[0]: row for row in _rows(out, "all") + _rows(out, "staggered")}
    assert set(schedules) == {"all", "staggered"}
    for row in schedules.values():
        median_step, slowest, ratio, mean = (float(x) for x in row[1:5])
        assert 0 < median_step <= slowest and 0 < mean <= slowest
        # The printed ratio (one decimal) is of the unrounded times, the times are printed
        # to four decimals: the ratio must lie in what the rounded times allow.
        half = 5e-5
        low = (slowest - half) / (median_step + half) - 0.05
        high = (slowest + half) / max(median_step - half, 1e-12) + 0.05
        assert low <= ratio <= high, (ratio, slowest, median_step)
    assert "steps 6-8 timed" in out


@pytest.mark.parametrize("device, message", [("tpu", "expected cpu, cuda or cuda:N")])
def test_bad_device_is_refused(device, message):
    done = _run("--device", device)
    assert done.returncode == 2
    assert f"--device {device!r}: {message}" in done.stderr
