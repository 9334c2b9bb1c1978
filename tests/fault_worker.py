"""A training run that a test kills, for tests/test_faults.py (run under ``torchrun
--max-restarts``): the HF Trainer or an Accelerate loop, each with DDP or FSDP2, on a tiny
GPT-2 with ``DistributedShampoo``, checkpointing every ``SAVE_EVERY`` steps and resuming
from the newest complete checkpoint when it starts.

    fault_worker.py TOOL LAYOUT FAULTS OUT_DIR

TOOL is ``trainer`` or ``accelerate``; LAYOUT ``ddp`` or ``fsdp2`` (on a CPU the Trainer and
Accelerate train without FSDP, so their Accelerator state is switched to FSDP2 by hand, as in
tests/trainer_fsdp_worker.py and tests/accelerate_fsdp_worker.py). FAULTS is ``none`` or a
comma-separated list ``KIND@STEP@RANK``, one per attempt of the job (``torchrun
--max-restarts``): attempt ``k`` SIGKILLs rank RANK at step STEP as the ``k``-th entry says,
where KIND is ``between`` (after the step, before its checkpoint), ``in_step`` (inside
``optimizer.step()``, after the rank has changed its blocks' state and before the updates
are exchanged) or ``in_save`` (while the step's checkpoint is being written: half of
``optimizer.pt`` / ``optimizer.bin`` on disk, or, under FSDP2, inside DCP's save of the
optimizer's shards). ``STOP_AFTER`` ends a run early (after that step's checkpoint), for runs
continued on another world size. Rank 0 appends the checkpoint each attempt resumed from to
``OUT_DIR/attempts.txt`` and at the end writes ``OUT_DIR/result_w{world}.pt``: the full
parameters and the full optimizer state.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

STEPS, SAVE_EVERY = 8, 2


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


ATTEMPT = env_int("TORCHELASTIC_RESTART_COUNT", 0)
STOP_AFTER = env_int("STOP_AFTER", STEPS)
FAULT, FAULT_STEP, FAULT_RANK = "none", 0, -1  # this attempt's, set by main()


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def faulty(fault: str) -> bool:
    """Whether this process is the one to kill in this attempt."""
    return fault != "none" and dist.get_rank() == FAULT_RANK


def kill_inside_step(shampoo, step_of) -> None:
    """SIGKILL inside ``optimizer.step()`` at step ``FAULT_STEP``: after this rank has
    updated its blocks' state, before the updates travel (the distributor's
    ``finish_step``)."""
    distributor = shampoo._ensure_layout() and shampoo._distributor
    finish_step = distributor.finish_step

    def finish_then_die(*args, **kwargs):
        if step_of() == FAULT_STEP:
            die()
        return finish_step(*args, **kwargs)

    distributor.finish_step = finish_then_die


def kill_while_saving(file_name: str | None, step_of) -> None:
    """SIGKILL while step ``FAULT_STEP``'s checkpoint is written: ``file_name`` (a
    ``torch.save`` file) left with half its bytes; or with None, inside DCP's save of the
    optimizer's shards (FSDP2), before this rank wrote its own."""
    if file_name is None:
        import torch.distributed.checkpoint as dcp

        dcp_save = dcp.save

        def dcp_save_then_die(*args, **kwargs):
            writer = kwargs.get("storage_writer")
            if "optimizer" in str(getattr(writer, "path", "")) and step_of() == FAULT_STEP:
                die()
            return dcp_save(*args, **kwargs)

        dcp.save = dcp_save_then_die
        return
    original = torch.save

    def save_half_then_die(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and Path(f).name == file_name \
                and step_of() == FAULT_STEP:
            import io

            buffer = io.BytesIO()
            original(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()
            with open(f, "wb") as out:
                out.write(data[: len(data) // 2])
            die()
        return original(obj, f, *args, **kwargs)

    torch.save = save_half_then_die


def make_model():
    from tests.trainer_fsdp_worker import make_model as tiny_gpt2

    return tiny_gpt2()


def data():
    starts = torch.randint(0, 64, (128, 1), generator=torch.Generator().manual_seed(1))
    return (starts + torch.arange(16)) % 64


OPTIM_ARGS = dict(precondition_frequency=2, max_preconditioner_dim=16, weight_decay=0.01)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def note_attempt(out: Path, resumed_from) -> None:
    if dist.get_rank() == 0:
        with open(out / "attempts.txt", "a") as f:
            f.write(f"{ATTEMPT} {dist.get_world_size()} "
                    f"{'-' if resumed_from is None else Path(resumed_from).name}\n")


def write_result(out: Path, model, shampoo, resumed_from) -> None:
    params = [full(p) for p in model.parameters()]
    shampoo.consolidate_state_dict(to=0)
    state = shampoo.state_dict()
    if dist.get_rank() == 0:
        torch.save({"params": params, "state": state["state"], "attempt": ATTEMPT,
                    "world": dist.get_world_size(),
                    "resumed_from": None if resumed_from is None else Path(resumed_from).name,
                    "step": int(state["param_groups"][0]["step"])},
                   out / f"result_w{dist.get_world_size()}.pt")


# ------------------------------------------------------------------ the Trainer
def run_trainer(layout: str, fault: str, out: Path) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    from hf_shampoo.integrations.accelerate import find_shampoo

    rows = data()
    dataset = [{"input_ids": row, "labels": row} for row in rows]
    run_dir = out / "run"
    optim_args = ",".join(f"{k}={v}" for k, v in OPTIM_ARGS.items())
    fsdp = {} if layout == "ddp" else dict(
        fsdp=True, fsdp_config={"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT"})
    args = TrainingArguments(
        output_dir=str(run_dir), optim="distributed_shampoo", optim_args=optim_args,
        use_cpu=True, report_to=[], max_steps=STEPS, save_steps=SAVE_EVERY,
        logging_steps=1, per_device_train_batch_size=4, learning_rate=1e-2,
        lr_scheduler_type="constant", disable_tqdm=True, seed=7, **fsdp)
    trainer = Trainer(model=make_model(), args=args, train_dataset=dataset)
    if layout == "fsdp2":
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        trainer.accelerator.state.distributed_type = DistributedType.FSDP
        trainer.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, state_dict_type="SHARDED_STATE_DICT",
            cpu_ram_efficient_loading=False)
        trainer.is_fsdp_enabled = True

    def step_now() -> int:  # the step being taken (optimizer.step) or saved
        return trainer.state.global_step + (0 if saving else 1)

    saving = False

    class Faults(TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            if fault == "in_step" and faulty(fault):
                kill_inside_step(find_shampoo(optimizer), step_now)

        def on_step_end(self, args, state, control, **kwargs):
            nonlocal saving
            if fault == "between" and faulty(fault) and state.global_step == FAULT_STEP:
                die()
            saving = True
            if state.global_step >= STOP_AFTER:
                control.should_save, control.should_training_stop = True, True

        def on_step_begin(self, args, state, control, **kwargs):
            nonlocal saving
            saving = False

    trainer.add_callback(Faults())
    if fault == "in_save" and faulty(fault):  # FSDP2: the optimizer's DCP shards
        kill_while_saving("optimizer.pt" if layout == "ddp" else None, step_now)
    resumed_from = get_last_checkpoint(str(run_dir)) if run_dir.is_dir() else None
    note_attempt(out, resumed_from)
    trainer.train(resume_from_checkpoint=resumed_from)
    write_result(out, trainer.model, find_shampoo(trainer.optimizer), resumed_from)


# ------------------------------------------------------------------ an Accelerate loop
def run_accelerate(layout: str, fault: str, out: Path) -> None:
    from accelerate import Accelerator

    from hf_shampoo.factory import make_optimizer
    from hf_shampoo.integrations.accelerate import (
        find_shampoo,
        latest_checkpoint,
        load_state,
        save_state,
    )

    if layout == "fsdp2":  # Accelerate's FSDP2 path, switched on by hand on a CPU
        from tests.accelerate_fsdp_worker import _accelerator

        accelerator = _accelerator("SHARDED_STATE_DICT", bf16=False)
    else:
        accelerator = Accelerator(cpu=True)
    as_set_up = getattr(accelerator, "as_fsdp", lambda: None)
    model = make_model()
    optimizer = make_optimizer(model, lr=1e-2, grafting="adam", **OPTIM_ARGS)
    model, optimizer = accelerator.prepare(model, optimizer)
    shampoo = find_shampoo(optimizer)
    root = out / "checkpoints"
    resumed_from = latest_checkpoint(root) if accelerator.is_main_process else None
    holder = [resumed_from]
    dist.broadcast_object_list(holder, src=0)
    resumed_from = holder[0]
    note_attempt(out, resumed_from)
    start = 0
    if resumed_from is not None:
        as_set_up()
        load_state(accelerator, resumed_from)
        start = int(Path(resumed_from).name.split("_")[1])
    current = [start]
    if fault == "in_step" and faulty(fault):
        kill_inside_step(shampoo, lambda: current[0])
    if fault == "in_save" and faulty(fault):
        kill_while_saving("optimizer.bin" if layout == "ddp" else None, lambda: current[0])
    rows = data()
    world, rank = dist.get_world_size(), dist.get_rank()
    per_rank = 8 // world if 8 % world == 0 else 4
    for step in range(start + 1, min(STEPS, STOP_AFTER) + 1):
        current[0] = step
        batch = rows[(step * 8 + rank * per_rank) % 120:][:per_rank]
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if fault == "between" and faulty(fault) and step == FAULT_STEP:
            die()
        if step % SAVE_EVERY == 0:
            as_set_up()
            save_state(accelerator, root / f"checkpoint_{step}", safe_serialization=False)
    write_result(out, model, shampoo, resumed_from)


def launch(tool: str, layout: str, faults: str, out: Path, nproc: int = 2,
           restarts: int = 3, timeout: int = 400, **env_extra: str) -> subprocess.CompletedProcess:
    """This script under ``torchrun --standalone --max-restarts RESTARTS`` in a clean
    environment (no rank variables, one thread per rank, this checkout first on the path,
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` as docs/checkpoints.md advises); the finished
    process. Used by tests/test_faults.py and benchmarks/fault_table.py."""
    from tests.helpers import ROOT, launcher_env

    env = launcher_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **env_extra)
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         str(nproc), "--max-restarts", str(restarts), "--monitor-interval", "0.2",
         str(Path(__file__).resolve()), tool, layout, faults, str(out)],
        cwd=ROOT, env=env, timeout=timeout, capture_output=True, text=True)


def attempts(out: Path) -> list[list[str]]:
    """``[attempt, world size, checkpoint resumed from or "-"]`` per attempt of the job."""
    return [line.split() for line in (Path(out) / "attempts.txt").read_text().splitlines()]


def differences(got: Path, expected: Path) -> list[str]:
    """Where two results differ (step, a parameter, an optimizer state tensor); empty when
    they are equal bit for bit."""
    a, b = torch.load(got, weights_only=True), torch.load(expected, weights_only=True)
    found = [] if a["step"] == b["step"] else [f"step {a['step']} != {b['step']}"]
    if len(a["params"]) != len(b["params"]):
        return found + ["a different number of parameters"]
    found += [f"parameter {i}: largest difference {(x - y).abs().max().item():.3g}"
              for i, (x, y) in enumerate(zip(a["params"], b["params"])) if not torch.equal(x, y)]
    if a["state"].keys() != b["state"].keys():
        return found + ["state of different parameters"]
    for index, entry in b["state"].items():
        if entry.keys() != a["state"][index].keys():
            found.append(f"state of parameter {index}: other keys")
            continue
        found += [f"state {index}.{key}" for key, tensor in entry.items()
                  if not torch.equal(a["state"][index][key], tensor)]
    return found


def main(tool: str, layout: str, faults: str, out: str) -> None:
    global FAULT, FAULT_STEP, FAULT_RANK
    planned = [] if faults == "none" else faults.split(",")
    if ATTEMPT < len(planned):
        kind, step, rank = planned[ATTEMPT].split("@")
        FAULT, FAULT_STEP, FAULT_RANK = kind, int(step), int(rank)
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import hf_shampoo  # noqa: F401 - registers optim="distributed_shampoo"

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (run_trainer if tool == "trainer" else run_accelerate)(layout, FAULT, out_dir)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
    # everything is written and the group destroyed: leave without the interpreter's
    # teardown, where a C++ thread of the stack still joinable was seen to abort a rank
    # ("terminate called without an active exception") after a complete run
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
