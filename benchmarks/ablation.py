"""The paper's ablation at a scale that reruns in minutes: every optimizer trains the same
models from the same initialisations on the same batches, its learning rate chosen by a
sweep this script runs, then several seeds; Shampoo's design choices are varied one at a
time (``ABLATIONS``, at the base's swept learning rate). Prints markdown tables, writes
loss-vs-step and loss-vs-time plots and a JSON file of every run. The tasks and optimizers
are listed in benchmarks/README.md (and ``TASKS``, ``OPTIMIZERS``).

Every run uses a linear warm-up over the first 5 % of steps and a cosine decay to zero
(schedule-free: no decay). The learning rate of each optimizer is the value with the
lowest mean training loss over the last 20 % of steps (seed 0) among a grid (1e-3, 3e-3,
1e-2; SGD 0.03, 0.1, 0.3) extended along the 1-3-10 ladder while the best value is at its
edge (``--max-lr-points``); the test/validation data play no part in the choice. Time is
the process's CPU time with one thread (``time.process_time``), which equals the
wall-clock time on an idle core and is not inflated by other work on the machine.

    python -m benchmarks.ablation                       # the full run (about an hour here)
    python -m benchmarks.ablation --smoke               # toy size, about a minute
    python -m benchmarks.ablation --replot outputs/ablation/ablation.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from benchmarks.common import command_line, hardware, log, table_head, table_row
from benchmarks.configs import ADAMW, SHAMPOO, SOAP
from benchmarks.harness import train_loop, warmup_cosine
from benchmarks.tasks import (
    CONTEXT,
    classification_parts,
    docstring_tokens,
    image_dataset,
    language_model_parts,
    make_gpt2,
    make_lora,
    make_resnet,
    text_tokens,
    windows_of,
)
from hf_shampoo import DistributedShampoo
from hf_shampoo.factory import make_optimizer
from hf_shampoo.optional import require

LRS = (1e-3, 3e-3, 1e-2)


@dataclass
class Optimizer:
    """A named optimizer: ``kind`` "adamw", "sgd" or "shampoo" (DistributedShampoo with
    ``keywords``), its learning-rate grid and the tasks it runs on."""
    kind: str
    keywords: dict = field(default_factory=dict)
    lrs: tuple[float, ...] = LRS
    tasks: tuple[str, ...] = ("resnet", "gpt2")
    default: bool = True  # False: runs only when named in --optimizers
    # "cosine": warm-up then cosine decay to zero; "constant": the same warm-up, then the
    # peak lr to the end (schedule-free runs, evaluated at their averaged weights)
    schedule: str = "cosine"

    def build(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        params = model.parameters()
        if self.kind == "muon":  # ours: the module preset picks Muon or Adam per parameter
            return make_optimizer(model, preset="muon", lr=lr, **self.keywords)
        if self.kind == "shampoo_modules":  # the module rules (as the Trainer's path)
            return make_optimizer(model, lr=lr, **self.keywords)
        if self.kind == "torch_muon":
            return torch_muon_and_adamw(model, lr)
        if self.kind == "adamw":
            return torch.optim.AdamW(params, lr=lr, **ADAMW)
        if self.kind == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=True, weight_decay=1e-4)
        return DistributedShampoo(params, lr=lr, **self.keywords)


OPTIMIZERS = {
    "AdamW": Optimizer("adamw", tasks=("resnet", "gpt2", "lora", "finetune")),
    "SGD + Nesterov": Optimizer("sgd", lrs=(0.03, 0.1, 0.3), tasks=("resnet",)),
    "Shampoo (Adam grafting)": Optimizer("shampoo", SHAMPOO,
                                         tasks=("resnet", "gpt2", "lora", "finetune")),
    # LoRA through the module rules, as the Trainer and make_optimizer build it: each
    # adapter's long side (d of d x r) gets a diagonal factor, the short side a full one;
    # Meta's refresh schedule, as the other rows (make_optimizer's default is "staggered")
    "Shampoo (Adam grafting, module rules)": Optimizer(
        "shampoo_modules", dict(SHAMPOO, refresh_schedule="all"), tasks=("lora",)),
    "SOAP (eigenvalue-corrected)": Optimizer("shampoo", SOAP,
                                             tasks=("resnet", "gpt2", "lora", "finetune")),
    "KL-Shampoo (Adam grafting)": Optimizer("shampoo", dict(SHAMPOO, preconditioner="kl_shampoo")),
    # Sketchy (docs/sketchy.md): every factor dim over k a rank-k Frequent-Directions
    # sketch (on this GPT-2: 1.19x AdamW's state at k = 8, 1.38x at 16; Shampoo 4.0x); the
    # reference's relative epsilon
    **{f"Sketchy (rank {k})": Optimizer("shampoo", dict(SHAMPOO, preconditioner="sketchy",
                                                         sketch_rank=k, epsilon=1e-7),
                                         tasks=("gpt2", "finetune"), default=False)
       for k in (8, 16)},
    # the sketches' bases in 4 bits (quantization="4bit", as 4-bit Shampoo's eigenvectors)
    **{f"Sketchy (rank {k}, 4-bit)": Optimizer(
        "shampoo", dict(SHAMPOO, preconditioner="sketchy", sketch_rank=k, epsilon=1e-7,
                        quantization="4bit"), tasks=("gpt2", "finetune"), default=False)
       for k in (16, 32, 64)},
    # the sketches sampled every s steps (the reference's update_freq; s divides the
    # refresh period 10; 10: at refreshes only): the SVDs' cost divided by s
    **{f"Sketchy (rank 16, statistics every {s})": Optimizer(
        "shampoo", dict(SHAMPOO, preconditioner="sketchy", sketch_rank=16, epsilon=1e-7,
                        statistics_frequency=s), tasks=("gpt2", "finetune"), default=False)
       for s in (2, 5, 10)},
    "4-bit Shampoo (statistics every 2)": Optimizer(
        "shampoo", dict(SHAMPOO, quantization="4bit", statistics_frequency=2)),
    # 4-bit cadences beyond the default table (docs/design.md §5): run when named in --optimizers
    "4-bit Shampoo (statistics every 5)": Optimizer(
        "shampoo", dict(SHAMPOO, quantization="4bit", statistics_frequency=5), default=False),
    "4-bit Shampoo (statistics at refreshes)": Optimizer(
        "shampoo", dict(SHAMPOO, quantization="4bit"), default=False),
}
# Muon as users set it up today (torch.optim.Muon on the hidden matrices, AdamW on the rest,
# Moonshot's lr adjustment so that one lr serves both) and ours by the "muon" preset (the
# same split, Nesterov momentum betas[0] = 0.9, the same adjustment): GPT-2 only
OPTIMIZERS["Muon (hf_shampoo, muon preset)"] = Optimizer(
    "muon", dict(betas=(0.9, 0.999), grafting_beta2=0.999, grafting_epsilon=1e-8,
                 weight_decay=1e-4), tasks=("gpt2", "finetune"))
OPTIMIZERS["torch.optim.Muon + AdamW"] = Optimizer("torch_muon", tasks=("gpt2",))
# schedule-free Shampoo (Meta's ScheduleFreeConfig): no decay, evaluated at the averaged
# weights (optimizer.eval()); the averaging takes the place of beta1's filter
OPTIMIZERS["Shampoo schedule-free (constant lr)"] = Optimizer(
    "shampoo", dict(SHAMPOO, betas=(0.0, 0.999), iterate_averaging="schedule_free"),
    tasks=("gpt2",), schedule="constant")
BASE = "Shampoo (Adam grafting)"


class _Both(torch.optim.Optimizer):
    """Two optimizers stepped together, with their param groups in one list (for one lr
    scheduler), as a training loop with torch.optim.Muon + AdamW does by hand."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers
        self.defaults = {}
        self.state = {}
        self.param_groups = [g for o in optimizers for g in o.param_groups]
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}

    def step(self, closure=None):
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def torch_muon_and_adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """torch.optim.Muon (momentum 0.95, Nesterov, "match_rms_adamw") on the 2-D weights that
    are not embeddings, AdamW on everything else; weight decay 1e-4 as the others."""
    hidden, rest = [], []
    for name, p in model.named_parameters():
        embedding = name.endswith(("wte.weight", "wpe.weight", "lm_head.weight"))
        (hidden if p.ndim == 2 and not embedding else rest).append(p)
    return _Both(torch.optim.Muon(hidden, lr=lr, momentum=0.95, nesterov=True,
                                  weight_decay=1e-4, adjust_lr_fn="match_rms_adamw"),
                 torch.optim.AdamW(rest, lr=lr, **ADAMW))

