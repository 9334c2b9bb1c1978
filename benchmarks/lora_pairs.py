"""LoRA adapter pairs: the factorization-aware preconditioner (``preconditioner=
"riemannian_lora"``, docs/lora.md) against AdamW, the presets' adapter rule, full factors
and SOAP, with the ablation's training loop, learning-rate sweeps and reports. Tasks: the
ablation's GPT-2 ``lora`` task, and ``vit``: LoRA adapters (peft r = 4 on ``qkv``, ``proj``,
``fc1``, ``fc2`` and the patch conv; base and head frozen) of a small timm ViT trained on
upright digits, fine-tuned on the digits turned by 90°.

    python -m benchmarks.lora_pairs --tasks vit
    python -m benchmarks.lora_pairs --tasks lora --optimizers "Riemannian LoRA (scaled AdamW)"
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
from torch import nn

from benchmarks import ablation
from benchmarks.ablation import Optimizer, Task
from benchmarks.configs import SHAMPOO, SOAP
from benchmarks.harness import train_loop, warmup_cosine
from benchmarks.tasks import classification_parts, digits_split, upsample
from hf_shampoo.optional import require

# Adam's hyperparameters as AdamW's runs (betas 0.9 / 0.999, eps 1e-8, decay 1e-4); the
# adapters get the pair preconditioner through the module rules' overrides, as a user would
RIEMANN = dict(betas=(0.9, 0.999), grafting="adam", grafting_beta2=0.999,
               grafting_epsilon=1e-8, weight_decay=1e-4, epsilon=1e-6,
               overrides={"*lora_*": {"preconditioner": "riemannian_lora"}})
NEW = {
    "Riemannian LoRA (scaled AdamW)": Optimizer("shampoo_modules", RIEMANN,
                                                tasks=("lora", "vit")),
    # the regularizer delta (relative to the Gram matrix's mean eigenvalue) larger
    "Riemannian LoRA (scaled AdamW, delta 1e-2)": Optimizer(
        "shampoo_modules", dict(RIEMANN, epsilon=1e-2), tasks=("lora", "vit"), default=False),
    # the paper's scaled GD with momentum (betas[0]'s filter): no second moment at all
    # (grafting "sgd" is the identity; None would get the rule's Adam)
    "Riemannian LoRA (scaled SGD, momentum 0.9)": Optimizer(
        "shampoo_modules", dict(RIEMANN, grafting="sgd"), lrs=(0.1, 0.3, 1.0),
        tasks=("lora", "vit"), default=False),
}
# Sketchy on the adapters (docs/sketchy.md): each adapter's long side a rank-k
# Frequent-Directions sketch, the short side (r = 4 <= the threshold) a full factor; the
# other parameters as the module rules give them; Meta's refresh schedule, as the other rows
SKETCH_THRESHOLD = 8
for rank in (2, 4, 8):
    NEW[f"Sketchy adapters (long side rank {rank})"] = Optimizer(
        "shampoo_modules", dict(SHAMPOO, refresh_schedule="all", overrides={"*lora_*": {
            "preconditioner": "sketchy", "sketch_rank": rank,
            "sketch_threshold": SKETCH_THRESHOLD, "diagonal_aspect": None,
            "epsilon": 1e-7}}),  # the reference's (relative) epsilon
        tasks=("lora", "vit"), default=False)
COMPARED = ("AdamW", "Shampoo (Adam grafting)", "Shampoo (Adam grafting, module rules)",
            "SOAP (eigenvalue-corrected)")
for name in COMPARED:  # the ablation's optimizers, on the ViT task as well
    entry = ablation.OPTIMIZERS[name]
    ablation.OPTIMIZERS[name] = Optimizer(entry.kind, entry.keywords, entry.lrs,
                                          (*entry.tasks, "vit"), entry.default, entry.schedule)
ablation.OPTIMIZERS.update(NEW)
for name in list(ablation.OPTIMIZERS):  # the rest stay on their own tasks
    if name not in COMPARED and name not in NEW:
        del ablation.OPTIMIZERS[name]
assert SHAMPOO and SOAP  # the ablation's settings, used through its OPTIMIZERS


# --------------------------------------------------------------------------- ViT task
def make_vit(seed: int) -> nn.Module:
    """timm's VisionTransformer: 16×16 gray images, patch 4 (16 tokens), width 64, 2
    blocks of 4 heads, 10 classes."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(seed)
    return VisionTransformer(img_size=16, patch_size=4, in_chans=1, num_classes=10,
                             embed_dim=64, depth=2, num_heads=4, mlp_ratio=2.0)


