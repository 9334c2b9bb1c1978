"""The Trainer with ``deepspeed=<dict>`` and hf_shampoo's ``optim`` names on gloo, for
tests/test_deepspeed.py (``torchrun --nproc_per_node 2``, ``DS_ACCELERATOR=cpu``).

``python tests/trainer_deepspeed_worker.py OUT_DIR``: for ``distributed_shampoo`` and
``distributed_muon``, 6 steps under ZeRO 0 and ZeRO 2 (fp32); for Shampoo under ZeRO 2 also
the run saved at step 3 by the Trainer (``save_steps``) and resumed with
``resume_from_checkpoint``. Rank 0 writes ``OUT_DIR/result.pt``.
"""

import os
import sys
import traceback
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

import hf_shampoo  # noqa: E402,F401 - registers the optim names

OPTIM_ARGS = {"distributed_shampoo": "max_preconditioner_dim=32,precondition_frequency=1,"
                                     "start_preconditioning_step=1,weight_decay=0.01",
              "distributed_muon": "weight_decay=0.01"}


def make_model():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128,
                                      n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


def trainer(out: str, optim: str, stage: int, data, save: bool = False) -> Trainer:
    config = {"zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "bf16": {"enabled": "auto"}}
    args = TrainingArguments(
        output_dir=out, optim=optim, optim_args=OPTIM_ARGS[optim], deepspeed=config,
        max_steps=6, per_device_train_batch_size=4, learning_rate=1e-2, max_grad_norm=0.0,
        logging_steps=1, report_to=[], disable_tqdm=True, seed=0, dataloader_num_workers=0,
        save_strategy="steps" if save else "no", save_steps=3, save_only_model=False)
    return Trainer(model=make_model(), args=args, train_dataset=data)


def reset() -> None:
    from accelerate.state import AcceleratorState, GradientState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    unset_hf_deepspeed_config()


def run(t: Trainer, **train_kwargs) -> dict:
    t.train(**train_kwargs)
    shampoo = t.optimizer
    while not isinstance(shampoo, hf_shampoo.DistributedShampoo):
        shampoo = shampoo.optimizer
    result = {"losses": {h["step"]: h["loss"] for h in t.state.log_history if "loss" in h},
              "params": [p.detach().clone() for p in t.model.parameters()],
              "distributor": type(shampoo._distributor).__name__,
              "step": shampoo._groups[0]["step"]}
    reset()
    return result


def main(out: str) -> None:
    ids = torch.randint(0, 128, (64, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": x, "labels": x} for x in ids]
    result: dict = {}
    try:
        for optim in OPTIM_ARGS:
            for stage in (0, 2):
                save = optim == "distributed_shampoo" and stage == 2
                result[f"{optim}_z{stage}"] = run(
                    trainer(os.path.join(out, f"{optim}_z{stage}"), optim, stage, data, save))
        resumed = trainer(os.path.join(out, "resumed"), "distributed_shampoo", 2, data)
        result["resumed"] = run(resumed, resume_from_checkpoint=os.path.join(
            out, "distributed_shampoo_z2", "checkpoint-3"))
    except Exception:
        result["error"] = traceback.format_exc()
    if dist.get_rank() == 0:
        torch.save(result, os.path.join(out, "result.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