# One change at a time against BASE, at BASE's swept learning rate.
ABLATIONS = {
    "precondition_frequency 1": dict(precondition_frequency=1),
    "precondition_frequency 100": dict(precondition_frequency=100),
    "grafting rmsprop": dict(grafting="rmsprop"),
    "grafting sgd": dict(grafting="sgd"),
    "grafting none": dict(grafting=None),
    "max_preconditioner_dim 32": dict(max_preconditioner_dim=32),
    "max_preconditioner_dim 512": dict(max_preconditioner_dim=512),
    # ε as SOAP's: the correction divides by √D + ε, where Shampoo's 1e-12 is too small
    "eigenvalue correction on (ε 1e-8)": dict(preconditioner="eigenvalue_corrected", epsilon=1e-8),
    "staggered refresh": dict(refresh_schedule="staggered"),
    # rank-deficient factors by the pseudo-inverse at the rounding floor (timm's default)
    "pseudo-inverse roots (rank_rtol None)": dict(rank_deficient="pseudo_inverse", epsilon=0.0,
                                                  rank_rtol=None),
}
#: run only when named with --ablations (not part of the default run): refresh_delay at
#: f = 10, where 0 reruns the base beside the delays and 2 is f/4 rounded down
NAMED_ONLY = {
    "refresh_delay 0": dict(refresh_delay=0),
    "refresh_delay 1": dict(refresh_delay=1),
    "refresh_delay 2": dict(refresh_delay=2),
    "refresh_delay 10": dict(refresh_delay=10),
}


