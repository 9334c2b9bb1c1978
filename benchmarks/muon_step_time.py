"""Optimizer-step time of spectral descent (Muon) against ``torch.optim.Muon``, with the same
numbers, in one process and per rank under DDP on gloo.

The parameters are the hidden matrices of a GPT-2 (``--layers`` layers, ``--width`` wide:
``c_attn``, ``attn.c_proj``, ``c_fc``, ``mlp.c_proj``), with fixed gradients. Both optimizers
are configured by the documented mapping (momentum 0.95 with Nesterov, decoupled weight
decay, ``"match_rms_adamw"``, bfloat16 Newton–Schulz), and each run checks that they
produced the same parameters (relative difference of the movement, bfloat16 rounding).
Rounds are interleaved (torch's step, then ours, each timed per rank between barriers);
the table gives medians over rounds of the slowest rank's time. Under DDP every rank of
torch.optim.Muon orthogonalizes every matrix (it knows nothing of the other ranks), while
ours orthogonalizes the matrices a rank owns and all-gathers the directions.

    python -m benchmarks.muon_step_time --worlds 1 2 4
    python -m benchmarks.muon_step_time --worlds 2 4 --communication-dtype bfloat16
    python -m benchmarks.muon_step_time --worlds 1 2 --rounds 3 --layers 1 --width 64
    python -m benchmarks.muon_step_time --device cuda --worlds 1 --layers 12 --width 768

On a GPU (``--device cuda``, one process) each step is bracketed by
``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import command_line, hardware, median, synchronize
from benchmarks.tasks import make_gpt2
from hf_shampoo import DistributedShampoo

HIDDEN = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
MU, LR, WD = 0.95, 0.02, 0.1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def hidden_matrices(layers: int, width: int) -> list[torch.Tensor]:
    model = make_gpt2(0, n_layer=layers, n_embd=width)
    return [p.detach().clone() for n, p in model.named_parameters() if n.endswith(HIDDEN)]


def optimizers(weights: list[torch.Tensor], world: int, communication_dtype=torch.float32):
    theirs = [torch.nn.Parameter(w.clone()) for w in weights]
    ours = [torch.nn.Parameter(w.clone()) for w in weights]
    g = torch.Generator().manual_seed(1)
    for p, q in zip(theirs, ours):
        p.grad = torch.randn(p.shape, generator=g).to(p.device)
        q.grad = p.grad.clone()
    muon = torch.optim.Muon(theirs, lr=LR, momentum=MU, nesterov=True, weight_decay=WD,
                            adjust_lr_fn="match_rms_adamw")
    shampoo = DistributedShampoo(
        ours, lr=LR, betas=(MU, 1.0), beta3=MU**2, use_bias_correction=False, weight_decay=WD,
        preconditioner="spectral_descent", spectral_lr_adjustment="match_rms_adamw",
        newton_schulz_dtype=torch.bfloat16, max_preconditioner_dim=2**31 - 1,
        distributed="ddp" if world > 1 else "none", communication_dtype=communication_dtype)
    return muon, shampoo, theirs, ours


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def measure(world: int, args) -> dict:
    """Per-round step times of this rank, and the check that both moved alike."""
    device = torch.device(args.device)
    weights = [w.to(device) for w in hidden_matrices(args.layers, args.width)]
    muon, shampoo, theirs, ours = optimizers(weights, world, DTYPES[args.communication_dtype])
    times = {"torch": [], "ours": []}
    for round_ in range(args.warmup + args.rounds):
        for name, opt in (("torch", muon), ("ours", shampoo)):
            barrier(world)
            synchronize(device)
            start = time.perf_counter()
            opt.step()
            synchronize(device)
            elapsed = time.perf_counter() - start
            if round_ >= args.warmup:
                times[name].append(elapsed)
    difference = max(float((q.detach() - p.detach()).norm() / (p.detach() - w).norm())
                     for p, q, w in zip(theirs, ours, weights))
    return {"times": times, "difference": difference, "matrices": len(weights),
            "owned": sum(row["owned"] for row in shampoo.describe_blocks())}


def _rank(rank: int, world: int, init_file: str, out_dir: str, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    result = measure(world, args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run_world(world: int, args) -> list[dict]:
    if world == 1:
        torch.set_num_threads(1)
        return [measure(1, args)]
    root = tempfile.mkdtemp(prefix="muon_step_")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(world, os.path.join(root, "init"), root, args), nprocs=world,
             join=True)
    return [torch.load(os.path.join(root, f"rank{r}.pt"), weights_only=False)
            for r in range(world)]


def row(world: int, results: list[dict]) -> str:
    # per round: the slowest rank (a step is done when every rank is)
    rounds = len(results[0]["times"]["torch"])
    slowest = {name: [max(r["times"][name][k] for r in results) for k in range(rounds)]
               for name in ("torch", "ours")}
    theirs, ours = median(slowest["torch"]), median(slowest["ours"])
    owned = "/".join(str(r["owned"]) for r in results)
    difference = max(r["difference"] for r in results)
    return (f"| {world} | {results[0]['matrices']} | {owned} | {theirs * 1e3:.1f} | "
            f"{ours * 1e3:.1f} | **{ours / theirs:.2f}×** | {difference:.1e} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu",
                        help="cpu, or cuda for one process on a GPU (--worlds 1)")
    parser.add_argument("--communication-dtype", choices=list(DTYPES), default="float32",
                        help="dtype of our all-gathered directions (float32: bit-identical "
                             "to one process; bfloat16: half the traffic, each update "
                             "rounded to bfloat16 as torch.optim.Muon's is)")
    args = parser.parse_args(argv)
    if args.device != "cpu" and args.worlds != [1]:
        parser.error(f"--device {args.device} runs one process: pass --worlds 1")
    torch.set_num_threads(1)
    print(f"`{command_line()}`; {hardware()}; "
          "one thread per rank\n")
    print(f"GPT-2 hidden matrices ({args.layers} layers, width {args.width}); median over "
          f"{args.rounds} interleaved rounds of the slowest rank's step; our directions "
          f"all-gathered in {args.communication_dtype}\n")
    print("| ranks | matrices | matrices per rank (ours) | torch.optim.Muon ms | ours ms | "
          "ours / torch | max relative difference |")
    print("|---|---|---|---|---|---|---|")
    for world in args.worlds:
        print(row(world, run_world(world, args)), flush=True)


if __name__ == "__main__":
    main()
