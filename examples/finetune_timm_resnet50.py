"""Fine-tune a timm model (ResNet-50 by default) with Distributed Shampoo under Accelerate.

The optimizer comes from timm's factory, ``timm.optim.create_optimizer_v2(model,
opt="shampoo", ...)``, so it gets timm's parameter groups (no weight decay on biases and
norms, optional layer decay). The default data are scikit-learn's bundled 8x8 digits,
upsampled to ``--image-size`` with 3 channels (no download); ``--dataset NAME`` trains on a
Hugging Face image-classification dataset instead. The run ends with a summary: loss at
start and end, step and optimizer-step times, optimizer state bytes on every rank, the
blocks each rank owns and the preconditioner's health (``optimizer.metrics()``,
docs/metrics.md).

Launch (every rank runs this file; the blocks are spread over the ranks):

    # GPUs (one process per GPU)
    accelerate launch --multi_gpu --num_processes 2 examples/finetune_timm_resnet50.py
    torchrun --nproc_per_node 2 examples/finetune_timm_resnet50.py          # same thing
    # CPU only: `accelerate launch --cpu --num_processes 2` starts ONE process, so use
    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        examples/finetune_timm_resnet50.py --image-size 32 --batch-size 16 --steps 30
    # one process
    python examples/finetune_timm_resnet50.py --model resnet18
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Iterator
from typing import Any

import timm
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from torch.utils.data import DataLoader, Dataset, TensorDataset
from tqdm.auto import tqdm

import hf_shampoo  # noqa: F401  (registers opt="shampoo" / "soap" with timm)
from hf_shampoo.integrations.timm import register

register()  # no-op when `import hf_shampoo` has already done it


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50", help="timm model name (default: resnet50)")
    p.add_argument("--pretrained", action="store_true", help="load timm's pretrained weights")
    p.add_argument("--dataset", default=None,
                   help="Hugging Face image-classification dataset (default: built-in digits)")
    p.add_argument("--dataset-config", default=None, help="dataset configuration name")
    p.add_argument("--train-split", default="train")
    p.add_argument("--eval-split", default=None,
                   help="split to evaluate on with --dataset (digits: a held-out 20%%)")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--opt", default="shampoo", help="timm optimizer name: shampoo, soap, adamw")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--layer-decay", type=float, default=None, help="timm layer-wise lr decay")
    p.add_argument("--sched", choices=["cosine", "none"], default="cosine",
                   help="timm cosine schedule with warm-up (applies layer-decay lr_scale)")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--precondition-frequency", type=int, default=10)
    p.add_argument("--start-preconditioning-step", type=int, default=None,
                   help="default: --precondition-frequency")
    p.add_argument("--max-preconditioner-dim", type=int, default=1024)
    p.add_argument("--refresh-schedule", choices=["staggered", "all"], default=None,
                   help="Shampoo/SOAP refresh schedule (default: timm factory's, staggered)")
    p.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"], default="no")
    p.add_argument("--cpu", action="store_true", help="force CPU (automatic without CUDA)")
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-times", default=None,
                   help="write rank 0's per-step times (JSON: step, optimizer step) here")
    return p.parse_args(argv)


# ---------------------------------------------------------------------- data
def digits_datasets(image_size: int, seed: int) -> tuple[Dataset, Dataset, int]:
    """scikit-learn's 1797 digits, 8x8 -> image_size², 3 channels, seeded 80/20 split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    x = ((x - 0.5) / 0.5).expand(-1, 3, -1, -1).contiguous()
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    train, test = perm[:cut], perm[cut:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test]), 10


