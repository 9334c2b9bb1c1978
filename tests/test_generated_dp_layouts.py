"""Generated cases: parameters bit-identical to one process under DDP and under DeepSpeed
ZeRO 1/2's flat partitions (without DeepSpeed), for drawn layouts, kinds and settings.

The cases are drawn with seeded generators (``tests/layout_cases.py``): the fixed base seed
``HF_SHAMPOO_LAYOUT_SEED`` (default 0) and ``HF_SHAMPOO_LAYOUT_FRESH`` fresh seeds (default 1)
from the clock; ``HF_SHAMPOO_LAYOUT_CASES`` scales how many (and adds world 8 above 1,
``make fuzz``). A failure prints the seed, the case and the command that reruns it alone.

- **DDP** (``distributors/ddp.py``): a world of 2 or 4, ``num_trainers_per_group`` among
  -1, 1, 2 and the world, ``distributed="ddp"`` or ``"auto"``, a config of any kind of
  ``layout_cases.KINDS``, 2-6 parameters of drawn shapes (peft LoRA pairs for
  ``riemannian_lora``), steps without gradient, 4-7 steps, the same gradients on every rank.
  Checked: the parameters after the last step equal one process's on every rank; every
  trainers-group holds one process's state once (``local_state_dict``); and for some cases
  a checkpoint after step ``at`` (``save_sharded``, or ``consolidate_state_dict`` and rank
  0's ``state_dict()``) resumed on another layout (another ``num_trainers_per_group``, one
  process, or a larger world) ends where one process's uninterrupted run does.
- **ZeRO 1/2** (``distributors/zero.py``): what ``deepspeed.initialize`` does to the groups,
  with each group's flat buffer (parameters in a drawn order, with padding) cut at drawn
  boundaries: inside rows and parameters, on parameter boundaries, empty partitions, ranks
  with several parameters; ``step()`` shown one group at a time or all at once. Checked:
  parameters equal to one process's, the state held once.

The single-process check of ``flat_range_boxes`` that was here is in
tests/test_placement_boxes.py; ``test_refusals_met_while_drawing_are_documented`` stays: it
reports what this module's drawing met.

One ``mp.spawn`` per world size runs all its cases (tests/generated_dp_worker.py); only the
cases selected (``-k``) are run.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp

from tests import generated_dp_worker as worker
from tests import layout_cases as lc
from tests.helpers import one_thread_per_process

pytestmark = pytest.mark.distributed

torch.set_num_threads(1)

SEEDS = lc.seeds()
WORLDS = lc.dp_worlds()
DDP_CASES = lc.scaled(24)  # per seed
ZERO_CASES = lc.scaled(18)  # per seed
FILE = "tests/test_generated_dp_layouts.py"

def spawn_deadline(jobs: list, world: int) -> float:
    """Seconds one world's spawn may take for ``jobs`` (a hung case fails, not hangs):
    generous, a case takes about a second per rank on 2 cores."""
    return 300 + 10 * len(jobs) * max(1, world // 2)

#: documented refusals met while drawing (the case was drawn again): (kind, message)
REFUSALS: list[tuple[str, str]] = []


def refusal(case: dict) -> str | None:
    """The ``ValueError`` a case's optimizer raises at construction or layout in one
    process (a documented refusal of the drawn settings), None when it is accepted."""
    params = worker.make_params(case)
    try:
        worker.make_optimizer(case, params, distributed="none").describe_blocks()
    except ValueError as error:
        return str(error)
    return None


def draw_cases(name: str, draw, count: int) -> dict[str, tuple[int, dict]]:
    """``{id: (seed, case)}``: ``count`` cases of every seed, drawn again on a refusal."""
    out = {}
    for seed in SEEDS:
        rng = random.Random(f"{name}-{seed}")
        drawn = 0
        while drawn < count:
            case = draw(rng, WORLDS)
            why = refusal(case)
            if why is not None:
                REFUSALS.append((case["kind"], why.splitlines()[0][:200]))
                continue
            out[f"seed{seed}-case{drawn}"] = (seed, case)
            drawn += 1
    return out


DDP = draw_cases("ddp", lc.draw_ddp_case, DDP_CASES)
ZERO = draw_cases("zero", lc.draw_zero_case, ZERO_CASES)


def rerun_command(test: str, case_id: str, seed: int) -> str:
    cases = os.environ.get("HF_SHAMPOO_LAYOUT_CASES", "1")
    return (f"HF_SHAMPOO_LAYOUT_SEED={seed} HF_SHAMPOO_LAYOUT_FRESH=0 "
            f"HF_SHAMPOO_LAYOUT_CASES={cases} python -m pytest {FILE} "
            f"-k '{test}[{case_id}]'")


# ------------------------------------------------------------------ the spawns
def selected(session, test: str, cases: dict) -> list[str]:
    """The ids of ``test``'s cases that this session runs (all, or those ``-k`` keeps)."""
    prefix = f"{test}["
    ids = [item.name[len(prefix):-1] for item in session.items
           if item.module.__name__ == __name__ and item.name.startswith(prefix)]
    return [i for i in ids if i in cases]


