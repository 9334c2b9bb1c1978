"""A transformers model sharded tensor parallel 2 x FSDP2 2 on 4 gloo ranks, trained by
hf_shampoo (tests/transformers_tp_worker.py): by a plain loop with ``make_optimizer``
(Shampoo's transformer preset and the muon preset), the model sharded by transformers'
``from_pretrained(distributed_config=DistributedConfig(tp_size=2, fsdp_size=2))`` and by
torch's ``apply_tensor_parallelism`` + ``fully_shard``; and by the Trainer with
``optim="distributed_shampoo"`` / ``"distributed_muon"``.

Each is compared with one process training the same model on the same full batch.
Tolerances: the model is float64 and Shampoo's factor matrices are float64, but hf_shampoo
sends gradient and direction parts in ``communication_dtype=float32`` (float64 is not an
allowed choice), transformers' causal-LM loss casts the logits to float32 (the Trainer
tests use it; the loop computes its own float64 loss), and the tensor-parallel and FSDP
reductions add in another order than one process. The ranks end within float32 rounding of
one process: measured after 3 steps, loop 8.9e-9 (Shampoo) and 7.7e-8 (Muon), Trainer
5.5e-9 / 2.6e-8 absolute, asserted with ``atol=1e-6`` (parameters are O(0.1), norms O(1)).
With float32 factor matrices Shampoo's inverse roots amplify that rounding (2.5e-8 in the
loop, 5e-6 on the vocabulary tables through the Trainer, whose epsilon is 1e-12), and with a
float32 model to 1.5e-3 (2% relative): no tolerance there would tell a wrong block from
rounding, hence float64. Across ranks the full parameters are equal bit for bit.

The Trainer needs one test-only bypass on CPU (``allow_parallelism_config_on_cpu`` in the
worker: Accelerate refuses the ``ParallelismConfig`` the Trainer builds for a TP model on a
non-GPU backend); it runs with ``save_strategy="no"`` because transformers 5.24 refuses to
checkpoint the optimizer of a model sharded at load time (trainer.py:632).

Resume under the TP mesh goes through Accelerate instead: ``save_state`` at step 2 and
``load_state`` into a fresh model, optimizer and Accelerator continue bit for bit, with
FSDP2's sharded state dict (Accelerate's own ``save_state``) and full state dict
(``hf_shampoo.integrations.accelerate.save_state``, which consolidates first); on a CPU the
Accelerator's state is switched to FSDP2 for the two calls (``accelerate_tp`` in the worker
says why, and what ``MULTI_CPU`` does instead).
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests import transformers_tp_worker as worker
from tests.helpers import one_thread_per_process, torchrun

pytestmark = pytest.mark.integrations

torch.set_num_threads(1)
HOWS = ["distcfg", "torch"]
ATOL = 1e-6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    worker.make_tiny(str(path))
    return str(path)


@pytest.fixture(scope="module")
def loop_runs(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_loop")
    with one_thread_per_process():
        mp.spawn(worker.run_world, args=(tiny, str(out / "init"), str(out), HOWS),
                 nprocs=worker.WORLD, join=True)
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(worker.WORLD)]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    return results


@pytest.fixture(scope="module")
def references(tiny):
    return {name: worker.train_one_process(tiny, name) for name in worker.OPTIMIZERS}


def _assert_params_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _assert_ranks_equal(per_rank: list[dict]) -> None:
    for other in per_rank[1:]:
        for name, value in per_rank[0].items():
            assert torch.equal(other[name], value), name


CASES = [(how, name) for how in HOWS for name in worker.OPTIMIZERS]


@pytest.mark.parametrize(("how", "name"), CASES)
def test_sharded_as_torch_and_transformers_shard_it(loop_runs, how, name):
    placements = loop_runs[0][f"{how}_{name}"]["placements"]
    assert len(placements) == 21  # every parameter a DTensor
    colwise = placements["model.layers.0.self_attn.q_proj.weight"]
    assert "_StridedShard(dim=0, sf=2)" in colwise and "Shard(dim=0)" in colwise
    assert placements["model.layers.0.self_attn.o_proj.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert placements["model.norm.weight"] == "(Shard(dim=0),)"  # on the fsdp sub-mesh


@pytest.mark.parametrize(("how", "name"), CASES)
def test_loop_every_rank_ends_with_the_one_process_parameters(loop_runs, references, how, name):
    per_rank = [r[f"{how}_{name}"] for r in loop_runs]
    assert all(r["kind"] == "ShardedDistributor" for r in per_rank)
    _assert_ranks_equal([r["params"] for r in per_rank])
    _assert_params_close(per_rank[0]["params"], references[name]["params"])
    # each rank's loss is its data-parallel half's; the halves' mean is the full batch's
    # (ranks 0, 1 and 2, 3 are the two coordinates' tensor-parallel pairs)
    mean = torch.tensor([r["losses"] for r in per_rank], dtype=torch.float64).mean(0)
    torch.testing.assert_close(mean, torch.tensor(references[name]["losses"],
                                                  dtype=torch.float64), rtol=0, atol=ATOL)


@pytest.mark.parametrize(("how", "name"), CASES)
def test_loop_every_block_has_its_state_once_in_the_world(loop_runs, references, how, name):
    shares = [r[f"{how}_{name}"]["state_numel"] for r in loop_runs]
    total = references[name]["state_numel"]
    assert sum(shares) == total
    assert max(shares) < total / 2  # spread over the ranks, never all on one


# ---------------------------------------------------------------------------- the Trainer
OPTIMS = ["distributed_shampoo", "distributed_muon"]


def _torchrun_worker(*args: str) -> None:
    """``transformers_tp_worker.py *args`` on 4 ranks under ``torch.distributed.run``."""
    torchrun("transformers_tp_worker.py", list(args), worker.WORLD)


@pytest.fixture(scope="module")
def trainer_runs(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_trainer")
    _torchrun_worker(tiny, str(out), *OPTIMS)
    results = [torch.load(out / f"trainer_rank{r}.pt", weights_only=False)
               for r in range(worker.WORLD)]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    return results


@pytest.mark.parametrize("optim", OPTIMS)
def test_trainer_by_name_matches_one_process(trainer_runs, tiny, tmp_path, optim):
    per_rank = [r[optim] for r in trainer_runs]
    expected = worker.trainer_one_process(tiny, optim, str(tmp_path))
    for r in per_rank:
        assert r["kind"] == "ShardedDistributor"
        assert r["dtensors"] == 21
        assert r["distributed_type"] == "DistributedType.MULTI_CPU"  # not wrapped in DDP
    _assert_ranks_equal([r["params"] for r in per_rank])
    _assert_params_close(per_rank[0]["params"], expected["params"])
    # the Trainer logs the loss averaged over the data-parallel ranks: the full batch's
    assert per_rank[0]["losses"].keys() == expected["losses"].keys()
    for step, loss in expected["losses"].items():
        assert per_rank[0]["losses"][step] == pytest.approx(loss, abs=1e-5)
    assert sum(r["state_numel"] for r in per_rank) == expected["state_numel"]


# ---------------------------------------------------------------------------- Accelerate resume
# name:state_dict_type:saver (transformers_tp_worker.accelerate_resume); the fast set is
# Accelerate's own save_state with its FSDP2 default (sharded, DCP) and hf_shampoo's
# save_state with a full state dict, which needs its consolidation
ACC_FAST = ["shampoo:SHARDED_STATE_DICT:accelerate", "muon:SHARDED_STATE_DICT:accelerate",
            "shampoo:FULL_STATE_DICT:hf_shampoo", "muon:FULL_STATE_DICT:hf_shampoo"]
ACC_SLOW = ["shampoo:SHARDED_STATE_DICT:hf_shampoo", "muon:SHARDED_STATE_DICT:hf_shampoo",
            "shampoo:FULL_STATE_DICT:accelerate", "muon:FULL_STATE_DICT:accelerate"]


def _accelerate_runs(tiny, out, cases) -> dict:
    _torchrun_worker("accelerate", tiny, str(out), *cases)
    per_rank = [torch.load(out / f"accelerate_rank{r}.pt", weights_only=False)
                for r in range(worker.WORLD)]
    return {case: [r[case] for r in per_rank] for case in cases}


@pytest.fixture(scope="module")
def accelerate_fast(tiny, tmp_path_factory):
    return _accelerate_runs(tiny, tmp_path_factory.mktemp("tp_acc"), ACC_FAST)


@pytest.fixture(scope="module")
def accelerate_slow(tiny, tmp_path_factory):
    return _accelerate_runs(tiny, tmp_path_factory.mktemp("tp_acc_slow"), ACC_SLOW)


def _assert_resumed_exactly(per_rank: list[dict]) -> None:
    errors = [r["error"] for r in per_rank if "error" in r]
    assert not errors, errors[0]
    for r in per_rank:
        assert r["kind"] == "ShardedDistributor"
        assert r["distributed_type"] == "DistributedType.MULTI_CPU"  # prepare kept the model
        assert r["steps"] == [worker.ACC_STEPS] * len(r["steps"])
        assert r["loaded_steps"] == [worker.ACC_SAVE_AT] * len(r["steps"])  # step restored
        for key in ("loaded", "resumed"):  # bit for bit
            want = r["saved"] if key == "loaded" else r["uninterrupted"]
            assert r[key].keys() == want.keys()
            for name in want:
                assert torch.equal(r[key][name], want[name]), (key, name)
    _assert_ranks_equal([r["resumed"] for r in per_rank])


@pytest.mark.parametrize("case", ACC_FAST)
def test_accelerate_save_load_state_resumes_exactly(accelerate_fast, case):
    """save_state at step 2 of a TP 2 x FSDP2 2 model, load_state into a fresh model,
    optimizer and Accelerator: steps 3-4 end bit-identical to the run that never stopped."""
    _assert_resumed_exactly(accelerate_fast[case])
    files = accelerate_fast[case][0]["files"]
    if "SHARDED" in case:  # torch.distributed.checkpoint directories, every rank's part
        assert {"optimizer_0", "pytorch_model_fsdp_0"} <= set(files)
    else:
        assert {"optimizer.bin", "pytorch_model_fsdp.bin"} <= set(files)


@pytest.mark.slow
@pytest.mark.parametrize("case", ACC_SLOW[:2])
def test_accelerate_sharded_resume_with_hf_shampoo_save_state(accelerate_slow, case):
    _assert_resumed_exactly(accelerate_slow[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", ACC_SLOW[2:])
def test_accelerate_full_state_dict_without_consolidation_loses_blocks(accelerate_slow, case):
    """Documented limit (docs/sharded.md, "Full"): Accelerate's own save_state with
    FULL_STATE_DICT writes rank 0's blocks only, and torch's set_optimizer_state_dict fills
    the other ranks' with the fresh optimizer's state, so the resumed run differs (2e-2
    after 2 steps) although the parameters and the step counter load exactly. Use
    hf_shampoo.integrations.accelerate.save_state (above) or the sharded state dict."""
    per_rank = accelerate_slow[case]
    errors = [r["error"] for r in per_rank if "error" in r]
    assert not errors, errors[0]
    for r in per_rank:
        assert r["loaded_steps"] == [worker.ACC_SAVE_AT] * len(r["loaded_steps"])
        assert all(torch.equal(r["loaded"][n], r["saved"][n]) for n in r["saved"])
        assert not all(torch.equal(r["resumed"][n], r["uninterrupted"][n])
                       for n in r["uninterrupted"])
