"""End-to-end training step time (forward + backward + optimizer step + zero_grad) of
Shampoo against fused AdamW, on a GPU. The goal it checks: with
``precondition_frequency=100`` and ``refresh_schedule="staggered"``, Shampoo's mean step
is at most 1.10x AdamW's (``--muon``: Muon's, at most 1.05x).

Every optimizer gets the same model initialisation and batches, each run a fresh copy of
the model, one after the other: ``resnet50`` (timm, ``channels_last``, synthetic
ImageNet-shaped batches, autocast, a plain loop; Shampoo staggered and ``"all"``) and
``gpt2`` (GPT-2 small through the transformers ``Trainer``: ``optim="adamw_torch_fused"``
against ``optim="distributed_shampoo"`` with ``optim_args``, step times from a callback;
the Trainer's defaults, ``refresh_delay=1`` among them, unless a row says otherwise).

Window: preconditioning starts at step F and the staggered schedule delays each block by
an offset in [0, F), so the last block's first refresh is step 2F - 1. After 2F + 1
warm-up steps, F steps are timed: every block is preconditioning and refreshes exactly
once in the window, under either schedule. On CUDA each step is bracketed by
``torch.cuda.synchronize()``.

    python -m benchmarks.end_to_end --json $OUT/e2e.json      # on a GPU: a few minutes
    python -m benchmarks.end_to_end --tiny --device cpu       # CPU-sized check, ~20 s
    python -m benchmarks.end_to_end --write docs/benchmarks/gpu.md     # its marked section
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator

import torch

from benchmarks.common import (
    hardware,
    log,
    markers,
    median,
    synchronize,
    table_head,
    table_row,
    write_section,
)
from hf_shampoo import DistributedShampoo  # also registers the Trainer name
from hf_shampoo.config import start_step

MARK_BEGIN, MARK_END = markers("end_to_end")
WORKLOADS = ("resnet50", "gpt2")
GOAL = 1.10  # Shampoo (staggered) mean step / AdamW's
N_BATCHES = 4  # distinct batches, cycled
# --variants: Shampoo keywords, and the same as optim_args for the Trainer
VARIANTS = {
    "qr": (dict(eigendecomposition="qr", orthogonalization="cholesky_qr"),
           "eigendecomposition=qr,orthogonalization=cholesky_qr"),
    "bf16-roots": (dict(inv_factor_matrix_dtype=torch.bfloat16),
                   "inv_factor_matrix_dtype=bfloat16"),
    "fused": (dict(stacking="fused"), "stacking=fused"),
    "tf32": (dict(apply_precision="tf32"), "apply_precision=tf32"),
}
FULL = dict(batch_size=256, image_size=224, seq_len=1024, gpt2_batch_size=8, frequency=100)
TINY = dict(batch_size=4, image_size=32, seq_len=32, gpt2_batch_size=2, frequency=4)


def variant_keywords(args) -> dict[str, tuple[dict, str]]:
    """The Shampoo rows beyond the two schedules, ``--variants`` and ``--refresh-delay``:
    name → (keywords, the same as optim_args)."""
    out = {variant: VARIANTS[variant] for variant in args.variants}
    if args.refresh_delay is not None:
        d = args.refresh_delay
        out[f"refresh_delay={d}"] = (dict(refresh_delay=d), f"refresh_delay={d}")
    return out


def fused_adamw_supported(device: torch.device) -> bool:
    p = torch.zeros(2, device=device, requires_grad=True)
    p.grad = torch.ones_like(p)
    try:
        torch.optim.AdamW([p], fused=True).step()
        return True
    except (RuntimeError, ValueError) as error:
        log(f"note: fused AdamW unsupported on {device} ({error}); using foreach instead")
        return False


class Span:
    """The time of one stretch inside a step, without a synchronisation of its own: CUDA
    events recorded at ``begin``/``end`` and read once the step has been synchronised
    (``seconds``); on a CPU the clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def begin(self) -> None:
        if self.cuda:
            self.events = (torch.cuda.Event(enable_timing=True),
                           torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        else:
            self.start = time.perf_counter()

    def end(self) -> None:
        if self.cuda:
            self.events[1].record()
        else:
            self.stop = time.perf_counter()

    def seconds(self) -> float:
        if self.cuda:
            return self.events[0].elapsed_time(self.events[1]) / 1e3
        return self.stop - self.start


def summary(times: list[float]) -> dict:
    return {"mean": statistics.fmean(times), "median": median(times), "max": max(times)}


def shampoo_facts(opt: DistributedShampoo) -> dict:
    """What the optimizer was configured with and whether its blocks preconditioned: a
    block counts as refreshed when one of its inverse roots is no longer the identity
    they start as (``opt.state_dict()``: ``block_{b}.inverse_root_{j}`` per parameter)."""
    blocks = refreshed = 0
    for entry in opt.state_dict()["state"].values():
        roots: dict[str, list[torch.Tensor]] = {}
        for key, tensor in entry.items():
            block, name = key.split(".", 1)
            if name.startswith("inverse_root_") and tensor.dim() == 2:
                roots.setdefault(block, []).append(tensor)
        for tensors in roots.values():
            blocks += 1
            refreshed += any(not torch.equal(t, torch.eye(len(t), dtype=t.dtype, device=t.device))
                             for t in tensors)
    groups = opt.param_groups

    def values(key):
        return sorted({g[key] for g in groups})
    return {"class": type(opt).__name__, "step": values("step"),
            "precondition_frequency": values("precondition_frequency"),
            "start_preconditioning_step": sorted({start_step(g) for g in groups}),
            "refresh_schedule": values("refresh_schedule"),
            "max_preconditioner_dim": values("max_preconditioner_dim"),
            "blocks_with_roots": blocks, "blocks_refreshed": refreshed,
            "distinct_refresh_offsets": len({r["refresh_offset"] for r in opt.describe_blocks()})}


def free_memory(device: torch.device) -> float | None:
    """Collect the last run's garbage, reset the peak; GiB still allocated (CUDA)."""
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device) / 2**30


