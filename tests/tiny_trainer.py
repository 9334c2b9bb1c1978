"""The tiny Trainer runs the Trainer tests share (tests/test_integration_transformers.py,
test_muon_integration.py, test_trainer_metrics.py, test_averaging.py): a one-layer GPT-2,
its ``TrainingArguments`` and data, the optimizer and group the Trainer built, and an
unmodified HF training script (``WORKER``) trained, resumed from its checkpoint and checked
bit for bit under ``hf_shampoo.run`` on one or more ranks."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from hf_shampoo import DistributedShampoo
from tests.helpers import run

VOCAB = 64

# An HF-style training script that knows nothing of hf_shampoo: it trains a tiny GPT-2 to
# max_steps saving at resume_step, then resumes a fresh model from that checkpoint, and has
# rank 0 report both runs' per-step losses, whether the final parameters are equal, which
# blocks exist and which the saved optimizer.pt holds (loaded with weights_only=True).
WORKER = textwrap.dedent(
    '''
    import copy, json, os, sys
    from dataclasses import dataclass, field
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer
    from transformers import TrainingArguments


    @dataclass
    class ScriptArguments:
        result: str = field(default="result.json")
        resume_step: int = field(default=4)


    def make_model():
        torch.manual_seed(0)
        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(config)


    def main():
        parser = HfArgumentParser((ScriptArguments, TrainingArguments))
        script, args = parser.parse_args_into_dataclasses()
        starts = torch.randint(0, 64, (96, 1), generator=torch.Generator().manual_seed(1))
        ids = (starts + torch.arange(16)) % 64  # counting sequences: learnable in a few steps
        data = [{"input_ids": row, "labels": row} for row in ids]
        trainer = Trainer(model=make_model(), args=args, train_dataset=data)
        trainer.train()
        shampoo = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        blocks = shampoo.describe_blocks()
        losses_a = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        params_a = [p.detach().clone() for p in trainer.model.parameters()]
        checkpoint = os.path.join(args.output_dir, f"checkpoint-{script.resume_step}")
        saved = torch.load(os.path.join(checkpoint, "optimizer.pt"), weights_only=True)
        saved_blocks = sorted({(int(i), k.split(".")[0]) for i, e in saved["state"].items()
                               for k in e})

        args_b = copy.deepcopy(args)
        args_b.output_dir = args.output_dir + "-resumed"
        resumed = Trainer(model=make_model(), args=args_b, train_dataset=data)
        resumed.train(resume_from_checkpoint=checkpoint)
        losses_b = {h["step"]: h["loss"] for h in resumed.state.log_history if "loss" in h}
        same = all(torch.equal(a, b.detach()) for a, b in zip(params_a, resumed.model.parameters()))
        if trainer.args.process_index == 0:
            with open(script.result, "w") as f:
                json.dump({
                    "optimizer": type(shampoo).__name__,
                    "world_size": trainer.args.world_size,
                    "ranks": sorted({b["rank"] for b in blocks}),
                    "blocks": sorted({(b["param_index"], f"block_{b['block']}") for b in blocks}),
                    "saved_blocks": saved_blocks,
                    "losses_a": losses_a,
                    "losses_b": losses_b,
                    "params_equal": same,
                    "callbacks": [type(c).__name__ for c in trainer.callback_handler.callbacks],
                }, f)
        if torch.distributed.is_initialized():
            from tests.helpers import leave_gloo_world  # the repository is on PYTHONPATH

            leave_gloo_world()


    if __name__ == "__main__":
        main()
    '''
)


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16,
        bos_token_id=0, eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def training_args(tmp_path, **kwargs) -> TrainingArguments:
    base = {"output_dir": str(tmp_path / "out"), "use_cpu": True, "report_to": [], "max_steps": 3,
                "per_device_train_batch_size": 2, "save_strategy": "no", "disable_tqdm": True}
    return TrainingArguments(**{**base, **kwargs})


def dataset(n: int = 12) -> list[dict]:
    ids = torch.randint(0, VOCAB, (n, 16), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def shampoo_of(trainer) -> DistributedShampoo:
    optimizer = trainer.create_optimizer()
    assert isinstance(optimizer, DistributedShampoo)
    return optimizer


def group_of(optimizer: DistributedShampoo, name: str) -> dict:
    return next(g for g in optimizer.param_groups if name in g["param_names"])


WORKER_ARGS = [
    "--optim", "distributed_shampoo",
    "--optim_args", "precondition_frequency=2,max_preconditioner_dim=64",
    "--use_cpu", "--report_to", "none", "--max_steps", "8", "--save_steps", "4",
    "--logging_steps", "1", "--per_device_train_batch_size", "4", "--learning_rate", "1e-2",
    "--disable_tqdm", "true", "--seed", "7",
]


def check_resume(result_path: Path, world_size: int) -> dict:
    result = json.loads(result_path.read_text())
    assert result["optimizer"] == "DistributedShampoo"
    assert result["world_size"] == world_size
    assert result["ranks"] == list(range(world_size))
    assert "ShampooCheckpointCallback" in result["callbacks"]
    assert result["saved_blocks"] == result["blocks"]  # every rank's blocks in optimizer.pt
    for step in range(5, 9):  # the resumed steps: the same losses, bit for bit
        assert result["losses_b"][str(step)] == result["losses_a"][str(step)], step
    assert result["params_equal"]
    return result


def train_and_resume(tmp_path: Path, worker_args: list[str], ranks: int) -> dict:
    """``WORKER`` under ``hf_shampoo.run`` with ``worker_args`` on ``ranks`` processes
    (``torch.distributed.run`` for more than one): its run resumed from its checkpoint,
    checked by ``check_resume``."""
    (tmp_path / "train.py").write_text(WORKER)
    launcher = [] if ranks == 1 else ["-m", "torch.distributed.run", "--standalone",
                                      "--nproc_per_node", str(ranks)]
    run([sys.executable, *launcher, "-m", "hf_shampoo.run", str(tmp_path / "train.py"),
         "--result", str(tmp_path / "result.json"), "--output_dir", str(tmp_path / "out"),
         *worker_args])
    return check_resume(tmp_path / "result.json", ranks)
