"""Pipeline parallel (docs/parallelism.md#pipeline-parallel): one optimizer per stage over
the stage's own data-parallel group, under ``torch.distributed.pipelining`` on gloo.

A Llama-like model split into 2 stages (``tests/pipeline_worker.py``):

- 4 ranks, 2 stages × DDP 2 (``ScheduleGPipe``, ``process_group=`` the stage's dp group),
  and 2 stages × FSDP2 2 (``Schedule1F1B``; the DTensors' meshes give the group), and an
  interleaved schedule with two stages per rank under one optimizer: Shampoo, SOAP and the
  Muon recipe, parameters bit-identical to one process training the whole model on the
  same micro-batches; DCP checkpoints per model part (``get_optimizer_state_dict`` /
  ``set_optimizer_state_dict``, as torchtitan's) resume bit-identically, also on 2 stages ×
  1, and ``consolidate_checkpoint`` merges the stages into one process's optimizer, which
  goes on as the pipeline did; DDP stages resume bit-identically when their steps run
  inside ``no_sync()`` (interleaved 1F1B) or after a warm-up step, else within rounding
  (a fresh DDP module's first iteration reduces otherwise);
- 8 ranks, 2 stages × (dp_shard 2 × tp 2) from one ``("pp", "dp_shard", "tp")`` mesh:
  after every step each stage's parameters are bit-identical to one process stepping the
  stage's optimizer on the stage's full gradients (tensor parallel's forward rounds
  otherwise than one process, so the whole-model comparison is not defined there), and a
  DCP resume is bit-identical.

Every layout: each rank's group is its stage's ranks, each block is owned once in its
stage, and a rank holds about 1/(group size) of its stage's state.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from hf_shampoo.checkpoint import consolidate_checkpoint
from tests import pipeline_worker as worker
from tests.helpers import one_thread_per_process

pytestmark = pytest.mark.distributed

STEPS, SAVE_AT = 4, 2


def saved_and_resumed(name: str, layout: str, kind: str, directory: str,
                      **extra) -> list[dict]:
    """A run that saves a DCP checkpoint into ``directory`` after ``SAVE_AT`` steps, and a
    fresh run (``{name}_resumed``) that resumes from it to the last step; ``extra``: the
    worker's keywords for both (``no_sync``)."""
    run = dict(layout=layout, kind=kind, steps=STEPS, save_at=SAVE_AT, **extra)
    return [dict(name=name, checkpoint=directory, **run),
            dict(name=f"{name}_resumed", resume_from=directory, **run)]


WORLD4 = [
    *saved_and_resumed("ddp_shampoo", "ddp_gpipe", "shampoo", "ddp"),
    dict(name="ddp_shampoo_warm", layout="ddp_gpipe", kind="shampoo", steps=STEPS,
         save_at=SAVE_AT, resume_from="ddp", warm_up=True),
    *saved_and_resumed("ddp_quiet_shampoo", "ddp_interleaved", "shampoo", "ddp_quiet",
                       no_sync=True),
    dict(name="ddp_muon", layout="ddp_gpipe", kind="muon", steps=3),
    dict(name="ddp_soap", layout="ddp_gpipe", kind="soap", steps=3),
    dict(name="fsdp_shampoo", layout="fsdp_1f1b", kind="shampoo", steps=3),
    *saved_and_resumed("fsdp_soap", "fsdp_1f1b", "soap", "fsdp"),
    dict(name="fsdp_muon", layout="fsdp_1f1b", kind="muon", steps=3),
    dict(name="interleaved_shampoo", layout="fsdp_interleaved", kind="shampoo", steps=3),
]
WORLD2 = [  # the 4-rank checkpoints resumed on 2 stages × 1
    dict(name="fsdp_soap_dp1", layout="fsdp_1f1b_dp1", kind="soap", steps=STEPS,
         save_at=SAVE_AT, resume_from="fsdp"),
    dict(name="ddp_shampoo_dp1", layout="ddp_gpipe_dp1", kind="shampoo", steps=STEPS,
         save_at=SAVE_AT, resume_from="ddp"),
]
WORLD8 = [
    *saved_and_resumed("tp_shampoo", "fsdp_tp_1f1b", "shampoo", "tp"),
    dict(name="tp_muon", layout="fsdp_tp_1f1b", kind="muon", steps=3),
    dict(name="tp_soap", layout="fsdp_tp_1f1b", kind="soap", steps=3),
]