def hf_datasets(args: argparse.Namespace) -> tuple[Dataset, Dataset | None, int]:
    """A Hugging Face dataset: the first Image column and the ClassLabel (or label) column."""
    from datasets import ClassLabel, Image, load_dataset
    from torchvision import transforms

    def load(split: str):
        return load_dataset(args.dataset, args.dataset_config, split=split)

    train = load(args.train_split)
    features = train.features
    image_col = next((c for c, f in features.items() if isinstance(f, Image)), None)
    image_col = image_col or next((c for c in ("image", "img", "pixel_values") if c in features),
                                  None)
    label_col = next((c for c, f in features.items() if isinstance(f, ClassLabel)), None)
    label_col = label_col or next(
        (c for c in ("label", "labels", "fine_label", "target") if c in features), None
    )
    if image_col is None or label_col is None:
        raise SystemExit(f"{args.dataset}: no image / label column among {list(features)}")
    feature = features[label_col]
    num_classes = (
        feature.num_classes if isinstance(feature, ClassLabel) else int(max(train[label_col])) + 1
    )
    transform = transforms.Compose([
        transforms.Resize((args.image_size, args.image_size)),
        transforms.ToTensor(),
        transforms.Normalize([0.5] * 3, [0.5] * 3),
    ])

    def to_tensors(batch: dict[str, list]) -> dict[str, list]:
        return {
            "pixel_values": [transform(img.convert("RGB")) for img in batch[image_col]],
            "label": batch[label_col],
        }

    def prepare(ds):
        return ds.with_transform(to_tensors, columns=[image_col, label_col])

    evaluation = prepare(load(args.eval_split)) if args.eval_split else None
    return prepare(train), evaluation, num_classes


def collate(rows: list) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(rows[0], dict):
        return (torch.stack([r["pixel_values"] for r in rows]),
                torch.tensor([int(r["label"]) for r in rows]))
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def endless(loader: DataLoader) -> Iterator:
    epoch = 0
    while True:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)  # reshuffles the distributed sampler
        yield from loader
        epoch += 1


