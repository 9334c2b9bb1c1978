"""Optimizer state of LoRA adapters (peft, r = 16 on every linear layer) of a 7B and a 70B
Llama, under each rule, computed by ``describe_blocks()`` on a meta-device model (nothing
is allocated): AdamW (8 bytes per trainable element), the presets' adapter rule
(``make_optimizer``: the long side diagonal), full factors (``DistributedShampoo`` on
``model.parameters()``, at the ablation's ``max_preconditioner_dim=128`` and at the
default 1024), the pair preconditioner (``preconditioner="riemannian_lora"``) and Sketchy
adapters (the long side a rank-k sketch); ``--full``: the whole model trained, AdamW against
Shampoo (32- and 4-bit) and ``memory="sketch"``. Per rank of 8: the total / 8 (the owners
balance the state to within one block).

    python -m benchmarks.lora_memory            # a table in markdown
    python -m benchmarks.lora_memory --full     # the whole model trained, no adapters
"""

from __future__ import annotations

import sys

import torch

from benchmarks.common import table_head, table_row
from benchmarks.configs import SHAMPOO
from hf_shampoo import DistributedShampoo
from hf_shampoo.factory import make_optimizer
from hf_shampoo.optional import require

MODELS = {  # Llama 2 7B and 70B shapes
    "7B": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, vocab_size=32000),
    "70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, vocab_size=32000),
}


def lora_model(shape: dict, r: int = 16) -> torch.nn.Module:
    peft = require("peft", "benchmarks.lora_memory")
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**shape))
        return peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=2 * r,
                                                          target_modules="all-linear"))


def state_bytes(opt) -> int:
    return sum(row["state_bytes"] for row in opt.describe_blocks())


def rules(model) -> dict[str, int]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in trainable)
    return {
        "AdamW": 8 * n,
        "presets' rule (make_optimizer: long side diagonal)": state_bytes(
            make_optimizer(model, **SHAMPOO)),
        "full factors, max_preconditioner_dim 128": state_bytes(
            DistributedShampoo(trainable, **SHAMPOO)),
        "full factors, max_preconditioner_dim 1024 (default)": state_bytes(
            DistributedShampoo(trainable, **dict(SHAMPOO, max_preconditioner_dim=1024))),
        "riemannian_lora (pairs)": state_bytes(make_optimizer(
            model, overrides={"*lora_*": {"preconditioner": "riemannian_lora"}},
            **SHAMPOO)),
        **{f"sketchy adapters (blocks of 128; long side rank {k}, short side full)": state_bytes(
            make_optimizer(model, overrides={"*lora_*": {
                "preconditioner": "sketchy", "sketch_rank": k, "sketch_threshold": 16,
                "diagonal_aspect": None}}, **SHAMPOO)) for k in (4, 16)},
    }


def full_model_rules(model) -> dict[str, int]:
    """The whole model trained (no adapters), blocks of 1024 (the default), Adam grafting."""
    kwargs = dict(SHAMPOO, max_preconditioner_dim=1024)
    n = sum(p.numel() for p in model.parameters())
    return {
        "AdamW": 8 * n,
        "Shampoo (make_optimizer, full factors)": state_bytes(make_optimizer(model, **kwargs)),
        "Shampoo, 4-bit factors and roots": state_bytes(
            make_optimizer(model, quantization="4bit", **kwargs)),
        **{f"Sketchy (make_optimizer(memory='sketch'), rank {k})": state_bytes(
            make_optimizer(model, memory="sketch", sketch_rank=k, **kwargs))
           for k in (64, 256)},
        **{f"Sketchy, 4-bit bases (memory='sketch', quantization='4bit'), rank {k}":
           state_bytes(make_optimizer(model, memory="sketch", sketch_rank=k,
                                      quantization="4bit", **kwargs))
           for k in (256, 512)},
    }


def full_model(shape: dict) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**shape))


def main() -> None:
    full = "--full" in sys.argv[1:]
    results = {}
    for name, shape in MODELS.items():
        model = full_model(shape) if full else lora_model(shape)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        results[name] = (trainable, full_model_rules(model) if full else rules(model))
        print(f"{name}: {trainable / 1e6:.1f}M trainable", file=sys.stderr, flush=True)
    names = list(next(iter(results.values()))[1])
    what = "parameters" if full else "adapter parameters"
    print(table_head("rule", *(f"{m} ({t / 1e6:.1f}M {what}): all / per rank of 8"
                               for m, (t, _) in results.items())))
    for rule in names:
        cells = []
        for _, (trainable, sizes) in results.items():
            b = sizes[rule]
            cells.append(f"{b / 2**30:.2f} GiB / {b / 8 / 2**30:.2f} GiB "
                         f"({b / (8 * trainable):.2f}× AdamW)")
        print(table_row(rule, *cells))


if __name__ == "__main__":
    main()