# ----------------------------------------------------------------------------- ResNet-50
def make_resnet(tiny: bool) -> torch.nn.Module:
    import timm

    if tiny:  # ResNet-50's bottleneck blocks, one per stage, 16-128 wide, 10 classes
        return timm.create_model("resnet50", pretrained=False, layers=(1, 1, 1, 1),
                                 channels=(16, 32, 64, 128), stem_width=16, num_classes=10)
    return timm.create_model("resnet50", pretrained=False)


def resnet_runs(args, device: torch.device, fused: bool) -> Iterator[dict]:
    classes = 10 if args.tiny else 1000
    g = torch.Generator(device=device).manual_seed(0)
    shape = (args.batch_size, 3, args.image_size, args.image_size)
    batches = [(torch.randn(shape, generator=g, device=device)
                .contiguous(memory_format=torch.channels_last),
                torch.randint(0, classes, (args.batch_size,), generator=g, device=device))
               for _ in range(N_BATCHES)]
    shampoo = dict(lr=1e-3, betas=(0.9, 0.999), epsilon=1e-12, weight_decay=0.05,
                   grafting="adam", max_preconditioner_dim=1024,
                   precondition_frequency=args.frequency, distributed="none")
    flavour = {"fused": True} if fused else {"foreach": True}
    optimizers = {
        f"AdamW ({'fused' if fused else 'foreach'})":
            lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.05, **flavour),
        f"Shampoo staggered, F={args.frequency}":
            lambda p: DistributedShampoo(p, refresh_schedule="staggered", **shampoo),
        f"Shampoo all, F={args.frequency}":
            lambda p: DistributedShampoo(p, refresh_schedule="all", **shampoo),
    }
    for variant, (keywords, _) in variant_keywords(args).items():
        optimizers[f"Shampoo staggered, F={args.frequency}, {variant}"] = (
            lambda p, kw=keywords: DistributedShampoo(p, refresh_schedule="staggered",
                                                      **shampoo, **kw))
    for name, make in optimizers.items():
        resident = free_memory(device)
        torch.manual_seed(0)
        model = make_resnet(args.tiny).to(device, memory_format=torch.channels_last).train()
        opt = make(model.parameters())
        times, optimizer_times, facts, first = [], [], None, None
        span = Span(device)
        log(f"resnet50 / {name}: {args.total} steps")
        for step in range(args.total):
            if step == args.warmup and isinstance(opt, DistributedShampoo):
                facts = shampoo_facts(opt)
            x, y = batches[step % N_BATCHES]
            synchronize(device)
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=args.dtype, enabled=args.amp):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            span.begin()
            opt.step()
            span.end()
            opt.zero_grad(set_to_none=True)
            synchronize(device)
            times.append(time.perf_counter() - start)
            optimizer_times.append(span.seconds())
            if step == 0:  # after the clock: .item() synchronises
                first = loss.item()
            progress(step, args.total, times)
        yield record("resnet50", name, times, args, device, opt, facts, resident,
                     optimizer_times, first_loss=first, final_loss=loss.item())
        del model, opt, loss


