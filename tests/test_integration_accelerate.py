"""Tests of hf_shampoo/integrations/accelerate.py: Shampoo under ``Accelerator`` on CPU.

Gradient accumulation, bf16 autocast, a GradScaler-skipped step, single-process and
2-rank ``save_state`` / ``load_state`` (the 2-rank run started by ``accelerate launch -m
hf_shampoo.run``, resumed bit for bit).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from transformers import GPT2Config, GPT2LMHeadModel

from hf_shampoo import DistributedShampoo
from hf_shampoo.factory import make_optimizer
from hf_shampoo.integrations.accelerate import (
    consolidate,
    find_shampoo,
    register_checkpoint_hook,
    save_state,
)
from tests.helpers import ROOT, free_port

pytestmark = pytest.mark.integrations

@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each test builds its own Accelerator (mixed precision, accumulation are singletons)."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def batch(step: int, size: int = 4) -> torch.Tensor:
    """Counting sequences from a seeded start: learnable within a few steps."""
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, 64, (size, 1), generator=g) + torch.arange(16)) % 64


def shampoo_for(model, **kwargs) -> DistributedShampoo:
    base = {"lr": 1e-2, "betas": (0.9, 0.999), "grafting": "adam", "precondition_frequency": 2,
                "max_preconditioner_dim": 64}
    return make_optimizer(model, **{**base, **kwargs})


def snapshot(optimizer: DistributedShampoo) -> dict:
    return copy.deepcopy(optimizer.state_dict())


def assert_same_state(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys()
    for index, entry in a["state"].items():
        assert entry.keys() == b["state"][index].keys()
        for key, tensor in entry.items():
            assert torch.equal(tensor, b["state"][index][key]), (index, key)
    assert [g["step"] for g in a["param_groups"]] == [g["step"] for g in b["param_groups"]]


def test_find_and_consolidate_single_process():
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(tiny_gpt2(), shampoo_for(tiny_gpt2()))
    shampoo = find_shampoo(optimizer)
    assert isinstance(shampoo, DistributedShampoo) and shampoo is optimizer.optimizer
    assert find_shampoo(torch.optim.SGD(model.parameters(), lr=0.1)) is None
    assert consolidate([optimizer, torch.optim.SGD(model.parameters(), lr=0.1)]) == 1
    ranks = {b["rank"] for b in shampoo.describe_blocks()}
    assert ranks == {0}  # one process: no process group, everything on rank 0


def test_gradient_accumulation_steps_once_per_accumulated_batch():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = tiny_gpt2()
    reference_model = copy.deepcopy(model)
    # epsilon 1e-4: well-conditioned roots, so that summation order stays at rounding level
    model, optimizer = accelerator.prepare(model, shampoo_for(model, epsilon=1e-4))
    reference = shampoo_for(reference_model, epsilon=1e-4)
    changes = []
    for micro in range(8):
        before = [p.detach().clone() for p in model.parameters()]
        with accelerator.accumulate(model):
            x = batch(micro, size=2)
            accelerator.backward(model(input_ids=x, labels=x).loss)
            optimizer.step()
            optimizer.zero_grad()
        changes.append(any(not torch.equal(a, p) for a, p in zip(before, model.parameters())))
    assert changes == [False, False, False, True] * 2
    assert find_shampoo(optimizer).param_groups[0]["step"] == 2
    # the same as two steps on the concatenated batches (mean loss), up to rounding
    for step in range(2):
        x = torch.cat([batch(4 * step + k, size=2) for k in range(4)])
        reference_model(input_ids=x, labels=x).loss.backward()
        reference.step()
        reference.zero_grad()
    for p, q in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)  # steps are ~1e-2


def test_bf16_autocast_trains():
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = tiny_gpt2()
    model, optimizer = accelerator.prepare(model, shampoo_for(model))
    losses = []
    for step in range(12):
        x = batch(step)
        with accelerator.autocast():
            loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) < sum(losses[:3])


def test_gradscaler_skipped_step_leaves_shampoo_untouched():
    accelerator = Accelerator(cpu=True)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # fp16 loss scaling
    model = tiny_gpt2()
    model, optimizer = accelerator.prepare(model, shampoo_for(model))
    shampoo = find_shampoo(optimizer)

    def train_step(step: int, poison: bool = False) -> None:
        x = batch(step)
        loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss * float("inf") if poison else loss)
        optimizer.step()
        optimizer.zero_grad()

    for step in range(3):
        train_step(step)
    assert not optimizer.step_was_skipped
    state = snapshot(shampoo)
    params = [p.detach().clone() for p in model.parameters()]
    scale = accelerator.scaler.get_scale()
    train_step(3, poison=True)  # inf gradients: the scaler skips the step
    assert optimizer.step_was_skipped
    assert accelerator.scaler.get_scale() < scale
    assert_same_state(state, snapshot(shampoo))
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    train_step(4)
    assert not optimizer.step_was_skipped
    assert shampoo.param_groups[0]["step"] == 4


def test_save_and_load_state_single_process(tmp_path):
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(tiny_gpt2(), shampoo_for(tiny_gpt2()))
    handle = register_checkpoint_hook(accelerator, optimizer)
    for step in range(3):
        x = batch(step)
        accelerator.backward(model(input_ids=x, labels=x).loss)
        optimizer.step()
        optimizer.zero_grad()
    save_state(accelerator, str(tmp_path / "ckpt"))
    handle.remove()
    saved = torch.load(tmp_path / "ckpt" / "optimizer.bin", weights_only=True)
    fresh = shampoo_for(tiny_gpt2())
    fresh.load_state_dict(saved)
    assert_same_state(snapshot(find_shampoo(optimizer)), snapshot(fresh))
    with pytest.raises(ValueError):
        register_checkpoint_hook(accelerator)


WORKER = textwrap.dedent(
    '''
    """Two runs under Accelerate: uninterrupted, and resumed from a save_state checkpoint."""
    import json, os, sys
    import torch
    from accelerate import Accelerator
    from transformers import GPT2Config, GPT2LMHeadModel
    from hf_shampoo.integrations.accelerate import find_shampoo, register_checkpoint_hook
    from hf_shampoo.integrations.accelerate import save_state
    from hf_shampoo.describe_table import describe
    from hf_shampoo.factory import make_optimizer

    out = sys.argv[1]


    def make(accelerator):
        torch.manual_seed(0)
        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(config)
        optimizer = make_optimizer(model, lr=1e-2, betas=(0.9, 0.999), grafting="adam",
                                   precondition_frequency=2, max_preconditioner_dim=64,
                                   weight_decay=0.01)
        return accelerator.prepare(model, optimizer)


    def batch(step, rank):
        g = torch.Generator().manual_seed(1000 * step + rank)
        return (torch.randint(0, 64, (4, 1), generator=g) + torch.arange(16)) % 64


    def train(accelerator, model, optimizer, steps):
        losses = []
        for step in steps:
            x = batch(step, accelerator.process_index)
            loss = model(input_ids=x, labels=x).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
        return losses


    def saved_blocks(path):
        state = torch.load(path, weights_only=True)["state"]
        return sorted({(int(i), k.split(".")[0]) for i, e in state.items() for k in e})


    acc = Accelerator(cpu=True)
    model, optimizer = make(acc)
    losses_a = train(acc, model, optimizer, range(1, 4))
    acc.save_state(os.path.join(out, "step3"))  # plain: the optimizer gathers by itself
    losses_a += train(acc, model, optimizer, range(4, 6))
    inner = find_shampoo(optimizer)
    local = sorted({(int(i), k.split(".")[0]) for i, e in inner.state_dict()["state"].items()
                    for k in e})  # outside save_state, state_dict() stays this rank's own
    handle = register_checkpoint_hook(acc, optimizer)
    acc.save_state(os.path.join(out, "step5"))  # the hook (earlier versions) still works
    handle.remove()
    losses_a += train(acc, model, optimizer, range(6, 7))
    save_state(acc, os.path.join(out, "step6"))  # the helper: complete, and marked so
    params_a = [p.detach().clone() for p in model.parameters()]
    table = describe(optimizer)

    acc_b = Accelerator(cpu=True)
    model_b, optimizer_b = make(acc_b)
    acc_b.load_state(os.path.join(out, "step3"))
    losses_b = train(acc_b, model_b, optimizer_b, range(4, 7))
    same = all(torch.equal(a, b.detach()) for a, b in zip(params_a, model_b.parameters()))
    blocks = find_shampoo(optimizer).describe_blocks()
    if acc.is_main_process:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({
                "world_size": acc.num_processes,
                "ranks": sorted({b["rank"] for b in blocks}),
                "blocks": sorted({(b["param_index"], f"block_{b['block']}") for b in blocks}),
                "saved3": saved_blocks(os.path.join(out, "step3", "optimizer.bin")),
                "saved5": saved_blocks(os.path.join(out, "step5", "optimizer.bin")),
                "saved6": saved_blocks(os.path.join(out, "step6", "optimizer.bin")),
                "marked": [os.path.exists(os.path.join(out, s, "hf_shampoo_complete.json"))
                           for s in ("step3", "step6")],
                "local": local,
                "losses_a": losses_a,
                "losses_b": losses_b,
                "params_equal": same,
                "describe": table,
            }, f)
    if torch.distributed.is_initialized():
        from tests.helpers import leave_gloo_world  # the repository is on PYTHONPATH

        leave_gloo_world()
    '''
)


@pytest.mark.slow
def test_two_ranks_save_state_load_state_resumes_exactly(tmp_path):
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
        "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()), "-m", "hf_shampoo.run",
        str(tmp_path / "worker.py"),
        str(tmp_path),
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world_size"] == 2 and result["ranks"] == [0, 1]  # from Accelerate's state
    # every save holds every block: the plain accelerator.save_state too
    for saved in ("saved3", "saved5", "saved6"):
        assert result[saved] == result["blocks"], saved
    assert result["local"] != result["blocks"]  # ...which rank 0 alone does not hold
    assert result["marked"] == [False, True]  # only the helper marks a checkpoint complete
    assert result["losses_b"] == result["losses_a"][3:]
    assert result["params_equal"]
    assert result["losses_a"][-1] < result["losses_a"][0]
    last = result["describe"].splitlines()[-1]
    assert "rank 0:" in last and "rank 1:" in last