def spawn(world: int, cases: list[dict], root: str, checkpoints: str) -> list[dict]:
    cases = [{**c, **{k: os.path.join(checkpoints, c[k]) for k in ("checkpoint", "resume_from")
                      if c.get(k)}} for c in cases]
    os.makedirs(root, exist_ok=True)
    mp.spawn(worker.run_world, args=(world, os.path.join(root, "init"), root, cases),
             nprocs=world)
    return [json.load(open(os.path.join(root, f"rank{r}.json"))) for r in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    checkpoints = str(root / "checkpoints")
    out = {"checkpoints": checkpoints}
    with one_thread_per_process():
        out[4] = spawn(4, WORLD4, str(root / "w4"), checkpoints)
        out[2] = spawn(2, WORLD2, str(root / "w2"), checkpoints)
    return out


@pytest.fixture(scope="module")
def runs8(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline8")
    with one_thread_per_process():
        return spawn(8, WORLD8, str(root / "w8"), str(root / "checkpoints"))


def case_results(results: list[dict], name: str) -> list[dict]:
    got = [r.get(name) for r in results]
    errors = [g["error"] for g in got if g is not None and "error" in g]
    assert not errors, errors[0]
    assert all(g is not None for g in got), f"{name} did not run on every rank"
    return got


def merged_params(got: list[dict]) -> dict[str, list[float]]:
    """Every stage's parameters by name; the ranks of a stage must agree on them."""
    merged: dict[str, list[float]] = {}
    for g in got:
        for name, values in g["params"].items():
            assert merged.setdefault(name, values) == values, f"ranks differ on {name}"
    return merged


def assert_equal_to(got: dict[str, list[float]], expected: dict[str, list[float]]) -> None:
    assert sorted(got) == sorted(expected)
    differing = [n for n in expected if got[n] != expected[n]]
    if differing:
        first = differing[0]
        worst = max(abs(a - b) for a, b in zip(got[first], expected[first]))
        raise AssertionError(f"{len(differing)} of {len(expected)} parameters differ from one "
                             f"process, e.g. {first} by {worst}")


def assert_stage_groups(got: list[dict], world: int, stage_size: int) -> None:
    """Each rank's optimizer spreads its blocks over its stage's ranks only; every block
    of a stage is owned once there, and no rank holds much more than its share; each
    stage's ranks report the same ``metrics()``, its state the stage's own."""
    for rank, g in enumerate(got):
        stage = rank // stage_size
        assert g["groups"] == [list(range(stage * stage_size, (stage + 1) * stage_size))] * len(
            g["groups"]), (rank, g["groups"])
    for stage in range(world // stage_size):
        ranks = got[stage * stage_size:(stage + 1) * stage_size]
        totals = {g["owned"][1] for g in ranks}
        assert len(totals) == 1, totals
        total = totals.pop()
        assert sum(g["owned"][0] for g in ranks) == total  # each block owned once
        assert max(g["owned"][0] for g in ranks) <= 1.25 * total / stage_size
        metrics = [json.dumps(g["metrics"], sort_keys=True) for g in ranks]
        assert len(set(metrics)) == 1, metrics
        assert sum(m["optimizer/state_bytes"] for m in ranks[0]["metrics"]) == total


# ---------------------------------------------------------------- 4 ranks: DDP and FSDP2
# DDP under torch's pipeline schedules all-reduces after every micro-batch's backward in a
# DDP module's first iteration (the stage's shape inference, on the first step(), runs the
# module's forward outside no_sync(), which prepares its reducer), once after the last one
# later: the one-process reference averages as it does. A step run inside the DDP modules'
# no_sync() ("ddp_quiet_*", worker.train_step) reduces once from the first iteration on:
# the stage prepares the reducer itself for each module's last backward
def ddp_first(first: int):
    return lambda step: step == first


@pytest.mark.parametrize("name, kind, reduce_each", [
    ("ddp_shampoo", "shampoo", ddp_first(1)),
    ("ddp_muon", "muon", ddp_first(1)),
    ("ddp_soap", "soap", ddp_first(1)),
    ("ddp_quiet_shampoo", "shampoo", False),
    ("fsdp_shampoo", "shampoo", False),
    ("fsdp_soap", "soap", False),
    ("fsdp_muon", "muon", False),
    ("interleaved_shampoo", "shampoo", False),
])
def test_stages_train_as_one_process(runs, name, kind, reduce_each):
    got = case_results(runs[4], name)
    steps = len(got[0]["replay"])
    expected = worker.one_process(kind, steps, lambda step: 2, reduce_each)
    assert_equal_to(merged_params(got), expected)
    assert all(all(g["replay"]) for g in got)
    assert_stage_groups(got, 4, 2)
    kinds = {g["distributors"][0] for g in got}
    assert kinds == {"DataParallelDistributor" if name.startswith("ddp") else
                     "ShardedDistributor"}, kinds


@pytest.mark.parametrize("name", ["ddp_quiet_shampoo", "fsdp_soap"])
def test_a_dcp_checkpoint_per_stage_resumes_exactly(runs, name):
    """FSDP2 stages, and DDP stages whose schedule steps run inside their ``no_sync()``
    (interleaved 1F1B, two DDP parts per rank): the resumed run is the uninterrupted one,
    bit for bit."""
    uninterrupted = merged_params(case_results(runs[4], name))
    resumed = merged_params(case_results(runs[4], f"{name}_resumed"))
    assert resumed == uninterrupted


def test_ddp_stages_resume_exactly_after_a_warm_up_step(runs):
    """Plain DDP stages (GPipe): one schedule step on the fresh modules before loading,
    its gradients dropped and no optimizer step, spends the DDP modules' first iteration;
    the resumed run is then the uninterrupted one, bit for bit."""
    assert merged_params(case_results(runs[4], "ddp_shampoo_warm")) == merged_params(
        case_results(runs[4], "ddp_shampoo"))


def test_fresh_ddp_stages_resume_within_rounding_only(runs):
    """Plain DDP stages resumed without either: the fresh modules' first iteration (step 3)
    all-reduces after each micro-batch, as step 1 did, where the uninterrupted run
    reduced once. The stages' ranks agree, the run is one process reducing so at steps 1
    and 3 bit for bit, and it is not the uninterrupted run: a rounding-level difference of
    the gradients, amplified by the preconditioner (docs/parallelism.md#pipeline-parallel)."""
    uninterrupted = merged_params(case_results(runs[4], "ddp_shampoo"))
    resumed = merged_params(case_results(runs[4], "ddp_shampoo_resumed"))  # ranks agree
    expected = worker.one_process("shampoo", STEPS, lambda step: 2,
                                  lambda step: step in (1, SAVE_AT + 1))
    assert_equal_to(resumed, expected)
    worst = max(abs(a - b) for n in resumed for a, b in zip(resumed[n], uninterrupted[n]))
    assert 0 < worst < 1e-3, worst


@pytest.mark.parametrize("name, kind, reduce_each", [
    ("fsdp_soap_dp1", "soap", False),
    ("ddp_shampoo_dp1", "shampoo", ddp_first(1)),
])
def test_a_checkpoint_of_two_by_two_resumes_on_two_stages_of_one(runs, name, kind,
                                                                 reduce_each):
    """Saved by 2 stages × 2 after step 2, resumed by 2 stages × 1: one replica's
    micro-batches from step 3 on."""
    got = case_results(runs[2], name)
    expected = worker.one_process(kind, STEPS, lambda step: 2 if step <= SAVE_AT else 1,
                                  reduce_each)
    assert_equal_to(merged_params(got), expected)
    # one rank per stage: DDP's group of one steps alone, FSDP2's one-rank mesh likewise
    assert {g["distributors"][0] for g in got} == {
        "ShardedDistributor" if name.startswith("fsdp") else "SingleProcessDistributor"}


def test_consolidate_checkpoint_merges_the_stages_into_one_process(runs, tmp_path):
    """The 2 stages × FSDP2 2 checkpoint (every rank wrote its blocks of its stage) in one
    file; one process loads it into one optimizer over the whole model and trains on as
    the pipeline did."""
    merged = str(tmp_path / "merged.pt")
    consolidate_checkpoint(os.path.join(runs["checkpoints"], "fsdp"), merged)
    state = torch.load(merged, weights_only=False)
    names = {n for n, _ in worker.whole_model().named_parameters()}
    assert {k.split(".", 1)[1].rsplit(".block_", 1)[0] for k in state["optim0"]
            if k.startswith("state.")} == names
    expected = merged_params(case_results(runs[4], "fsdp_soap"))
    got = worker.one_process("soap", STEPS, lambda step: 2, first_step=SAVE_AT + 1,
                             start=worker.load_consolidated("soap", merged))
    assert_equal_to(got, expected)


# ---------------------------------------------------------------- 8 ranks: FSDP2 × TP
@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp_shampoo", "tp_muon", "tp_soap"])
def test_stages_over_dp_shard_and_tp_match_one_process_on_their_gradients(runs8, name):
    got = case_results(runs8, name)
    assert all(all(g["replay"]) and g["replay"] for g in got)
    assert_stage_groups(got, 8, 4)
    assert {g["distributors"][0] for g in got} == {"ShardedDistributor"}


@pytest.mark.slow
def test_a_dcp_checkpoint_of_tp_stages_resumes_exactly(runs8):
    assert merged_params(case_results(runs8, "tp_shampoo_resumed")) == merged_params(
        case_results(runs8, "tp_shampoo"))
