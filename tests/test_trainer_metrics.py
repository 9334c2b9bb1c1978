"""The optimizer's health in the Trainer's logs, Accelerate's trackers and a picture
(docs/metrics.md): ``optimizer/...`` in every training log entry (``log_history``, and so
TensorBoard, read back from its event file), off with ``optim_args`` ``log_metrics=false``,
the same entries on 2 torchrun ranks; ``accelerator.log(optimizer.metrics())`` into
Accelerate's TensorBoard tracker; ``python -m hf_shampoo.plot`` on a run's
``trainer_state.json`` writes a PNG."""

from __future__ import annotations

import json
import math
import struct
import sys

import pytest
import torch
from transformers import Trainer, TrainingArguments

from hf_shampoo import DistributedShampoo
from hf_shampoo.integrations import transformers as hft
from tests.helpers import run
from tests.tiny_trainer import dataset, tiny_gpt2

pytestmark = pytest.mark.integrations

OPTIM_ARGS = "precondition_frequency=2"


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert hft.register()


def _args(tmp_path, **kwargs) -> TrainingArguments:
    base = {"output_dir": str(tmp_path / "out"), "use_cpu": True, "report_to": [],
            "max_steps": 4, "logging_steps": 1, "per_device_train_batch_size": 2,
            "save_strategy": "no", "disable_tqdm": True, "optim": "distributed_shampoo",
            "optim_args": OPTIM_ARGS}
    return TrainingArguments(**{**base, **kwargs})


def _health(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k.startswith("optimizer/")}