# ------------------------------------------------------------------------------- tasks
@dataclass
class Task:
    """A model factory, a batch sampler (fixed by the seed), a loss and an evaluation."""
    name: str
    title: str
    model: Callable[[int], nn.Module]
    batches: Callable[[int, int], list]
    loss: Callable[[nn.Module, object], torch.Tensor]
    evaluate: Callable[[nn.Module], dict[str, float]]
    metric: str  # the evaluation entry shown first
    measure_state: bool = False  # also report the optimizer state's size (MiB)


def resnet_task(args) -> Task:
    x, y, xt, yt, classes = image_dataset(args.image_dataset, args.image_size)
    batches, loss, evaluate = classification_parts(x, y, xt, yt, args.batch_size)
    source = args.image_dataset or f"scikit-learn digits ({len(y)} train / {len(yt)} test)"
    return Task("resnet", f"timm ResNet (BasicBlock ×4, widths 16-128, "
                f"{sum(p.numel() for p in make_resnet(0, classes).parameters()) / 1e6:.2f}M "
                f"parameters) on {source}, {args.image_size}×{args.image_size}, "
                f"batch {args.batch_size}",
                lambda seed: make_resnet(seed, classes), batches, loss, evaluate, "test acc")


def gpt2_task(args) -> Task:
    batches, loss, evaluate = language_model_parts(args, *text_tokens(args.text_dataset))
    source = args.text_dataset or "Python's standard-library sources"
    return Task("gpt2", f"GPT-2 (2 layers, {args.gpt2_width} wide, byte-level, context "
                f"{CONTEXT}) on {source}, batch {args.text_batch_size}",
                lambda seed: make_gpt2(seed, n_embd=args.gpt2_width), batches, loss, evaluate,
                "val loss")


def lora_task(args) -> Task:
    base = lora_base(args.gpt2_width, args.lora_base_steps, args.text_batch_size)
    batches, loss, evaluate = language_model_parts(args, *docstring_tokens())
    sample = make_lora(base, 0)
    trainable = sum(p.numel() for p in sample.parameters() if p.requires_grad)
    total = sum(p.numel() for p in sample.parameters())
    before = evaluate(sample)["val loss"]
    return Task("lora", f"LoRA (rank 4 on c_attn/c_proj, {trainable / 1e3:.0f}k trainable of "
                f"{total / 1e3:.0f}k) fine-tune on the standard library's docstrings of a "
                f"GPT-2 (2 layers, {args.gpt2_width} wide) trained {args.lora_base_steps} "
                f"steps with AdamW on its sources (val loss before: {before:.3f}), batch "
                f"{args.text_batch_size}", lambda seed: make_lora(base, seed), batches, loss,
                evaluate, "val loss", measure_state=True)


