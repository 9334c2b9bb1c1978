"""DeepSpeed ZeRO 0-3 on 2 gloo ranks (``DS_ACCELERATOR=cpu``): engine-level equality with
DDP, bf16, checkpoints, the Trainer's ``deepspeed=`` path and the ZeRO 3 refusal
(docs/benchmarks/deepspeed.md). Each group starts its own torchrun
(tests/deepspeed_worker.py, tests/trainer_deepspeed_worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integrations

pytest.importorskip(
    "deepspeed", reason="DeepSpeed is not installed (pip install 'deepspeed>=0.19,<0.20')")

from tests import deepspeed_worker as worker  # noqa: E402
from tests.helpers import assert_bitwise, torchrun  # noqa: E402


def launch(script: str, args: list[str], nproc: int = 2) -> None:
    """``script`` on ``nproc`` ranks with DeepSpeed's CPU accelerator (``torchrun``)."""
    torchrun(script, args, nproc, DS_ACCELERATOR="cpu")


def scenario(name: str, out_dir: Path, nproc: int = 2) -> list[dict]:
    launch("deepspeed_worker.py", [name, str(out_dir)], nproc)
    results = [torch.load(out_dir / f"{name}_rank{r}.pt", weights_only=False)
               for r in range(nproc)]
    for result in results:
        assert "error" not in result, result["error"]
    return results




# ------------------------------------------------------------------------ engine level
@pytest.fixture(scope="module")
def fp32_runs(tmp_path_factory):
    return scenario("fp32", tmp_path_factory.mktemp("ds_fp32"))


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("preset", ["transformer", "muon"])
def test_zero_fp32_is_bit_identical_to_ddp(fp32_runs, stage, preset):
    """``deepspeed.initialize`` with make_optimizer's preset, 6 steps: every parameter equal
    to our optimizer under distributed="ddp" on all-reduced gradients, and to one process
    stepping the averaged gradients; the optimizer stepped every group 6 times."""
    for rank_result in fp32_runs:
        run = rank_result[f"z{stage}_{preset}"]
        assert run["distributor"] == "ZeroDistributor"
        assert all(run["equal_ddp"]), run["equal_ddp"]
        assert all(run["equal_one"]), run["equal_one"]
        assert run["step"] == worker.STEPS


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("preset", ["transformer", "muon"])
def test_zero_state_is_held_once(fp32_runs, stage, preset):
    """The ranks' state together is one process's: every block's tensors on exactly one
    rank, of the same sizes."""
    states = [r[f"z{stage}_{preset}"]["state"] for r in fp32_runs]
    keys = [set(s) for s in states]
    assert not keys[0] & keys[1]
    assert all(keys), "a rank holds no state (blocks not spread)"
    merged = {k: v for s in states for k, v in s.items()}
    assert merged == fp32_runs[0][f"z{stage}_{preset}"]["state_one"]


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory):
    return scenario("bf16", tmp_path_factory.mktemp("ds_bf16"))


@pytest.mark.parametrize("name", ["z1", "z2", "z1_gacc32"])
def test_zero_bf16_equals_zero0_bf16(bf16_runs, name):
    """bf16 ZeRO 1, 2 and ZeRO 1 with fp32 gradient accumulation (BF16_Optimizer) end with
    the bf16 model parameters of ZeRO 0 bf16 (FP16_UnfusedOptimizer), bit for bit."""
    for rank_result in bf16_runs:
        assert rank_result[name]["distributor"] == "ZeroDistributor"
        assert rank_result[name]["losses"] == rank_result["z0"]["losses"]
        assert_bitwise(rank_result[name]["params"], rank_result["z0"]["params"])


def test_zero0_bf16_skips_the_construction_step(bf16_runs):
    """DeepSpeed's bf16 ZeRO 0 wrapper steps the optimizer once with zero gradients while
    it is built: not counted, the group's step is the number of engine steps."""
    for rank_result in bf16_runs:
        assert rank_result["z0"]["wrapper"] == "FP16_UnfusedOptimizer"
        assert rank_result["z0"]["step"] == worker.STEPS
        assert rank_result["z0"]["distributor"] == "DataParallelDistributor"