# ----------------------------------------------------------------------------- GPT-2
def gpt2_runs(args, device: torch.device, fused: bool) -> Iterator[dict]:
    import transformers as hf

    config = (hf.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, bos_token_id=0,
                            eos_token_id=0, n_positions=args.seq_len)
              if args.tiny else hf.GPT2Config())
    if args.seq_len > config.n_positions:
        raise SystemExit(f"--seq-len {args.seq_len} > GPT-2's n_positions {config.n_positions}")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (N_BATCHES * args.gpt2_batch_size, args.seq_len),
                        generator=g)
    dataset = [{"input_ids": row, "labels": row} for row in ids]

    class StepTimer(hf.TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.optimizer_times: list[float] = []
            self.span = Span(device)
            self.facts = self.first_loss = None

        def on_log(self, targs, state, control, logs=None, **kwargs):
            if state.global_step == 1:  # logging_first_step: the loss before any update
                self.first_loss = logs["loss"]

        def on_step_begin(self, targs, state, control, **kwargs):
            synchronize(device)
            self.start = time.perf_counter()

        def on_pre_optimizer_step(self, targs, state, control, **kwargs):
            self.span.begin()

        def on_optimizer_step(self, targs, state, control, **kwargs):
            self.span.end()

        def on_step_end(self, targs, state, control, optimizer=None, **kwargs):
            synchronize(device)
            self.times.append(time.perf_counter() - self.start)
            self.optimizer_times.append(self.span.seconds())
            progress(len(self.times) - 1, args.total, self.times)
            shampoo = unwrap(optimizer)
            if len(self.times) == args.warmup and isinstance(shampoo, DistributedShampoo):
                self.facts = shampoo_facts(shampoo)

    optim_args = (f"precondition_frequency={args.frequency},refresh_schedule=staggered,"
                  "max_preconditioner_dim=1024")
    adamw = "adamw_torch_fused" if fused else "adamw_torch"
    runs = [(f"AdamW ({adamw})", adamw, None),
            (f"Shampoo staggered, F={args.frequency}", "distributed_shampoo", optim_args)]
    runs += [(f"Shampoo staggered, F={args.frequency}, {variant}", "distributed_shampoo",
              f"{optim_args},{text}") for variant, (_, text) in variant_keywords(args).items()]
    if args.muon:
        runs.append(("Muon (distributed_muon)", "distributed_muon", None))
        if "fused" in args.variants:
            runs.append(("Muon (distributed_muon), fused", "distributed_muon", "stacking=fused"))
    for name, optim, extra in runs:
        resident = free_memory(device)
        torch.manual_seed(0)
        model = hf.GPT2LMHeadModel(config)
        timer = StepTimer()
        log(f"gpt2 / {name}: {args.total} steps" + (f", optim_args={extra!r}" if extra else ""))
        with tempfile.TemporaryDirectory() as out:
            targs = hf.TrainingArguments(
                output_dir=out, optim=optim, optim_args=extra, learning_rate=1e-3,
                weight_decay=0.05, lr_scheduler_type="constant", max_steps=args.total,
                per_device_train_batch_size=args.gpt2_batch_size,
                bf16=args.dtype == torch.bfloat16, use_cpu=device.type != "cuda",
                report_to=[], save_strategy="no", logging_steps=10**6, logging_first_step=True,
                disable_tqdm=True, dataloader_num_workers=0, seed=0, data_seed=0)
            trainer = hf.Trainer(model=model, args=targs, train_dataset=dataset, callbacks=[timer])
            with contextlib.redirect_stdout(sys.stderr):  # the Trainer prints its metrics
                result = trainer.train()
        opt = unwrap(trainer.optimizer)
        yield record("gpt2", name, timer.times, args, device, opt, timer.facts, resident,
                     timer.optimizer_times, first_loss=timer.first_loss,
                     train_loss=result.training_loss, optim_args=extra)
        del model, trainer, opt


def unwrap(optimizer):
    """The optimizer inside Accelerate's ``AcceleratedOptimizer`` (if wrapped)."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


# ----------------------------------------------------------------------------- records
def progress(step: int, total: int, times: list[float]) -> None:
    if (step + 1) % max(1, total // 5) == 0 or step + 1 == total:
        log(f"  step {step + 1}/{total}, {sum(times):.1f} s so far, last {times[-1]:.3f} s")


def record(workload, name, times, args, device, opt, facts, resident, optimizer_times,
           **extra) -> dict:
    """One run: the window's step times and statistics, GPU memory (peak; ``resident``:
    allocated before the model was built, e.g. the image batches), ``extra`` (losses: the
    first step's, and the last step's or the Trainer's mean ``train_loss``), and what the
    optimizer was (Shampoo: its facts at the window's start and at the end)."""
    if len(times) != args.total:
        raise RuntimeError(f"{workload} / {name}: {len(times)} step times, expected {args.total}")
    window = times[args.warmup:]
    optimizer_window = optimizer_times[args.warmup:]
    run = {"workload": workload, "optimizer": name, "times": window,
           "optimizer_times": optimizer_window,
           "optimizer_mean": statistics.fmean(optimizer_window),
           "warmup_times": times[:args.warmup], **summary(window),
           "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30
           if device.type == "cuda" else None, "memory_at_start_gib": resident, **extra}
    if isinstance(opt, DistributedShampoo):
        run["shampoo_at_window_start"] = facts
        run["shampoo_at_end"] = shampoo_facts(opt)
    else:
        run["optimizer_class"] = type(opt).__name__
        run["fused"] = bool(opt.defaults.get("fused"))
    log(f"  mean {run['mean']:.4f} s, median {run['median']:.4f} s, max {run['max']:.4f} s")
    return run


def table(runs: list[dict], args, device: torch.device) -> str:
    tiny = " (tiny)" if args.tiny else ""
    sizes = {"resnet50": f"ResNet-50{tiny}: batch {args.batch_size}, {args.image_size}², "
                         "channels_last, a plain loop.",
             "gpt2": f"GPT-2{tiny or ' small'}: batch {args.gpt2_batch_size} × {args.seq_len} "
                     "tokens, transformers Trainer."}
    f = args.frequency
    lines = ["### End-to-end step time: Shampoo against AdamW", "",
             f"Hardware: {hardware()}. Device {device}, {str(args.dtype).removeprefix('torch.')}"
             f" ({'autocast' if args.amp else 'no autocast'}), fp32 matmul precision "
             f"{torch.get_float32_matmul_precision()}. "
             + " ".join(sizes[w] for w in WORKLOADS if w in args.workload)
             + f" Window: steps {args.warmup + 1}–{args.total}, {f} steps = one period of "
             f"F={f}, after {args.warmup} warm-up steps (preconditioning starts at step {f}, "
             f"staggered by step {2 * f - 1} for every block).", "",
             table_head("workload", "optimizer", "mean step s", "median s", "max s",
                        "max / median", "mean / AdamW", "optimizer step, mean s",
                        "peak GPU memory GiB")]
    goals = []
    for workload in WORKLOADS:
        rows = [r for r in runs if r["workload"] == workload]
        if not rows:
            continue
        base = rows[0]["mean"]
        for r in rows:
            memory = "–" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.1f}"
            lines.append(table_row(workload, r["optimizer"], f"{r['mean']:.4f}",
                                   f"{r['median']:.4f}", f"{r['max']:.4f}",
                                   f"{r['max'] / r['median']:.2f}", f"{r['mean'] / base:.2f}×",
                                   f"{r['optimizer_mean']:.4f}", memory))
        for r in rows[1:]:
            if "staggered" not in r["optimizer"]:
                continue
            ratio = r["mean"] / base
            goals.append(f"- {workload}: {r['optimizer']}: {ratio:.2f}× AdamW's mean step; "
                         f"goal ≤ {GOAL:.2f}×: {'met' if ratio <= GOAL else 'not met'}")
    return "\n".join(lines + [""] + goals)


def save_json(args, device: torch.device, runs: list[dict], complete: bool) -> None:
    config = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in vars(args).items()}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    with open(args.json, "w") as f:
        json.dump({"config": config, "device_name": name, "hardware": hardware(),
                   "torch": torch.__version__, "complete": complete, "runs": runs}, f, indent=1)