def finetune_task(args) -> Task:
    """The LoRA task's pre-trained GPT-2 and data, every parameter trainable."""
    base = lora_base(args.gpt2_width, args.lora_base_steps, args.text_batch_size)
    batches, loss, evaluate = language_model_parts(args, *docstring_tokens())
    before = evaluate(base)["val loss"]
    size = sum(p.numel() for p in base.parameters())
    return Task("finetune", f"full fine-tune (all {size / 1e3:.0f}k parameters) on the "
                f"standard library's docstrings of a GPT-2 (2 layers, "
                f"{args.gpt2_width} wide) trained {args.lora_base_steps} steps with AdamW on its "
                f"sources (val loss before: {before:.3f}), batch {args.text_batch_size}",
                lambda seed: copy.deepcopy(base), batches, loss, evaluate, "val loss",
                measure_state=True)


def lora_base(width: int, steps: int, batch_size: int) -> nn.Module:
    """The GPT-2 that every LoRA run starts from: AdamW (lr 3e-3, warm-up and cosine)
    on the standard-library sources, seed 0."""
    model = make_gpt2(0, n_embd=width)
    tokens, _ = text_tokens(None)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    g = torch.Generator().manual_seed(12345)
    starts = [torch.randint(0, len(tokens) - CONTEXT, (batch_size,), generator=g)
              for _ in range(steps)]

    def loss(model, starts):
        batch = windows_of(tokens, starts)
        return model(input_ids=batch, labels=batch).loss

    train_loop(model, opt, starts, loss, warmup_cosine(steps))
    return model


def state_mib(opt: torch.optim.Optimizer) -> float:
    """The optimizer state's size: for ours every block's state tensors (``describe_blocks``),
    for torch's the tensors in ``optimizer.state`` (step counters left out)."""
    if isinstance(opt, DistributedShampoo):
        return sum(r["state_bytes"] for r in opt.describe_blocks()) / 2**20
    total = 0
    for inner in getattr(opt, "optimizers", (opt,)):
        total += sum(t.numel() * t.element_size() for entry in inner.state.values()
                     for t in entry.values() if torch.is_tensor(t) and t.dim() > 0)
    return total / 2**20


# --------------------------------------------------------------------------- training
def train(task: Task, optimizer: Optimizer, lr: float, seed: int, steps: int) -> dict:
    """One run (``harness.train_loop``: a non-finite loss ends it, ``diverged``): training
    losses and cumulative CPU seconds per step, final metrics."""
    model = task.model(seed)
    opt = optimizer.build(model, lr)
    run = train_loop(model, opt, task.batches(seed, steps), task.loss,
                     warmup_cosine(steps, decay=optimizer.schedule == "cosine"))
    result = dict(lr=lr, seed=seed, losses=run.losses, seconds=run.seconds, metrics={},
                  diverged=run.diverged)
    if run.diverged:
        return result
    if hasattr(opt, "eval"):  # iterate averaging: evaluate the averaged weights
        opt.eval()
    result["metrics"] = task.evaluate(model)
    if task.measure_state:
        result["metrics"]["optimizer state MiB"] = state_mib(opt)
    return result


