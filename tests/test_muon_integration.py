"""Muon from the public interface: the "muon" module preset, ``describe()``, the Trainer by
name (``optim="distributed_muon"``, ``optim_args="preset=muon"``), the command line and an
unmodified HF script that saves, resumes (bit for bit) and runs under two ranks."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from transformers import HfArgumentParser, Trainer, TrainingArguments

from hf_shampoo import DistributedShampoo
from hf_shampoo.describe_table import describe, describe_rows
from hf_shampoo.factory import make_optimizer
from hf_shampoo.integrations import transformers as hft
from hf_shampoo.model_rules import WHOLE_MATRIX
from tests import tiny_trainer as tiny

pytestmark = pytest.mark.integrations

HIDDEN = ("transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight",
          "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight")
ADAM = ("transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight",
        "transformer.h.0.attn.c_attn.bias")


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert hft.register()


def kinds(optimizer: DistributedShampoo) -> dict[str, str]:
    return {name: g["preconditioner"] for g in optimizer.param_groups
            for name in g["param_names"]}


def check_muon_groups(optimizer: DistributedShampoo, beta1: float) -> None:
    found = kinds(optimizer)
    for name in HIDDEN:
        group = tiny.group_of(optimizer, name)
        assert found[name] == "spectral_descent"
        assert group["grafting"] is None and group["max_preconditioner_dim"] == WHOLE_MATRIX
        assert group["beta3"] == pytest.approx(beta1**2)  # Nesterov
        assert group["spectral_lr_adjustment"] == "match_rms_adamw"
    for name in ADAM:
        group = tiny.group_of(optimizer, name)
        assert found[name] == "diagonal" and group["grafting"] == "adam"
    # every parameter is in exactly one of the two kinds
    assert set(found.values()) == {"spectral_descent", "diagonal"}


def test_preset_splits_matrices_from_the_rest_and_describe_shows_it():
    model = tiny.tiny_gpt2()
    optimizer = make_optimizer(model, preset="muon", lr=1e-3, betas=(0.95, 0.999),
                               weight_decay=0.1)
    check_muon_groups(optimizer, 0.95)
    rows = {r["name"]: r for r in describe_rows(optimizer)}
    assert rows["transformer.h.0.mlp.c_fc.weight"]["blocks"] == "1x(32, 128)"  # whole
    assert rows["transformer.h.0.mlp.c_fc.weight"]["preconditioner"] == "spectral_descent"
    assert rows["transformer.ln_f.weight"]["preconditioner"] == "diagonal"
    assert rows["transformer.ln_f.weight"]["weight_decay"] == 0.0
    assert rows["transformer.h.0.attn.c_attn.weight"]["weight_decay"] == 0.1
    text = describe(optimizer)
    assert "spectral_descent" in text and "diagonal" in text
    # one training step moves every parameter
    before = [p.detach().clone() for p in model.parameters()]
    batch = tiny.dataset(2)[0]["input_ids"][None]
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_preset_keeps_what_the_user_set():
    optimizer = make_optimizer(tiny.tiny_gpt2(), preset="muon", beta3=0.9,
                               spectral_lr_adjustment="original")
    group = tiny.group_of(optimizer, HIDDEN[0])
    assert group["beta3"] == 0.9 and group["spectral_lr_adjustment"] == "original"


def test_preset_gives_conv_kernels_out_by_rest_matrices():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 4 * 4, 10))
    optimizer = make_optimizer(model, preset="muon")
    rows = {r["name"]: r for r in describe_rows(optimizer)}
    assert rows["0.weight"]["preconditioner"] == "spectral_descent"
    assert rows["0.weight"]["blocks"] == "1x(8, 27)"
    assert rows["4.weight"]["blocks"] == "1x(10, 128)"
    assert rows["1.weight"]["preconditioner"] == "diagonal"
    loss = model(torch.randn(2, 3, 6, 6)).sum()
    loss.backward()
    optimizer.step()


def test_trainer_by_name_distributed_muon(tmp_path, caplog):
    args = tiny.training_args(tmp_path, optim="distributed_muon", learning_rate=3e-3,
                         adam_beta1=0.9, weight_decay=0.1)
    trainer = Trainer(model=tiny.tiny_gpt2(), args=args, train_dataset=tiny.dataset())
    assert "ShampooCheckpointCallback" in [type(c).__name__
                                          for c in trainer.callback_handler.callbacks]
    optimizer = tiny.shampoo_of(trainer)
    check_muon_groups(optimizer, 0.9)
    # the Shampoo fine-tuning defaults mean nothing to Muon's kinds: not set
    for group in optimizer.param_groups:
        assert group["precondition_frequency"] == 1
        assert group["max_preconditioner_dim"] in (1024, WHOLE_MATRIX)
    with caplog.at_level("WARNING"):
        trainer.train()
    assert optimizer.param_groups[0]["step"] == 3
    # nothing to refresh: no note that the run ends before a first refresh
    assert not any("first preconditioner refresh" in r.getMessage() for r in caplog.records)


def test_muon_warm_up_is_accepted_as_documented(tmp_path):
    """``start_preconditioning_step >= 1`` is valid for Muon (no hidden
    ``precondition_frequency=50`` refuses it); under the preset no group has a grafting
    method to warm up with, and the Trainer says so."""
    args = tiny.training_args(tmp_path, optim="distributed_muon",
                         optim_args="start_preconditioning_step=10")
    trainer = Trainer(model=tiny.tiny_gpt2(), args=args, train_dataset=tiny.dataset())
    with pytest.warns(UserWarning, match="'start_preconditioning_step'.*change nothing"):
        optimizer = tiny.shampoo_of(trainer)
    assert tiny.group_of(optimizer, HIDDEN[0])["start_preconditioning_step"] == 10
    # with Adam grafting on the matrices, the warm-up acts and nothing is reported
    args = tiny.training_args(tmp_path, optim="distributed_muon",
                         optim_args="start_preconditioning_step=10,*.h.*@grafting=adam")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer = tiny.shampoo_of(
            Trainer(model=tiny.tiny_gpt2(), args=args, train_dataset=tiny.dataset()))
    assert tiny.group_of(optimizer, HIDDEN[0])["grafting"] == "adam"


def test_optim_args_preset_muon_builds_the_same_groups(tmp_path):
    by_name = tiny.shampoo_of(Trainer(model=tiny.tiny_gpt2(), args=tiny.training_args(
        tmp_path, optim="distributed_muon"), train_dataset=tiny.dataset()))
    by_args = tiny.shampoo_of(Trainer(model=tiny.tiny_gpt2(), args=tiny.training_args(
        tmp_path, optim="distributed_shampoo", optim_args="preset=muon"),
        train_dataset=tiny.dataset()))
    assert kinds(by_name) == kinds(by_args)


def test_command_line_distributed_muon(tmp_path):
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--optim", "distributed_muon", "--output_dir", str(tmp_path), "--use_cpu",
         "--optim_args", "newton_schulz_iterations=6,spectral_lr_adjustment=original,"
         "newton_schulz_dtype=bf16,newton_schulz_coefficients=(3;-3.2;1.2)",
         "--report_to", "none"])
    optimizer = tiny.shampoo_of(
        Trainer(model=tiny.tiny_gpt2(), args=args, train_dataset=tiny.dataset()))
    group = tiny.group_of(optimizer, HIDDEN[0])
    assert group["preconditioner"] == "spectral_descent"
    assert group["newton_schulz_iterations"] == 6
    assert group["spectral_lr_adjustment"] == "original"
    assert group["newton_schulz_dtype"] == torch.bfloat16
    assert group["newton_schulz_coefficients"] == (3.0, -3.2, 1.2)


def test_bad_muon_optim_args_fail_when_the_trainer_is_built(tmp_path):
    with pytest.raises(ValueError, match="spectral_lr_adjustment"):
        Trainer(model=tiny.tiny_gpt2(), args=tiny.training_args(
            tmp_path, optim="distributed_muon", optim_args="spectral_lr_adjustment=rms"),
            train_dataset=tiny.dataset())


MUON_ARGS = [a if a != "distributed_shampoo" else "distributed_muon" for a in tiny.WORKER_ARGS]


def test_unmodified_script_resumes_muon_exactly(tmp_path):
    result = tiny.train_and_resume(tmp_path, MUON_ARGS, 1)
    assert result["losses_a"]["8"] < result["losses_a"]["1"]


@pytest.mark.slow
def test_two_ranks_muon_trainer_checkpoint_resumes_exactly(tmp_path):
    tiny.train_and_resume(tmp_path, MUON_ARGS, 2)