# ----------------------------------------------------------------------------- main
def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workload", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--frequency", type=int, default=None,
                        help="precondition_frequency F (100; --tiny: 4)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps before the F timed ones (default 2F + 1, >= F)")
    parser.add_argument("--batch-size", type=int, default=None, help="ResNet-50 (256)")
    parser.add_argument("--image-size", type=int, default=None, help="(224)")
    parser.add_argument("--seq-len", type=int, default=None, help="GPT-2 (1024)")
    parser.add_argument("--gpt2-batch-size", type=int, default=None, help="per device (8)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                        help="autocast dtype (default bf16 on CUDA, fp32 elsewhere)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads")
    parser.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=[],
                        help="also staggered Shampoo with these GPU-oriented options")
    parser.add_argument("--refresh-delay", type=int, default=None,
                        help="also Shampoo staggered with this refresh_delay (<= frequency; "
                             "the Trainer's default is 1, the plain class's 0)")
    parser.add_argument("--muon", action="store_true",
                        help="GPT-2: also optim=distributed_muon (goal: <= 1.05x AdamW); "
                        "with --variants fused, Muon with stacking=fused too")
    parser.add_argument("--tiny", action="store_true", help="CPU-sized models and steps")
    parser.add_argument("--json", default=None, help="write every step time here")
    parser.add_argument("--write", default=None, help="put the table into this markdown file")
    args = parser.parse_args(argv)
    for key, value in (TINY if args.tiny else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    f = args.frequency
    args.warmup = 2 * f + 1 if args.warmup is None else args.warmup
    if f < 1 or args.warmup < f:
        parser.error(f"need --frequency >= 1 and --warmup >= F (got {f}, {args.warmup})")
    args.total = args.warmup + f
    if args.dtype is None:
        args.dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    args.dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    args.amp = args.dtype != torch.float32
    return args


def main(argv=None) -> None:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    fused = fused_adamw_supported(device)
    log(f"{args.total} steps per run; timed: steps {args.warmup + 1}-{args.total} "
        f"(F={args.frequency} after {args.warmup} warm-up steps)")
    runs: list[dict] = []
    for workload, make_runs in (("resnet50", resnet_runs), ("gpt2", gpt2_runs)):
        if workload in args.workload:
            for run in make_runs(args, device, fused):
                runs.append(run)
                if args.json:  # after every run: a run cut short keeps what it measured
                    save_json(args, device, runs, complete=False)
    text = table(runs, args, device)
    print(text)
    if args.json:
        save_json(args, device, runs, complete=True)
    if args.write:
        write_section(args.write, text, MARK_BEGIN, MARK_END)
    if any(k.endswith("loss") and not math.isfinite(v) for r in runs for k, v in r.items()
           if isinstance(v, float)):
        log("warning: a run ended with a non-finite loss")


if __name__ == "__main__":
    main()
