"""Faults injected, survived and lost: the reliability table of docs/benchmarks/reliability.md.

Runs the jobs of tests/test_faults.py (``tests/fault_worker.py`` under ``torchrun
--max-restarts``, gloo, one thread per rank) and prints one row per job: the kills it took
(between steps, inside ``optimizer.step()``, while a checkpoint was written), how many it
survived (the job finished), what of the trained state was lost (parameters and optimizer
state against a job never interrupted, bit for bit) and how many finished steps had to be
redone (those after the checkpoint it resumed from). Wall times include the restarts.

    python -m benchmarks.fault_table                  # Trainer and Accelerate, DDP and FSDP2
    python -m benchmarks.fault_table --tools trainer --layouts ddp
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from datetime import date
from pathlib import Path

from tests.fault_worker import attempts, differences, launch

CHAOS = "between@3@1,in_step@5@1,in_save@6@0"


def steps_redone(faults: str, resumed: list[str]) -> int:
    """Finished steps lost to each kill: those after the checkpoint the next attempt took."""
    total = 0
    for fault, checkpoint in zip(faults.split(","), resumed[1:]):
        kind, step, _ = fault.split("@")
        saved = 0 if checkpoint == "-" else int(checkpoint.replace("_", "-").split("-")[1])
        total += int(step) - saved - (1 if kind == "in_step" else 0)
    return total


def run_job(tool: str, layout: str, faults: str, out: Path, **env: str) -> tuple[float, bool]:
    start = time.perf_counter()
    done = launch(tool, layout, faults, out, restarts=len(faults.split(",")), **env)
    return time.perf_counter() - start, done.returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tools", nargs="+", default=["trainer", "accelerate"],
                        choices=["trainer", "accelerate"])
    parser.add_argument("--layouts", nargs="+", default=["ddp", "fsdp2"],
                        choices=["ddp", "fsdp2"])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tool in args.tools:
            for layout in args.layouts:
                clean, chaos = Path(tmp) / f"{tool}_{layout}_clean", Path(tmp) / f"{tool}_{layout}"
                clean_time, _ = run_job(tool, layout, "none", clean)
                chaos_time, survived = run_job(tool, layout, CHAOS, chaos)
                resumed = [row[2] for row in attempts(chaos)]
                lost = differences(chaos / "result_w2.pt", clean / "result_w2.pt") \
                    if survived else ["the job did not finish"]
                rows.append((tool, layout, "2", "3", str(len(resumed) - 1) if survived else "0",
                             "nothing (bit-identical)" if not lost else f"{len(lost)} tensors",
                             str(steps_redone(CHAOS, resumed)),
                             f"{chaos_time:.0f} s vs {clean_time:.0f} s"))
    print(f"Faults injected, survived, lost ({platform.processor() or platform.machine()}, "
          f"{date.today()}; 8 steps, a checkpoint every 2; kills: {CHAOS})\n")
    print("| tool | layout | ranks | kills | survived | trained state lost | steps redone "
          "| wall time (with restarts) vs uninterrupted |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
