"""The Trainer with FSDP2 and ``optim="distributed_shampoo"`` on gloo, for
tests/test_sharded_integrations.py (run with ``torchrun --nproc_per_node 2``).

On a CPU the Trainer silently trains without FSDP (Accelerate enables FSDP for GPU backends
only), so after building each Trainer the script switches its Accelerator state to FSDP2
with the plugin the Trainer would use; everything else is the Trainer's own code: it
shards the model in ``prepare`` (swapping the optimizer's parameters for DTensors), saves
with ``save_fsdp_optimizer`` and resumes with ``load_fsdp_optimizer``. A run saved at step 4
and resumed must give the uninterrupted run's losses and parameters, bit for bit.

With a third argument ``cuda`` (tests/test_gpu.py, ``torchrun --nproc_per_node 1`` on a
GPU) nothing is switched: the Trainer enables FSDP2 itself, on NCCL, and the result also
says which distributed type and device it used.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import hf_shampoo  # noqa: F401 - registers optim="distributed_shampoo"


def make_model():
    torch.manual_seed(0)
    # eager attention: SDPA's fused backward kernels on a GPU may add in any order
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
                        attn_implementation="eager")
    return GPT2LMHeadModel(config)


def trainer(output_dir: str, state_dict_type: str, data, device: str = "cpu") -> Trainer:
    args = TrainingArguments(
        output_dir=output_dir, optim="distributed_shampoo",
        optim_args="precondition_frequency=2,max_preconditioner_dim=16,weight_decay=0.01",
        use_cpu=device == "cpu", report_to=[], max_steps=8, save_steps=4, logging_steps=1,
        per_device_train_batch_size=4, learning_rate=1e-2, disable_tqdm=True, seed=7,
        fsdp=True, fsdp_config={"fsdp_version": 2, "state_dict_type": state_dict_type})
    t = Trainer(model=make_model(), args=args, train_dataset=data)
    if device != "cpu":
        return t  # the Trainer's own FSDP2 set-up, untouched
    t.accelerator.state.distributed_type = DistributedType.FSDP
    t.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, state_dict_type=state_dict_type, cpu_ram_efficient_loading=False)
    t.is_fsdp_enabled = True
    return t


def full_params(model):
    return [p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for p in model.parameters()]


def main(out: str, state_dict_type: str, device: str = "cpu") -> None:
    starts = torch.randint(0, 64, (96, 1), generator=torch.Generator().manual_seed(1))
    ids = (starts + torch.arange(16)) % 64
    data = [{"input_ids": row, "labels": row} for row in ids]
    a = trainer(os.path.join(out, "a"), state_dict_type, data, device)
    a.train()
    shampoo = getattr(a.optimizer, "optimizer", a.optimizer)
    losses_a = {h["step"]: h["loss"] for h in a.state.log_history if "loss" in h}
    params_a = full_params(a.model)
    b = trainer(os.path.join(out, "b"), state_dict_type, data, device)
    b.train(resume_from_checkpoint=os.path.join(out, "a", "checkpoint-4"))
    losses_b = {h["step"]: h["loss"] for h in b.state.log_history if "loss" in h}
    params_b = full_params(b.model)
    if dist.get_rank() == 0:
        with open(os.path.join(out, f"result_{state_dict_type}.json"), "w") as f:
            json.dump({
                "distributor": type(shampoo._distributor).__name__,
                "dtensor_params": sum(hasattr(p, "full_tensor") for p in a.model.parameters()),
                "losses_a": losses_a, "losses_b": losses_b,
                "params_equal": all(torch.equal(x, y) for x, y in zip(params_a, params_b)),
                "distributed_type": str(a.accelerator.state.distributed_type),
                "fsdp_version": getattr(a.accelerator.state.fsdp_plugin, "fsdp_version", None),
                "param_devices": sorted({str(p.device) for p in a.model.parameters()}),
                "backend": dist.get_backend(),
            }, f)
    # leave the group before the interpreter ends: its threads, still running at exit,
    # were seen to abort a rank ("terminate called without an active exception"), also
    # after destroy_process_group(): no finalization at all
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter finalization: gloo's threads were seen to abort it


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[3:4] == ["cuda"]:  # the same kernels in the same order in both runs
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    main(*sys.argv[1:4])
