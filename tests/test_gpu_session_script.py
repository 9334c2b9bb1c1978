"""``benchmarks/gpu_session.sh``, the GPU session's driver: valid shell, its parts refuse a
wrong name, and a part runs on a CPU (``DEVICE=cpu``) writing its log under ``$OUT``. (Its
``SMOKE=1`` run of every part, about 80 s, is the manual check before a GPU session.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.benchmarks

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"


def _run(*args, out):
    env = {**os.environ, "OUT": str(out), "DEVICE": "cpu", "SMOKE": "1",
           "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_is_valid_shell():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_a_wrong_part_is_refused(tmp_path):
    done = _run("stpe", out=tmp_path)
    assert done.returncode == 2
    assert "usage:" in done.stderr and "e2e-resnet50" in done.stderr


def test_check_part_writes_its_log(tmp_path):
    done = _run("check", out=tmp_path)
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "check.log").read_text()
    assert f"torch {__import__('torch').__version__}" in log
    assert "== check exit 0" in done.stdout


def test_tp_part_records_how_far_accelerate_gets(tmp_path):
    """The ND-parallel part runs Accelerate's ParallelismConfig stage by stage; on a CPU it
    records Accelerate's refusal of a CPU mesh (docs/parallelism.md) and goes on."""
    env = {**os.environ, "OUT": str(tmp_path), "DEVICE": "cpu", "SMOKE": "1",
           "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(SCRIPT), "tp"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "tp.log").read_text()
    assert "ParallelismConfig(dp_shard_size=1, tp_size=2)" in log
    assert "got DistributedType.MULTI_CPU" in log and log.count("== tp") >= 2


def test_the_lent_call_fits_nine_minutes():
    """``lent`` is one device call: the limits of its parts add up to at most 540 s."""
    import re

    text = SCRIPT.read_text()
    body = text[text.index("lent() {"):text.index("\n}\n", text.index("lent() {"))]
    limits = [int(s) for s in re.findall(r"\bpart \S+ (\d+) ", body)]
    limits += [int(s) for s in re.findall(r"timeout -s INT (\d+) ", body)]
    limits += [int(s) for s in re.findall(r"^\s*check (\d+)$", body, re.M)]
    assert len(limits) >= 5, limits  # check, tests, muon, step, e2e
    # the step line runs once per model of the (non-smoke) models array
    step = [int(s) for s in re.findall(r'part "step_\$model" (\d+) ', body)]
    assert len(step) == 1, step
    models = re.search(r"^\s*local models=\(([^)]*)\)", body, re.M).group(1).split()
    assert sum(limits) + step[0] * (len(models) - 1) <= 540, (limits, models)