def _events(folder):
    """Scalar tag → [(step, value)] of the TensorBoard event files under ``folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (path,) = {p.parent for p in folder.rglob("events.out.tfevents.*")}
    accumulator = EventAccumulator(str(path))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def test_every_training_log_entry_and_tensorboard_carry_the_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    args = _args(tmp_path, report_to=["tensorboard"], eval_strategy="steps", eval_steps=2)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset(),
                      eval_dataset=dataset(4))
    trainer.train()
    history = trainer.state.log_history
    training = [h for h in history if "loss" in h]
    assert [h["step"] for h in training] == [1, 2, 3, 4]
    for entry in training:
        health = _health(entry)
        assert health["optimizer/steps"] == entry["step"]
        # staggered refreshes (the Trainer's default), precondition_frequency=2: blocks of
        # offset 0 refresh at steps 2 and 4, those of offset 1 at step 3, every block
        # preconditions from step 3
        assert (health["optimizer/refresh_blocks"] > 0) == (entry["step"] >= 2)
        started = health["optimizer/preconditioning"]
        assert (started == 0) if entry["step"] == 1 else (0 < started < 1) if \
            entry["step"] == 2 else (started == 1), (entry["step"], started)
    assert training[0].keys() == training[-1].keys()
    others = [h for h in history if "loss" not in h]  # evaluations, the final summary
    assert others and not any(_health(h) for h in others)
    shampoo = trainer.optimizer.optimizer  # AcceleratedOptimizer's
    assert isinstance(shampoo, DistributedShampoo)
    now = shampoo.metrics()  # nothing stepped since the last entry
    for key in ("optimizer/condition_max", "optimizer/state_bytes",
                "optimizer/graft_ratio/shampoo"):
        assert now[key] == training[-1][key], key
    # TensorBoard: the reporters got the same values (HF's callback writes train/<key>)
    scalars = _events(tmp_path / "out")
    for key in _health(training[-1]):
        if math.isnan(training[-1][key]):
            continue
        logged = dict(scalars[f"train/{key}"])
        assert sorted(logged) == [1, 2, 3, 4], key
        for entry in training:
            if math.isnan(entry[key]):  # NaN before the first refresh: logged as NaN too
                assert math.isnan(logged[entry["step"]]), key
            else:
                assert logged[entry["step"]] == pytest.approx(entry[key], rel=1e-6), key


def test_log_metrics_false_leaves_the_logs_alone_and_bad_values_are_refused(tmp_path):
    args = _args(tmp_path, max_steps=2, optim_args=OPTIM_ARGS + ",log_metrics=false")
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset())
    trainer.train()
    assert trainer.state.log_history and not any(
        _health(h) for h in trainer.state.log_history)
    assert hft.parse_optim_args("log_metrics=no").log_metrics is False
    assert hft.parse_optim_args({"log_metrics": True}).log_metrics is True
    assert hft.parse_optim_args("lr=0.1").log_metrics is True
    assert "log_metrics" in hft.valid_keys()
    with pytest.raises(ValueError, match=r"log_metrics='maybe': expected true or false"):
        Trainer(model=tiny_gpt2(), args=_args(tmp_path, optim_args="log_metrics=maybe"))
    with pytest.raises(ValueError, match="unknown optim_args key 'lm_head@log_metrics'"):
        hft.parse_optim_args("lm_head@log_metrics=false")


def test_shampoo_trainer_and_muon_log_them_once(tmp_path, monkeypatch):
    calls = []
    original = DistributedShampoo.metrics

    def counted(self):
        calls.append(self)
        return original(self)

    monkeypatch.setattr(DistributedShampoo, "metrics", counted)
    # ShampooTrainer overrides log(); with optim="distributed_shampoo" the registered
    # Trainer.log would add them as well: each entry is computed once
    trainer = hft.ShampooTrainer(model=tiny_gpt2(), args=_args(tmp_path, max_steps=3),
                                 train_dataset=dataset())
    trainer.train()
    training = [h for h in trainer.state.log_history if "loss" in h]
    assert len(calls) == len(training) == 3
    assert all(h["optimizer/steps"] == h["step"] for h in training)
    calls.clear()
    args = _args(tmp_path, max_steps=2, optim="distributed_muon", optim_args=None)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset())
    trainer.train()
    last = [h for h in trainer.state.log_history if "loss" in h][-1]
    assert len(calls) == 2 and last["optimizer/steps"] == 2
    assert "optimizer/graft_ratio/spectral_descent" not in last or math.isfinite(
        last["optimizer/graft_ratio/spectral_descent"])
    assert "optimizer/condition_max" not in last  # Muon and Adam keep no factors
    calls.clear()
    args = _args(tmp_path, max_steps=2, optim="adamw_torch", optim_args=None)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset())
    trainer.train()
    assert not calls and not any(_health(h) for h in trainer.state.log_history)


# ------------------------------------------------------------------------- 2 ranks
DDP_WORKER = '''
import json, os, sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
import hf_shampoo  # registers optim="distributed_shampoo"

out = sys.argv[1]
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                   n_positions=16, bos_token_id=0, eos_token_id=0))
ids = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(1))
args = TrainingArguments(output_dir=out, use_cpu=True, report_to=[], max_steps=4,
                         logging_steps=2, per_device_train_batch_size=2, save_strategy="no",
                         disable_tqdm=True, optim="distributed_shampoo",
                         optim_args="precondition_frequency=2,max_preconditioner_dim=16")
trainer = Trainer(model=model, args=args,
                  train_dataset=[{"input_ids": row, "labels": row} for row in ids])
trainer.train()
entries = [{k: v for k, v in h.items() if k.startswith("optimizer/") or k == "step"}
           for h in trainer.state.log_history if "loss" in h]
shampoo = trainer.optimizer.optimizer
with open(f"{out}/rank{args.process_index}.json", "w") as f:
    json.dump({"entries": entries, "world": args.world_size,
               "distributor": type(shampoo.distributor).__name__}, f)
if torch.distributed.is_initialized():  # no finalization: gloo's threads may abort it
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
'''


@pytest.mark.distributed
def test_two_torchrun_ranks_log_the_same_metrics(tmp_path):
    script = tmp_path / "trainer_metrics.py"
    script.write_text(DDP_WORKER)
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(script), str(tmp_path)], timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["world"] == 2 and ranks[0]["distributor"] == "DataParallelDistributor"
    assert ranks[0]["entries"] == ranks[1]["entries"]
    entries = ranks[0]["entries"]
    assert [e["step"] for e in entries] == [2, 4]
    last = entries[-1]
    assert last["optimizer/steps"] == 4 and last["optimizer/refresh_blocks"] > 0
    assert 0 < last["optimizer/state_bytes_max_rank"] < last["optimizer/state_bytes"]


# ----------------------------------------------------------------------------- Accelerate
def test_accelerate_tensorboard_tracker_takes_the_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    accelerator.init_trackers("health")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    shampoo = DistributedShampoo(model.parameters(), lr=1e-2, grafting="adam",
                                 precondition_frequency=2, epsilon=1e-6)
    model, optimizer = accelerator.prepare(model, shampoo)
    gen = torch.Generator().manual_seed(0)
    logged = {}
    for step in range(1, 5):
        optimizer.zero_grad()
        accelerator.backward(model(torch.randn(16, 8, generator=gen)).square().mean())
        optimizer.step()
        logged[step] = shampoo.metrics()
        accelerator.log(logged[step], step=step)
    accelerator.end_training()
    scalars = _events(tmp_path)
    assert dict(scalars["optimizer/steps"]) == {s: float(s) for s in logged}
    assert dict(scalars["optimizer/refresh_blocks"]) == {
        s: m["optimizer/refresh_blocks"] for s, m in logged.items()}
    assert dict(scalars["optimizer/state_bytes"])[4] == logged[4]["optimizer/state_bytes"]


# ------------------------------------------------------------------------------- the plot
def _is_png(path) -> tuple[int, int]:
    """The PNG's width and height (its signature and IHDR chunk checked)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    return struct.unpack(">II", data[16:24])


def test_plot_command_draws_a_run(tmp_path):
    pytest.importorskip("matplotlib")
    trainer = Trainer(model=tiny_gpt2(), args=_args(tmp_path, max_steps=4),
                      train_dataset=dataset())
    trainer.train()
    trainer.save_state()
    state = tmp_path / "out" / "trainer_state.json"
    assert state.is_file()
    out = run([sys.executable, "-m", "hf_shampoo.plot", str(state), "-o",
               str(tmp_path / "health.png")])
    assert str(tmp_path / "health.png") in out
    width, height = _is_png(tmp_path / "health.png")
    assert width > 500 and height > 300
    # the output folder itself: the PNG lands next to its trainer_state.json
    from hf_shampoo.plot import DEFAULT_NAME, plot, series

    assert plot(tmp_path / "out") == tmp_path / "out" / DEFAULT_NAME
    _is_png(tmp_path / "out" / DEFAULT_NAME)
    steps, values = series(trainer.state.log_history, "optimizer/steps")
    assert steps == [1, 2, 3, 4] and values == [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(FileNotFoundError, match="trainer_state.json"):
        plot(tmp_path / "nowhere")


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    from hf_shampoo import plot as plotting

    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": []}))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"pip install 'hf_shampoo\[examples\]'"):
        plotting.plot(tmp_path)
