"""Data-parallel Shampoo with plain PyTorch DDP: the launch that `torchrun` users type.

Each rank trains a DDP-wrapped CNN on its shard of scikit-learn's bundled digits (no
download) and steps `DistributedShampoo`, which finds the process group by itself
(`distributed="auto"`), keeps optimizer state only for the blocks its rank owns and
all-gathers the updates once per step. The script prints the loss, each rank's share of
the optimizer state, and checks at the end that every rank holds the same parameters.

    # one machine, two CPU processes (gloo):
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 examples/ddp_train.py
    # one machine, 8 GPUs (NCCL):
    torchrun --standalone --nproc_per_node 8 examples/ddp_train.py
    # two machines with 8 GPUs each (run on both, node_rank 0 and 1):
    torchrun --nnodes 2 --node_rank 0 --master_addr HOST --master_port 29500 \\
        --nproc_per_node 8 examples/ddp_train.py
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn

from hf_shampoo import DistributedShampoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--precondition-frequency", type=int, default=10)
    parser.add_argument("--communication-dtype", choices=["float32", "bfloat16"],
                        default="float32")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    launched = "RANK" in os.environ
    if launched:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if launched else 0
    world = dist.get_world_size() if launched else 1
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(digits.target)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(128, 10),
    ).to(device)
    ddp = nn.parallel.DistributedDataParallel(model) if launched else model
    optimizer = DistributedShampoo(
        ddp.parameters(), lr=args.lr, betas=(0.9, 0.999), epsilon=1e-12,
        grafting="adam", grafting_beta2=0.999, grafting_epsilon=1e-8, weight_decay=1e-4,
        precondition_frequency=args.precondition_frequency, max_preconditioner_dim=256,
        communication_dtype=getattr(torch, args.communication_dtype),
    )
    generator = torch.Generator().manual_seed(1)  # same order on every rank, disjoint shards
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = torch.randint(len(y), (world * args.batch_size,), generator=generator)
        mine = batch[rank * args.batch_size:(rank + 1) * args.batch_size]
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x[mine].to(device)), y[mine].to(device))
        loss.backward()
        optimizer.step()
        if rank == 0 and (step == 1 or step % 20 == 0):
            print(f"step {step:4d}  loss {loss.item():.4f}")
    elapsed = time.perf_counter() - start

    state_mib = sum(t.numel() * t.element_size()
                    for entry in optimizer.state_dict()["state"].values()
                    for t in entry.values()) / 2**20
    checksum = torch.cat([p.detach().flatten() for p in model.parameters()]).double().sum()
    summary = torch.tensor([state_mib, checksum.item()], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(summary) for _ in range(world)]
    if launched:
        dist.all_gather(gathered, summary)
    else:
        gathered = [summary]
    if rank == 0:
        with torch.no_grad():
            accuracy = (model(x.to(device)).argmax(1).cpu() == y).float().mean().item()
        shares = ", ".join(f"rank {r}: {g[0].item():.2f} MiB" for r, g in enumerate(gathered))
        same = all(torch.equal(g[1], gathered[0][1]) for g in gathered)
        print(f"world {world}: {elapsed / args.steps * 1000:.0f} ms/step, "
              f"accuracy {accuracy:.3f}, optimizer state {shares}, "
              f"ranks hold identical parameters: {same}")
    if launched:
        # every rank done with rank 0's report before any tears its process group down (a
        # rank that exits while gloo threads of a peer still talk to it was seen to abort)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