def tail_loss(run: dict, steps: int) -> float:
    """Mean training loss over the last 20 % of steps; inf for a diverged run."""
    if run["diverged"]:
        return math.inf
    return statistics.mean(run["losses"][-max(1, steps // 5):])


def smooth(values: list[float], width: int) -> list[float]:
    """Trailing moving average (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= width:
            total -= values[i - width]
        out.append(total / min(i + 1, width))
    return out


def extend(sweep: dict[float, dict], steps: int) -> list[float]:
    """The next learning rate on the 1-3-10 ladder beyond the grid's edge where the best
    tail loss lies ([] when the best is inside the grid): the sweep ends with an interior
    optimum unless it runs out of points."""
    ordered = sorted(sweep)
    best = min(ordered, key=lambda lr: tail_loss(sweep[lr], steps))
    if len(ordered) < 2 or ordered[0] < best < ordered[-1]:
        return []
    exponent = math.floor(math.log10(best) + 1e-9)
    leading = round(best / 10**exponent)  # 1 or 3
    if best == ordered[0]:
        return [(0.3 if leading == 1 else 1.0) * 10**exponent]
    return [(3.0 if leading == 1 else 10.0) * 10**exponent]


def run_task(task: Task, args) -> dict:
    """Sweep, seeds and ablations for one task; returns the JSON-ready record."""
    record = dict(task=task.name, title=task.title, metric=task.metric, steps=args.steps,
                  sweep={}, chosen={}, runs={}, ablations={}, ablation_lrs={})
    for name, optimizer in OPTIMIZERS.items():
        if args.base_lr is not None:
            break  # ablations only, at the given learning rate
        if args.optimizers is not None:
            if name not in args.optimizers:
                continue
        elif task.name not in optimizer.tasks or not optimizer.default:
            continue
        lrs = list(optimizer.lrs[: args.lr_points] if args.lr_points else optimizer.lrs)
        if args.lr is not None:
            lrs = [args.lr]
        sweep = {}
        while lrs:
            lr = lrs.pop(0)
            sweep[lr] = train(task, optimizer, lr, 0, args.steps)
            log(f"{task.name} | {name} | lr {lr:g} | tail loss "
                f"{tail_loss(sweep[lr], args.steps):.4f}")
            if not lrs and len(sweep) < args.max_lr_points and args.lr is None:
                lrs = extend(sweep, args.steps)
        best = min(sweep, key=lambda lr: tail_loss(sweep[lr], args.steps))
        runs = [sweep[best]] + [train(task, optimizer, best, seed, args.steps)
                                for seed in range(1, args.seeds)]
        record["sweep"][name] = {f"{lr:g}": tail_loss(run, args.steps) for lr, run in sweep.items()}
        record["chosen"][name] = best
        record["runs"][name] = runs
    if task.name in args.ablation_tasks and (BASE in record["chosen"] or args.base_lr):
        lr = args.base_lr or record["chosen"][BASE]
        named = {k: v for k, v in NAMED_ONLY.items() if k in (args.ablations or ())}
        for name, change in {**ABLATIONS, **named}.items():
            if args.ablations and name not in args.ablations:
                continue
            optimizer = Optimizer("shampoo", dict(SHAMPOO, **change))
            name += args.ablation_suffix
            record["ablations"][name] = [train(task, optimizer, lr, seed, args.steps)
                                         for seed in range(args.ablation_seeds)]
            record["ablation_lrs"][name] = lr
            log(f"{task.name} | ablation {name} | tail loss "
                f"{tail_loss(record['ablations'][name][0], args.steps):.4f}")
    return record


# ---------------------------------------------------------------------------- reports
def spread(values: list[float]) -> str:
    """mean ± half the range."""
    if not values:
        return "–"
    mean, half = statistics.mean(values), (max(values) - min(values)) / 2
    if abs(mean) >= 1000:
        return f"{mean:.2g} ± {half:.2g}"
    return f"{mean:.3f} ± {half:.3f}"


def to_target(run: dict, target: float, width: int) -> tuple[int | None, float | None]:
    """(steps, seconds) until the smoothed training loss first reaches ``target``."""
    for i, value in enumerate(smooth(run["losses"], width)):
        if value <= target:
            return i + 1, run["seconds"][i]
    return None, None


def target_cells(runs: list[dict], target: float, width: int) -> tuple[str, str]:
    reached = [to_target(r, target, width) for r in runs]
    hits = [(s, t) for s, t in reached if s is not None]
    if not hits:
        return "not reached", "not reached"
    note = "" if len(hits) == len(runs) else f" ({len(hits)}/{len(runs)} seeds)"
    return (f"{statistics.mean(s for s, _ in hits):.0f}{note}",
            f"{statistics.mean(t for _, t in hits):.1f}{note}")


def rows(record: dict, groups: dict[str, list[dict]], target: float, width: int,
         lrs: dict[str, str]) -> list[str]:
    steps = record["steps"]
    metric_names = sorted({m for runs in groups.values() for r in runs for m in r["metrics"]},
                          key=lambda m: m != record["metric"])
    head = ["optimizer", "lr", "final train loss", *metric_names,
            f"steps to {target:.3f}", "seconds to it", "s / step"]
    out = [table_head(*head)]
    for name, runs in groups.items():
        ok = [r for r in runs if not r["diverged"]]
        diverged = len(runs) - len(ok)
        finals = [tail_loss(r, steps) for r in ok]
        metrics = [spread([r["metrics"][m] for r in ok]) for m in metric_names]
        steps_to, seconds_to = target_cells(ok, target, width) if ok else ("–", "–")
        per_step = (f"{statistics.mean(r['seconds'][-1] / len(r['seconds']) for r in ok):.3f}"
                    if ok else "–")
        final = spread(finals) + (f" ({diverged} diverged)" if diverged else "")
        out.append(table_row(name, lrs.get(name, "–"), final, *metrics, steps_to, seconds_to,
                             per_step))
    return out


def target_of(record: dict, args) -> float:
    """``--target`` if given, else AdamW's final training loss (mean over seeds): steps to
    target then read "how soon does each optimizer reach what AdamW reaches"."""
    if args.target is not None:
        return args.target
    groups = record["runs"] or record["ablations"]
    runs = groups.get("AdamW") or next(iter(groups.values()))
    return statistics.mean(tail_loss(r, record["steps"]) for r in runs)


def report(record: dict, args) -> str:
    width = max(1, record["steps"] // 20)
    target = target_of(record, args)
    seeds = len(next(iter((record["runs"] or record["ablations"]).values())))
    lines = [f"#### {record['title']}", "",
             f"{record['steps']} steps, learning rate swept on seed 0, then {seeds} seeds "
             f"(mean ± half the range). Target: "
             f"{'AdamW' if args.target is None and 'AdamW' in record['runs'] else 'given'} "
             f"final training loss {target:.3f} (training loss smoothed over {width} "
             f"steps).", ""]
    lrs = {}
    for name, sweep in record["sweep"].items():
        chosen = f"{record['chosen'][name]:g}"
        grid = sorted(float(lr) for lr in sweep)
        edge = " (sweep edge)" if float(chosen) in (grid[0], grid[-1]) and len(grid) > 1 else ""
        lrs[name] = f"{chosen}{edge}"
    if record["runs"]:
        lines += rows(record, record["runs"], target, width, lrs)
    lines += ["", "Learning-rate sweep (seed 0; mean training loss over the last 20 % of "
              "steps; inf: diverged):", "", table_head("optimizer", "learning rate: tail loss")]
    for name, sweep in record["sweep"].items():
        lines.append(table_row(name, ", ".join(f"{lr}: {v:.4f}" for lr, v in sweep.items())))
    if record["ablations"]:
        lrs = ablation_lrs(record)
        lines += ["", f"Ablations of {BASE}, one change each "
                  f"({len(next(iter(record['ablations'].values())))} seeds):", ""]
        groups = dict(record["ablations"])
        if BASE in record["runs"]:
            groups = {f"{BASE} (base)": record["runs"][BASE], **groups}
            lrs[f"{BASE} (base)"] = f"{record['chosen'][BASE]:g}"
        lines += rows(record, groups, target, width, lrs)
    return "\n".join(lines)


def ablation_lrs(record: dict) -> dict[str, str]:
    """Each ablation's learning rate, as printed."""
    return {name: f"{lr:g}" for name, lr in record["ablation_lrs"].items()}


def plot(record: dict, out_dir: str, args) -> list[str]:
    """Loss against step and against seconds (mean over seeds, band min-max) for the
    optimizers, and against step for the ablations."""
    matplotlib = require("matplotlib", "the plots of benchmarks.ablation")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = max(1, record["steps"] // 20)
    paths = []

    def draw(ax, runs, label, x_of):
        curves = [smooth(r["losses"], width) for r in runs if not r["diverged"]]
        if not curves:
            return
        n = min(len(c) for c in curves)
        mean = [statistics.mean(c[i] for c in curves) for i in range(n)]
        low = [min(c[i] for c in curves) for i in range(n)]
        high = [max(c[i] for c in curves) for i in range(n)]
        xs = x_of([r for r in runs if not r["diverged"]], n)
        (line,) = ax.plot(xs, mean, label=label, linewidth=1.4)
        ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.2, linewidth=0)

    by_step = lambda runs, n: list(range(1, n + 1))  # noqa: E731
    by_time = lambda runs, n: [statistics.mean(r["seconds"][i] for r in runs)  # noqa: E731
                               for i in range(n)]
    if not record["runs"]:
        return plot_ablations(record, out_dir, draw, by_step, width)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    if len(record["runs"]) > 10:  # more rows than the default colours: one colour each
        for ax in axes:
            ax.set_prop_cycle(color=plt.cm.tab20.colors)
    for name, runs in record["runs"].items():
        draw(axes[0], runs, f"{name}, lr {record['chosen'][name]:g}", by_step)
        draw(axes[1], runs, name, by_time)
    for ax, xlabel in zip(axes, ("step", "CPU seconds (one thread)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"training loss (smoothed over {width} steps)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(record["title"], fontsize=9)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, f"ablation_{record['task']}.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths + plot_ablations(record, out_dir, draw, by_step, width)


FAMILIES = ("precondition_frequency", "grafting", "max_preconditioner_dim")


def plot_ablations(record: dict, out_dir: str, draw, by_step, width: int) -> list[str]:
    """One panel per family of ablations (the rows whose name starts with the family's
    keyword; the rest share the last panel), each with the base run. Runs that leave the
    base run's range are clipped and marked "off scale"."""
    import matplotlib.pyplot as plt

    if not record["ablations"]:
        return []
    panels: dict[str, list[str]] = {f: [] for f in FAMILIES}
    panels["eigenvalue correction, refresh schedule, roots"] = []
    for name in record["ablations"]:
        family = next((f for f in FAMILIES if name.startswith(f)), None)
        panels[family or "eigenvalue correction, refresh schedule, roots"].append(name)
    panels = {k: v for k, v in panels.items() if v}
    base = record["runs"].get(BASE, [])
    start = max((r["losses"][0] for runs in record["ablations"].values() for r in runs
                 if r["losses"]), default=1.0)
    top = 2.0 * start
    columns = 2 if len(panels) > 1 else 1
    rows_ = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows_, columns, figsize=(6 * columns, 4 * rows_), squeeze=False)
    in_range = [min(smooth(r["losses"], width)) for runs in [base, *record["ablations"].values()]
                for r in runs if r["losses"] and not r["diverged"] and max(r["losses"]) <= top]
    bottom = 0.5 * min(in_range, default=top / 1000)
    for ax, (family, names) in zip(axes.flat, panels.items()):
        ax.set_yscale("log")
        if base:
            draw(ax, base, f"{BASE} (base)", by_step)
        for name in names:
            runs = record["ablations"][name]
            if all(r["diverged"] for r in runs):
                ax.plot([], [], label=f"{name} (diverged)")
                continue
            off = any(r["diverged"] or max(r["losses"]) > top for r in runs)
            draw(ax, runs, name + (" (off scale)" if off else ""), by_step)
        ax.set_ylim(bottom, top)
        ax.set_xlabel("step")
        ax.set_ylabel(f"training loss (smoothed, {width} steps)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_title(family, fontsize=9)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"{record['task']}: ablations of {BASE}, one change each", fontsize=10)
    fig.tight_layout()
    path = os.path.join(out_dir, f"ablation_{record['task']}_variants.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def compact(value):
    """``value`` with every float rounded to 6 significant digits (the JSON stays small;
    the tables print at most 4)."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: compact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [compact(v) for v in value]
    return value


def ablation_rank(name: str) -> int:
    """Position in ``ABLATIONS`` of the ablation a row name starts with."""
    return next((i for i, a in enumerate(ABLATIONS) if name.startswith(a)), len(ABLATIONS))


def merge(paths: list[str]) -> tuple[list[dict], list[str]]:
    """The records of several JSON files, those of one task merged (later files add
    optimizers and ablations), and the files' headers."""
    by_task: dict[str, dict] = {}
    headers = []
    for path in paths:
        with open(path) as f:
            saved = json.load(f)
        headers.append(saved["header"])
        for record in saved["records"]:
            into = by_task.setdefault(record["task"], record)
            if into is not record:
                for key in ("sweep", "chosen", "runs", "ablations", "ablation_lrs"):
                    into[key].update(record[key])
    for record in by_task.values():  # rows of one ablation next to each other
        record["ablations"] = dict(sorted(record["ablations"].items(),
                                          key=lambda item: ablation_rank(item[0])))
    return list(by_task.values()), headers


# ------------------------------------------------------------------------------- main
def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["resnet", "gpt2"],
                        choices=["resnet", "gpt2", "lora", "finetune"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--ablation-seeds", type=int, default=3)
    parser.add_argument("--ablation-tasks", nargs="*", default=["resnet"],
                        choices=["resnet", "gpt2"], help="tasks that run the ablations")
    parser.add_argument("--optimizers", nargs="*", default=None,
                        help=f"only these, on every task (names: {', '.join(OPTIMIZERS)})")
    parser.add_argument("--lr", type=float, default=None,
                        help="one learning rate for every optimizer (no sweep)")
    parser.add_argument("--lr-points", type=int, default=None,
                        help="start from only the first N values of each learning-rate grid")
    parser.add_argument("--max-lr-points", type=int, default=5,
                        help="while the best learning rate is at an edge of those tried, the "
                             "sweep adds the next value on the 1-3-10 ladder beyond it, up "
                             "to this many runs")
    parser.add_argument("--batch-size", type=int, default=64, help="ResNet batch")
    parser.add_argument("--text-batch-size", type=int, default=16, help="GPT-2 batch")
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--gpt2-width", type=int, default=128, help="GPT-2's n_embd")
    parser.add_argument("--lora-base-steps", type=int, default=400,
                        help="AdamW steps that train the LoRA task's base GPT-2")
    parser.add_argument("--val-windows", type=int, default=128)
    parser.add_argument("--image-dataset", default=None,
                        help="Hugging Face dataset (name or save_to_disk directory) with "
                             "image and label columns, instead of digits")
    parser.add_argument("--text-dataset", default=None,
                        help="Hugging Face dataset (name or save_to_disk directory) with a "
                             "text column, instead of the standard-library sources")
    parser.add_argument("--target", type=float, default=None,
                        help="training loss for 'steps to target' (default: AdamW's final)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="directory for the JSON and the plots "
                        "(default outputs/ablation, or outputs/ablation-smoke)")
    parser.add_argument("--base-lr", type=float, default=None,
                        help=f"run only the ablations, at this learning rate of {BASE!r} "
                             "(to split a long run over processes; merge with --replot)")
    parser.add_argument("--ablations", nargs="*", default=None,
                        help="only these ablations (names: "
                             f"{', '.join([*ABLATIONS, *NAMED_ONLY])})")
    parser.add_argument("--ablation-suffix", default="",
                        help="appended to the ablations' names (e.g. ' at lr 0.1', to keep "
                             "them apart from the same ablation at another rate on merging)")
    parser.add_argument("--replot", nargs="+", default=None, metavar="JSON",
                        help="redraw the plots and reprint the tables of earlier runs; the "
                             "records of one task in several files are merged")
    parser.add_argument("--smoke", action="store_true",
                        help="the whole pipeline at toy size (about a minute on one core): "
                             "20 steps, 2 learning rates, 2 seeds, 1 ablation seed, small "
                             "batches, a 64-wide GPT-2")
    args = parser.parse_args(argv)
    for option, names, known in (("--optimizers", args.optimizers, OPTIMIZERS),
                                 ("--ablations", args.ablations, {**ABLATIONS, **NAMED_ONLY})):
        unknown = set(names or ()) - set(known)
        if unknown:
            parser.error(f"{option}: unknown {sorted(unknown)}; choose from {list(known)}")
    if args.smoke:
        args.steps, args.seeds, args.ablation_seeds, args.lr_points = 20, 2, 1, 2
        args.max_lr_points = 2
        args.batch_size, args.text_batch_size, args.val_windows = 16, 4, 16
        args.gpt2_width, args.lora_base_steps = 64, 20
    if args.out is None:
        args.out = os.path.join("outputs", "ablation-smoke" if args.smoke else "ablation")
    return args


def publish(records: list[dict], header: str, args, json_name: str | None = None) -> None:
    """Save the records as ``args.out/json_name`` (if named; floats rounded, and the tables
    are those of the saved JSON), print the header and each task's report, draw its plots."""
    if json_name:
        records = compact(records)
        with open(os.path.join(args.out, json_name), "w") as f:
            json.dump({"header": header, "records": records}, f)
    print(header + "\n")
    for record in records:
        print(report(record, args) + "\n", flush=True)
        for path in plot(record, args.out, args):
            print(f"wrote {path}")


def header() -> str:
    return f"`{command_line()}`; {hardware()}; time is CPU time of the one-thread process"


TASKS = {"resnet": resnet_task, "gpt2": gpt2_task, "lora": lora_task,
         "finetune": finetune_task}


def main(argv=None) -> None:
    args = parse(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.replot:
        records, headers = merge(args.replot)
        return publish(records, "\n".join(headers), args)
    torch.set_num_threads(args.threads)
    publish([run_task(TASKS[name](args), args) for name in args.tasks], header(), args,
            "ablation.json")


if __name__ == "__main__":
    main()