def vit_base(x: torch.Tensor, y: torch.Tensor, steps: int, batch: int) -> nn.Module:
    """The ViT every LoRA run starts from: AdamW (lr 3e-3, warm-up and cosine) on the
    upright digits, seed 0."""
    model = make_vit(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    g = torch.Generator().manual_seed(12345)
    batches = [torch.randint(0, len(y), (batch,), generator=g) for _ in range(steps)]
    train_loop(model, opt, batches, lambda model, i: nn.functional.cross_entropy(model(x[i]), y[i]),
               warmup_cosine(steps))
    return model


def make_vit_lora(base: nn.Module, seed: int, r: int = 4) -> nn.Module:
    peft = require("peft", "benchmarks.lora_pairs")
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0,
                             target_modules=["qkv", "proj", "fc1", "fc2"])
    return peft.get_peft_model(copy.deepcopy(base), config)


def vit_task(args) -> Task:
    x, y, xt, yt = digits_split(0)
    x, xt = upsample(x, 16), upsample(xt, 16)
    base = vit_base(x, y, args.vit_base_steps, args.batch_size)
    # the fine-tuning task: the same digits turned by 90 degrees
    rx, rxt = torch.rot90(x, 1, (2, 3)), torch.rot90(xt, 1, (2, 3))
    batches, loss, evaluate = classification_parts(rx, y, rxt, yt, args.batch_size)
    sample = make_vit_lora(base, 0)
    trainable = sum(p.numel() for p in sample.parameters() if p.requires_grad)
    total = sum(p.numel() for p in sample.parameters())
    before = evaluate(sample)
    with torch.no_grad():
        upright = (base(xt).argmax(1) == yt).float().mean().item()
    return Task("vit", f"LoRA (rank 4 on qkv/proj/fc1/fc2 and the patch conv, "
                f"{trainable / 1e3:.1f}k trainable of {total / 1e3:.0f}k) fine-tune of a timm "
                f"ViT (16×16 digits, patch 4, width 64, 2 blocks) trained "
                f"{args.vit_base_steps} steps with AdamW on upright digits (test acc "
                f"{upright:.3f}), on the digits turned by 90° (before: test loss "
                f"{before['test loss']:.3f}, acc {before['test acc']:.3f}), batch "
                f"{args.batch_size}", lambda seed: make_vit_lora(base, seed), batches, loss,
                evaluate, "test loss", measure_state=True)


# ------------------------------------------------------------------------------ main
def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["vit"], choices=["lora", "vit"])
    parser.add_argument("--steps", type=int, default=None,
                        help="default: 300 (lora, as the ablation), 200 (vit)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--optimizers", nargs="*", default=None,
                        help=f"only these (names: {', '.join(ablation.OPTIMIZERS)})")
    parser.add_argument("--lr", type=float, default=None, help="one lr, no sweep")
    parser.add_argument("--max-lr-points", type=int, default=5)
    parser.add_argument("--vit-base-steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64, help="ViT batch")
    parser.add_argument("--out", default=os.path.join("outputs", "lora-pairs"))
    parser.add_argument("--smoke", action="store_true", help="toy size, seconds")
    ours = parser.parse_args(argv)
    unknown = set(ours.optimizers or ()) - set(ablation.OPTIMIZERS)
    if unknown:
        parser.error(f"--optimizers: unknown {sorted(unknown)}")
    # the ablation's own settings for everything else (GPT-2 width, batches, base steps)
    args = ablation.parse(["--tasks", "lora", "--ablation-tasks"]
                          + (["--smoke"] if ours.smoke else []))
    args.seeds, args.optimizers, args.lr = ours.seeds, ours.optimizers, ours.lr
    args.max_lr_points, args.out, args.tasks = ours.max_lr_points, ours.out, ours.tasks
    args.vit_base_steps, args.batch_size = ours.vit_base_steps, ours.batch_size
    args.lora_steps = ours.steps or args.steps
    args.vit_steps = ours.steps or (args.steps if ours.smoke else 200)
    if ours.smoke:
        args.vit_base_steps, args.batch_size = 20, 16
    return args


def main(argv=None) -> None:
    args = parse(argv)
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(1)
    records = []
    for name in args.tasks:
        args.steps = args.lora_steps if name == "lora" else args.vit_steps
        task = ablation.lora_task(args) if name == "lora" else vit_task(args)
        records.append(ablation.run_task(task, args))
    ablation.publish(records, ablation.header(), args, "lora_pairs.json")


if __name__ == "__main__":
    main()
