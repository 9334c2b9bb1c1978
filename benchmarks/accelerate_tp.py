"""Accelerate's ND-parallel path with hf_shampoo, stage by stage (docs/parallelism.md).

Under ``torchrun --nproc_per_node N``: ``Accelerator(parallelism_config=ParallelismConfig(
dp_shard_size, tp_size))`` (FSDP2 version 2), a tiny Llama saved with ``save_pretrained``
and loaded with Accelerate's tensor-parallel plan (``tp_plan="auto"``, the device mesh's
``tp`` dim), ``accelerator.prepare(model, optimizer)`` with ``DistributedShampoo``
(``--optimizer shampoo``) or the ``muon`` preset, then a few steps. Every stage prints
``ok`` or the exception that stopped it (type, message, innermost frame), so that one run
on a GPU machine says exactly how far Accelerate gets; with ``--device cpu`` it records
Accelerate's refusal of a CPU mesh. Nothing is downloaded.

    torchrun --nproc_per_node 2 -m benchmarks.accelerate_tp --tp-size 2 --device cuda
"""

from __future__ import annotations

import argparse
import os
import tempfile
import traceback

import torch


def stage(name: str, fn):
    """Run ``fn``; print ``name: ok`` or where and why it failed; return its value or None."""
    try:
        value = fn()
    except Exception as error:  # noqa: BLE001 - reported, that is the point
        frame = traceback.extract_tb(error.__traceback__)[-1]
        print(f"[rank {os.environ.get('RANK', '0')}] {name}: FAILED {type(error).__name__}: "
              f"{error} ({frame.filename}:{frame.lineno})", flush=True)
        return None
    print(f"[rank {os.environ.get('RANK', '0')}] {name}: ok", flush=True)
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--optimizer", default="shampoo", choices=["shampoo", "muon"])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from hf_shampoo import make_optimizer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = min(args.tp_size, world)
    config = ParallelismConfig(dp_shard_size=world // tp, tp_size=tp)
    accelerator = stage(f"Accelerator(ParallelismConfig(dp_shard_size={world // tp}, "
                        f"tp_size={tp}), fsdp_version=2, cpu={args.device == 'cpu'})",
                        lambda: Accelerator(
                            cpu=args.device == "cpu", parallelism_config=config,
                            fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)))
    if accelerator is None:
        return
    print(f"[rank {accelerator.process_index}] mesh: {accelerator.torch_device_mesh}", flush=True)
    path = os.path.join(tempfile.gettempdir(), "hf_shampoo_accelerate_tp_llama")
    if accelerator.is_main_process:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=4, vocab_size=128,
                                     tie_word_embeddings=False)).save_pretrained(path)
    accelerator.wait_for_everyone()
    model = stage("from_pretrained(tp_plan='auto', device_mesh=accelerator.torch_device_mesh)",
                  lambda: AutoModelForCausalLM.from_pretrained(
                      path, tp_plan="auto", tp_size=tp,
                      device_mesh=accelerator.torch_device_mesh))
    if model is None:
        return
    preset = "muon" if args.optimizer == "muon" else "transformer"
    optimizer = make_optimizer(model, preset=preset, lr=1e-3)
    prepared = stage("accelerator.prepare(model, optimizer)",
                     lambda: accelerator.prepare(model, optimizer))
    if prepared is None:
        return
    model, optimizer = prepared
    for name, p in list(model.named_parameters())[:4]:
        placements = getattr(p, "placements", "plain")
        print(f"[rank {accelerator.process_index}] {name}: {tuple(p.shape)} {placements}",
              flush=True)
    generator = torch.Generator().manual_seed(0)

    def train():
        losses = []
        for _ in range(args.steps):
            tokens = torch.randint(0, 128, (4, 16), generator=generator).to(accelerator.device)
            loss = model(input_ids=tokens, labels=tokens).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(round(float(loss), 5))
        return losses

    losses = stage(f"{args.steps} steps", train)
    inner = getattr(optimizer, "optimizer", optimizer)
    print(f"[rank {accelerator.process_index}] losses {losses}, distributor "
          f"{type(getattr(inner, 'distributor', None)).__name__}", flush=True)


if __name__ == "__main__":
    main()
