"""Checkpoints that cannot lie (docs/checkpoints.md, "Faults"): a missing, cut-short or damaged
checkpoint raises ``CheckpointError`` (an ``Exception``, naming the checkpoint and the file,
saying what to do) before anything is loaded; the completion mark; the Trainer's
``get_last_checkpoint`` passing over a checkpoint whose save was cut short."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from hf_shampoo import CheckpointError, DistributedShampoo
from hf_shampoo.checkpoint import load_sharded, save_sharded
from hf_shampoo.checkpoint.integrity import (
    COMPLETE_MARK,
    check_marked,
    mark_complete,
    newest_complete,
    read_checked_metadata,
    trainer_checkpoint_problem,
)

pytestmark = pytest.mark.unit


def trained(seed: int = 0, steps: int = 3) -> tuple[torch.nn.Module, DistributedShampoo]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    opt = DistributedShampoo(model.parameters(), lr=0.05, precondition_frequency=2,
                             grafting="adam")
    for _ in range(steps):
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def snapshot(opt) -> dict:
    return {k: {n: t.clone() for n, t in e.items()} for k, e in opt.state_dict()["state"].items()}


def assert_unchanged(opt, before: dict) -> None:
    after = snapshot(opt)
    assert after.keys() == before.keys()
    for k in before:
        for n in before[k]:
            assert torch.equal(after[k][n], before[k][n])


@pytest.fixture
def saved(tmp_path):
    _, opt = trained(seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        save_sharded(opt, tmp_path / "ckpt")
    _, other = trained(seed=1)  # another state, to show that nothing of the first is loaded
    return tmp_path / "ckpt", other


def shard_file(ckpt):
    return next(p for p in ckpt.iterdir() if p.suffix == ".distcp")


def test_whole_sharded_checkpoint_loads(saved):
    ckpt, opt = saved
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_sharded(opt, ckpt)
    _, first = trained(seed=0)
    assert_unchanged(opt, snapshot(first))


@pytest.mark.parametrize("damage", ["no_dir", "no_metadata", "short_shard", "no_shard",
                                    "bad_metadata", "garbled_shard"])
def test_damaged_sharded_checkpoint_is_refused_before_loading(saved, damage):
    ckpt, opt = saved
    before = snapshot(opt)
    if damage == "no_dir":
        ckpt = ckpt.parent / "missing"
        expected_file = None
    elif damage == "no_metadata":
        (ckpt / ".metadata").unlink()
        expected_file = ckpt / ".metadata"
    elif damage == "short_shard":
        shard = shard_file(ckpt)
        shard.write_bytes(shard.read_bytes()[:100])
        expected_file = shard
    elif damage == "no_shard":
        expected_file = shard_file(ckpt)
        expected_file.unlink()
    elif damage == "bad_metadata":
        (ckpt / ".metadata").write_bytes(b"not a pickle")
        expected_file = ckpt / ".metadata"
    else:  # the right length, the wrong bytes: found by DCP's own reading, reported as ours
        shard = shard_file(ckpt)
        shard.write_bytes(bytes(len(shard.read_bytes())))
        expected_file = None
    with pytest.raises(Exception) as caught:  # an Exception, not torch's BaseException
        load_sharded(opt, ckpt)
    error = caught.value
    assert isinstance(error, CheckpointError) and isinstance(error, ValueError)
    assert error.checkpoint == str(ckpt)
    assert error.file == (None if expected_file is None else str(expected_file))
    assert str(ckpt) in str(error) and "previous complete checkpoint" in str(error)
    assert_unchanged(opt, before)


def test_metadata_check_reads_a_whole_checkpoint(saved):
    ckpt, _ = saved
    assert read_checked_metadata(ckpt).state_dict_metadata


def test_mark_lists_files_and_catches_later_damage(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"x" * 10)
    (tmp_path / "sub" / "b.bin").write_bytes(b"y" * 4)
    with pytest.raises(CheckpointError, match="has no hf_shampoo_complete.json"):
        check_marked(tmp_path)
    mark_complete(tmp_path)
    assert json.loads((tmp_path / COMPLETE_MARK).read_text())["files"] == {
        "a.bin": 10, os.path.join("sub", "b.bin"): 4}
    check_marked(tmp_path)
    (tmp_path / "a.bin").write_bytes(b"x" * 5)
    with pytest.raises(CheckpointError, match="has 5 bytes where 10 were written") as caught:
        check_marked(tmp_path)
    assert caught.value.file == str(tmp_path / "a.bin")
    (tmp_path / "a.bin").write_bytes(b"x" * 10)
    (tmp_path / "sub" / "b.bin").unlink()
    with pytest.raises(CheckpointError, match="b.bin': the file is missing"):
        check_marked(tmp_path)


def test_newest_complete_passes_over_cut_short_ones(tmp_path):
    for step in (2, 4, 6, 10):
        d = tmp_path / f"checkpoint_{step}"
        d.mkdir()
        (d / "optimizer.bin").write_bytes(b"z" * step)
        if step in (2, 4):
            mark_complete(d)
    (tmp_path / "checkpoint_4" / "optimizer.bin").write_bytes(b"")  # damaged after its mark
    found, skipped = newest_complete(tmp_path)
    assert found == tmp_path / "checkpoint_2"
    assert [p.name for p, _ in skipped] == ["checkpoint_10", "checkpoint_6", "checkpoint_4"]
    assert newest_complete(tmp_path / "nothing") == (None, [])


def test_trainer_resumes_from_the_newest_whole_checkpoint(tmp_path):
    from transformers.trainer_utils import get_last_checkpoint

    import hf_shampoo  # noqa: F401 - patches get_last_checkpoint

    for step in (2, 4, 6):
        d = tmp_path / f"checkpoint-{step}"
        d.mkdir()
        (d / "optimizer.pt").write_bytes(b"half")
        if step < 6:  # the Trainer writes trainer_state.json last
            (d / "trainer_state.json").write_text("{}")
    assert "cut short" in trainer_checkpoint_problem(tmp_path / "checkpoint-6")
    assert trainer_checkpoint_problem(tmp_path / "checkpoint-4") is None
    with pytest.warns(UserWarning, match="not resuming from .*checkpoint-6"):
        assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-4")
    (tmp_path / "checkpoint-6" / "trainer_state.json").write_text("{}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a whole newest checkpoint: no word said
        assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-6")


def test_trainer_checkpoint_with_a_cut_short_shard_is_passed_over(tmp_path, saved):
    """A Trainer checkpoint of FSDP's sharded state (DCP folders) whose shard was cut after
    the save: refused with the file named."""
    import shutil

    ckpt, _ = saved
    trainer_dir = tmp_path / "checkpoint-8"
    trainer_dir.mkdir()
    (trainer_dir / "trainer_state.json").write_text("{}")
    shutil.copytree(ckpt, trainer_dir / "optimizer_0")
    assert trainer_checkpoint_problem(trainer_dir) is None
    shard = shard_file(trainer_dir / "optimizer_0")
    shard.write_bytes(shard.read_bytes()[:10])
    problem = trainer_checkpoint_problem(trainer_dir)
    assert str(shard) in problem and "cut short" in problem