def test_fp16_zero0_is_refused_before_anything_changes(tmp_path):
    """fp16 under ZeRO 0: DeepSpeed's ``engine.backward`` does not scale the loss there
    but its ``FP16_UnfusedOptimizer`` divides the gradients by the loss scale (DeepSpeed
    PR 8393): refused inside ``deepspeed.initialize`` on both ranks, at the wrapper's
    construction step, with the configuration named and the ways out; the model and the
    optimizer are untouched. A real engine: DeepSpeed refuses fp16 on a CPU
    (``is_fp16_supported``), the worker lifts that check as a user did. fp16 under ZeRO 1,
    a way out, trains: its parameters move as fp32 ZeRO 1's up to fp16's rounding (3.5e-2
    relative measured), where gradients 65,536x too small move them by 0.67."""
    for result in scenario("fp16_zero0", tmp_path):
        message = result["message"]
        assert message.startswith("DistributedShampoo: DeepSpeed fp16 without ZeRO "
                                  "(zero_optimization.stage 0"), message
        assert "bf16" in message and "ZeRO stage 1 or 2" in message
        assert result["unchanged"] and result["state"] == 0 and result["step"] == 0
        assert result["zero1_fp16"] == ("DeepSpeedZeroOptimizer", 2)
        assert result["zero1_vs_fp32"] < 0.1, result["zero1_vs_fp32"]


# ------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ds_checkpoint")


@pytest.fixture(scope="module")
def checkpoint_runs(checkpoint_dir):
    return scenario("checkpoint", checkpoint_dir)


def test_engine_checkpoint_resumes_exactly(checkpoint_runs):
    """fp32 ZeRO 2 Shampoo: ``engine.save_checkpoint`` at step 3, a fresh model, optimizer
    and engine ``load_checkpoint`` and 3 more steps: bit for bit the uninterrupted run."""
    for run in checkpoint_runs:
        assert run["distributor"] == "ZeroDistributor"
        assert run["loaded_step"] == 3
        assert run["losses_b"] == run["losses_a"]
        assert_bitwise(run["resumed"], run["uninterrupted"])


def test_resume_on_one_rank(checkpoint_runs, checkpoint_dir):
    """The 2-rank checkpoint on 1 rank (the two ranks' micro-batches accumulated): hf_shampoo's
    ``save_sharded`` / ``load_sharded`` resume bit for bit; DeepSpeed's own engine checkpoint
    is refused by DeepSpeed (its ZeRO checkpoints are per data-parallel rank)."""
    (result,) = scenario("resume_one", checkpoint_dir, nproc=1)
    assert result["loaded_step"] == 3
    assert_bitwise(result["resumed"], checkpoint_runs[0]["uninterrupted"])
    assert result["ds_load"].startswith("ZeRORuntimeException: The checkpoint being loaded "
                                        "used a DP world size of 2 but the current world "
                                        "size is 1"), result["ds_load"]


# ------------------------------------------------------------------------ ZeRO 3
def test_zero3_is_refused_at_the_first_step(tmp_path):
    result = scenario_single("zero3", tmp_path)
    assert "DeepSpeed ZeRO stage 3" in result["message"]
    assert "ZeRO stage 1 or 2" in result["message"] and "FSDP2" in result["message"]


def test_a_stage_group_is_refused_under_zero(tmp_path):
    """DeepSpeed's partitions span its own data-parallel group, the world here: an
    optimizer over a pipeline stage's group is refused with a way out."""
    result = scenario_single("stage_group", tmp_path)
    assert result["message"].startswith(
        "DistributedShampoo: process_group is not supported under DeepSpeed ZeRO"), result
    assert "use FSDP2 / DDP stages for pipeline parallelism" in result["message"]


def scenario_single(name: str, out_dir: Path) -> dict:
    return scenario(name, out_dir)[0]


# ------------------------------------------------------------------------ the Trainer
@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds_trainer")
    launch("trainer_deepspeed_worker.py", [str(out)])
    result = torch.load(out / "result.pt", weights_only=False)
    assert "error" not in result, result["error"]
    return result


@pytest.mark.parametrize("optim", ["distributed_shampoo", "distributed_muon"])
def test_trainer_zero2_equals_zero0(trainer_runs, optim):
    """``TrainingArguments(deepspeed=..., optim=...)``, fp32, 6 steps: ZeRO 2's final
    parameters and losses are ZeRO 0's, bit for bit (the gradients are averaged the same
    way, the optimizer blocks the same parameters and steps them in the same order)."""
    zero0, zero2 = trainer_runs[f"{optim}_z0"], trainer_runs[f"{optim}_z2"]
    assert zero0["distributor"] == "DataParallelDistributor"
    assert zero2["distributor"] == "ZeroDistributor"
    assert zero2["step"] == zero0["step"] == 6
    assert zero2["losses"] == zero0["losses"]
    assert_bitwise(zero2["params"], zero0["params"])


def test_trainer_zero2_resumes_exactly(trainer_runs):
    """The Trainer's checkpoint at step 3 (DeepSpeed's engine checkpoint with the
    optimizer's state dict inside) and ``resume_from_checkpoint``: steps 4-6 as the
    uninterrupted run, bit for bit."""
    full, resumed = trainer_runs["distributed_shampoo_z2"], trainer_runs["resumed"]
    assert resumed["step"] == 6
    for step in (4, 5, 6):
        assert resumed["losses"][step] == full["losses"][step]
    assert_bitwise(resumed["params"], full["params"])
