"""The suite's ``unit`` rule (tests/conftest.py): a test whose only layer is ``unit`` cannot
spawn ranks, start a process group or launch torchrun, and may still run a plain subprocess;
a test of a ``unit`` module marked ``distributed`` is not held to it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.unit


def _never_run(rank: int) -> None:  # pragma: no cover - the guard refuses before a spawn
    raise AssertionError("spawned")


def test_a_unit_test_cannot_spawn_ranks_or_start_a_process_group():
    with pytest.raises(RuntimeError, match="a unit test started processes .*mark it distributed"):
        mp.spawn(_never_run, nprocs=2)
    with pytest.raises(RuntimeError, match="a unit test started processes"):
        mp.start_processes(_never_run, nprocs=2)
    with pytest.raises(RuntimeError, match="a unit test started a process group"):
        dist.init_process_group("gloo", init_method="file:///nonexistent", rank=0, world_size=1)


def test_a_unit_test_cannot_launch_torchrun_but_may_run_a_plain_subprocess():
    with pytest.raises(RuntimeError, match="a unit test started a distributed launch"):
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "-c", "pass"], check=False)
    with pytest.raises(RuntimeError, match="a distributed launch"):
        subprocess.run(["torchrun", "--standalone", "x.py"], check=False)
    done = subprocess.run([sys.executable, "-c", "print('one process')"], capture_output=True,
                          text=True, check=True)
    assert done.stdout == "one process\n"


@pytest.mark.distributed
def test_a_test_marked_distributed_is_not_held_to_the_rule():
    assert mp.spawn.__module__ == "torch.multiprocessing.spawn"
    assert subprocess.Popen.__module__ == "subprocess"