# ---------------------------------------------------------------------- reporting
def state_bytes(value: Any) -> int:
    """Bytes of every tensor in a (nested) optimizer state."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(state_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(state_bytes(v) for v in value)
    return 0


def blocks_per_rank(optimizer: torch.optim.Optimizer) -> dict[int, tuple[int, int, int]]:
    """rank → (blocks, block elements, factor-matrix elements) from ``describe_blocks()``."""
    summary: dict[int, tuple[int, int, int]] = {}
    for row in optimizer.describe_blocks():
        blocks, elements, factors = summary.get(row["rank"], (0, 0, 0))
        summary[row["rank"]] = (
            blocks + 1,
            elements + math.prod(row["shape"]),
            factors + sum(d * d for d in row["shape"]),
        )
    return dict(sorted(summary.items()))


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def evaluate(model, loader, accelerator) -> float:
    model.eval()
    correct = total = 0
    for x, y in loader:
        pred, y = accelerator.gather_for_metrics((model(x).argmax(-1), y))
        correct += int((pred == y).sum())
        total += y.numel()
    model.train()
    return correct / max(total, 1)


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Accelerator first: it sets up torch.distributed, which the optimizer's
    # distributed="auto" detects when it is built.
    accelerator = Accelerator(
        cpu=args.cpu or not torch.cuda.is_available(), mixed_precision=args.mixed_precision
    )
    set_seed(args.seed)
    if args.dataset:
        train_set, eval_set, num_classes = hf_datasets(args)
    else:
        train_set, eval_set, num_classes = digits_datasets(args.image_size, args.seed)

    model = timm.create_model(args.model, pretrained=args.pretrained, num_classes=num_classes)
    shampoo_kwargs = {}
    if args.opt.split("_")[-1] in ("shampoo", "soap"):
        shampoo_kwargs = {
            "precondition_frequency": args.precondition_frequency,
            "start_preconditioning_step": args.start_preconditioning_step,
            "max_preconditioner_dim": args.max_preconditioner_dim,
        }
        if args.refresh_schedule is not None:
            shampoo_kwargs["refresh_schedule"] = args.refresh_schedule
    optimizer = create_optimizer_v2(
        model, opt=args.opt, lr=args.lr, weight_decay=args.weight_decay,
        layer_decay=args.layer_decay, **shampoo_kwargs,
    )
    scheduler = None
    if args.sched == "cosine":
        # timm schedulers multiply each group's lr by its layer-decay lr_scale.
        scheduler = CosineLRScheduler(
            optimizer, t_initial=args.steps, warmup_t=args.warmup_steps,
            warmup_lr_init=args.lr * 0.1, warmup_prefix=False, t_in_epochs=False,
        )
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              drop_last=True, collate_fn=collate, num_workers=args.num_workers)
    eval_loader = None
    if eval_set is not None:
        eval_loader = DataLoader(eval_set, batch_size=2 * args.batch_size, collate_fn=collate,
                                 num_workers=args.num_workers)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    if eval_loader is not None:
        eval_loader = accelerator.prepare(eval_loader)
    base_optimizer = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer wraps it
    is_shampoo = hasattr(base_optimizer, "describe_blocks")

    if accelerator.is_main_process:
        n_params = sum(p.numel() for p in model.parameters())
        print(
            f"{args.model} ({n_params / 1e6:.1f}M params, {num_classes} classes) on "
            f"{accelerator.num_processes} process(es), {accelerator.device}; "
            f"{type(base_optimizer).__name__} via timm opt={args.opt!r}, lr {args.lr:g}, "
            f"{len(base_optimizer.param_groups)} param groups; "
            f"{args.steps} steps x {args.batch_size} images/process at {args.image_size}px",
            flush=True,
        )
        if is_shampoo:
            group = base_optimizer.param_groups[0]
            start = group["start_preconditioning_step"] or group["precondition_frequency"]
            print(f"Shampoo: preconditioner from step {start}, refreshed every "
                  f"{group['precondition_frequency']} steps (refresh_schedule="
                  f"{group['refresh_schedule']!r})", flush=True)

    losses, step_s, opt_s = [], [], []
    batches = endless(train_loader)
    model.train()
    for step in tqdm(range(1, args.steps + 1), disable=not accelerator.is_main_process,
                     desc="fine-tune", dynamic_ncols=True):
        x, y = next(batches)
        synchronize(accelerator.device)
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        synchronize(accelerator.device)
        t1 = time.perf_counter()
        optimizer.step()
        synchronize(accelerator.device)
        t2 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step_update(step)
        losses.append(loss.detach().float())
        step_s.append(t2 - t0)
        opt_s.append(t2 - t1)

    # ------------------------------------------------------------------ summary
    mean_losses = accelerator.reduce(torch.stack(losses), reduction="mean").cpu()
    accuracy = evaluate(model, eval_loader, accelerator) if eval_loader is not None else None
    # what this rank keeps between steps (torch's per-parameter view: this rank's blocks
    # only, no communication; a checkpoint can hold more, such as pending refreshes)
    state = list(base_optimizer.state.values())
    per_rank = gather_object([(accelerator.process_index, state_bytes(state),
                               sum(opt_s) / len(opt_s))])
    health = base_optimizer.metrics() if is_shampoo else None  # every rank: a collective
    if not accelerator.is_main_process:
        return
    k = min(5, len(mean_losses))
    refresh = [t for i, t in enumerate(opt_s, 1) if is_shampoo and _is_refresh(base_optimizer, i)]
    other = [t for i, t in enumerate(opt_s, 1) if not (is_shampoo and
                                                       _is_refresh(base_optimizer, i))]
    rest = step_s[1:] or step_s  # the first step allocates the optimizer state
    print("\n== summary (rank 0 timings; losses averaged over ranks) ==")
    print(f"loss: first step {mean_losses[0]:.4f} (first {k} mean {mean_losses[:k].mean():.4f})"
          f" -> last step {mean_losses[-1]:.4f} (last {k} mean {mean_losses[-k:].mean():.4f})")
    if accuracy is not None:
        print(f"eval accuracy: {accuracy:.2%}")
    print(f"step time (forward+backward+optimizer): mean {_ms(rest)} after the first step "
          f"(first {1e3 * step_s[0]:.0f} ms)")
    print(slowest_step(step_s))
    if args.step_times:
        with open(args.step_times, "w") as f:
            json.dump({"step_s": step_s, "optimizer_step_s": opt_s}, f)
    line = f"optimizer.step time: mean {_ms(opt_s)}"
    if refresh:
        line += f"; refresh steps {_ms(refresh)} ({len(refresh)}x), other steps {_ms(other)}"
    print(line)
    print("optimizer state per rank (tensors in optimizer.state): " + ", ".join(
        f"rank {rank}: {mib(nbytes)}" for rank, nbytes, _ in sorted(per_rank)))
    print("mean optimizer.step time per rank: " + ", ".join(
        f"rank {rank}: {1e3 * t:.0f} ms" for rank, _, t in sorted(per_rank)))
    if is_shampoo:
        print("blocks per rank (blocks, block elements, factor-matrix elements): " + ", ".join(
            f"rank {rank}: {b} blocks, {e / 1e6:.2f}M, {f / 1e6:.2f}M"
            for rank, (b, e, f) in blocks_per_rank(base_optimizer).items()))
    if health:
        print(health_summary(health))


def slowest_step(step_s: list[float]) -> str:
    """The slowest step after the first (which allocates the optimizer state) against the
    median: with staggered refreshes (timm's default here) no step waits for every
    block's refresh at once."""
    rest = step_s[1:] or step_s
    median = statistics.median(rest)
    worst = max(range(len(rest)), key=rest.__getitem__)
    return (f"slowest step: step {worst + 2 if len(step_s) > 1 else 1}, "
            f"{1e3 * rest[worst]:.0f} ms = {rest[worst] / median:.2f}x the median step "
            f"({1e3 * median:.0f} ms)")


def health_summary(metrics: dict[str, float]) -> str:
    """A few lines from ``optimizer.metrics()`` (docs/metrics.md says what to do when one
    looks wrong)."""
    get = lambda name: metrics.get(f"optimizer/{name}", math.nan)
    ratios = ", ".join(f"{k.rsplit('/', 1)[1]} {v:.3g}" for k, v in metrics.items()
                       if k.startswith("optimizer/graft_ratio/")) or "no grafting"
    return "\n".join([
        "optimizer health (optimizer.metrics(), docs/metrics.md):",
        f"  preconditioning {get('preconditioning'):.0%} of blocks after "
        f"{get('steps'):.0f} steps; last refresh {get('refresh_blocks'):.0f} blocks in "
        f"{get('refresh_seconds'):.3f} s; {get('fallbacks'):.0f} fallbacks",
        f"  factor condition numbers: largest {get('condition_max'):.3g}, median "
        f"{get('condition_median'):.3g}; grafting ratio ||graft|| / ||P||: {ratios}",
        f"  state {mib(get('state_bytes'))} in all, {mib(get('state_bytes_max_rank'))} on "
        "the largest rank",
    ])


def _is_refresh(optimizer: torch.optim.Optimizer, step: int) -> bool:
    """docs/design.md §2's amortized-step rule, for the timing split only (with staggered
    refreshes every step refreshes some blocks: no split)."""
    group = next((g for g in optimizer.param_groups if g["preconditioner"] != "diagonal"),
                 optimizer.param_groups[0])
    if group["refresh_schedule"] == "staggered":
        return False
    f = group["precondition_frequency"]
    s = group["start_preconditioning_step"] or f
    return (step % f == 0 and step > s) or step == s


def _ms(seconds: list[float]) -> str:
    return f"{1e3 * sum(seconds) / max(len(seconds), 1):.0f} ms"


if __name__ == "__main__":
    main()