def spawn(world: int, jobs: list, root: str) -> str | None:
    """One spawn of ``world`` ranks running ``jobs``; what went wrong with the spawn
    itself (a rank died, the deadline passed), None when every rank finished."""
    out_dir = os.path.join(root, f"w{world}")
    os.makedirs(out_dir, exist_ok=True)
    jobs_file = os.path.join(root, f"jobs{world}.pt")
    torch.save(jobs, jobs_file)
    context = mp.start_processes(worker.run_world, nprocs=world, join=False,
                                 args=(world, os.path.join(root, f"init{world}"), jobs_file,
                                       out_dir), start_method="spawn")
    limit = spawn_deadline(jobs, world)
    deadline = time.monotonic() + limit
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                return f"world {world}: killed after {limit:.0f} s"
    except Exception as error:  # a rank died outside a case (its own traceback)
        for process in context.processes:
            if process.is_alive():
                process.kill()
        return f"world {world}: {type(error).__name__}: {str(error)[-3000:]}"
    return None


@pytest.fixture(scope="module")
def runs(request):
    """``{job key: {rank: failures}}`` for every selected case, plus ``"_spawn"``: what
    went wrong with each world's spawn."""
    ddp = selected(request.session, "test_ddp_case", DDP)
    zero = selected(request.session, "test_zero_case", ZERO)
    index = {case_id: k for k, case_id in enumerate(sorted(set(ddp) | set(zero)))}
    jobs: dict[int, list] = {}
    for case_id in ddp:
        case = DDP[case_id][1]
        jobs.setdefault(case["world"], []).append(("ddp", case_id, index[case_id], case))
        checkpoint = case["checkpoint"]
        if checkpoint is not None and checkpoint["resume_world"] > case["world"]:
            jobs.setdefault(checkpoint["resume_world"], [])
    for case_id in zero:
        case = ZERO[case_id][1]
        jobs.setdefault(case["world"], []).append(("zero", case_id, index[case_id], case))
    # resumes of smaller worlds' checkpoints: first in the larger world's spawn (its own
    # cases after them)
    for case_id in ddp:
        case = DDP[case_id][1]
        checkpoint = case["checkpoint"]
        if checkpoint is not None and checkpoint["resume_world"] > case["world"]:
            jobs[checkpoint["resume_world"]].insert(0, ("resume", case_id, 0, case))
    root = tempfile.mkdtemp(prefix="hf_shampoo_dpgen_")
    out: dict = {"_spawn": {}}
    with one_thread_per_process():
        for world in sorted(jobs):
            out["_spawn"][world] = spawn(world, jobs[world], root)
            for rank in range(world):
                path = os.path.join(root, f"w{world}", f"rank{rank}.pt")
                if not os.path.exists(path):
                    continue
                results = torch.load(path, weights_only=False)
                for key, failures in results["cases"].items():
                    out.setdefault(key, {})[rank] = failures
                if results["running"] is not None:
                    out.setdefault(results["running"], {})[rank] = [
                        "did not finish (hung or died in this case)"]
    shutil.rmtree(root, ignore_errors=True)
    return out


def assert_case(runs, test: str, job: str, case_id: str, seed: int, case: dict) -> None:
    keys = [f"{job}:{case_id}"]
    checkpoint = case.get("checkpoint")
    if checkpoint is not None and checkpoint["resume_world"] > case["world"]:
        keys.append(f"resume:{case_id}")
    problems = []
    for key in keys:
        world = case["world"] if key.startswith(job) else checkpoint["resume_world"]
        per_rank = runs.get(key)
        if per_rank is None or len(per_rank) < world:
            problems.append(f"{key}: no result from ranks "
                            f"{sorted(set(range(world)) - set(per_rank or {}))} "
                            f"(spawn: {runs['_spawn'].get(world)})")
            continue
        for rank, failures in sorted(per_rank.items()):
            problems += [f"{key} rank {rank}: {f}" for f in failures]
    if problems:
        pytest.fail(f"seed {seed}, {case_id}:\n{lc.describe(case)}\n" + "\n".join(problems)
                    + f"\nrerun: {rerun_command(test, case_id, seed)}", pytrace=False)


@pytest.mark.parametrize("case_id", list(DDP))
def test_ddp_case(runs, case_id):
    """DDP: bit-identical to one process on every rank, the state held once per
    trainers-group, checkpoints resumed on another layout (see the module's docstring)."""
    seed, case = DDP[case_id]
    assert_case(runs, "test_ddp_case", "ddp", case_id, seed, case)


@pytest.mark.parametrize("case_id", list(ZERO))
def test_zero_case(runs, case_id):
    """DeepSpeed ZeRO 1/2's flat partitions cut at drawn boundaries: bit-identical to one
    process (zero gradients where a step has none, as DeepSpeed's partitions hold), the
    state held once."""
    seed, case = ZERO[case_id]
    assert_case(runs, "test_zero_case", "zero", case_id, seed, case)


def test_refusals_met_while_drawing_are_documented():
    """The draws avoid what the optimizer refuses (ZeRO: iterate averaging); a refusal met
    anyway was drawn again, and is listed here (``-rA`` shows it)."""
    for kind, message in REFUSALS:
        print(f"refused and drawn again: {kind}: {message}")
    assert all("DistributedShampoo" in message for _, message in REFUSALS), REFUSALS
