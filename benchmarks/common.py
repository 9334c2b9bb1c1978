"""Shared pieces of the benchmarks: the models' parameter shapes, gradients, timing, the
shared command-line options, markdown tables and marked sections, simulated ranks.

Models are built from configs with random weights (no downloads): timm's ResNet-50 and a
GPT-2-small-sized transformers model (124M parameters). Benchmarks time the optimizer on
the models' parameters with fixed random gradients, so that every implementation sees
the same inputs.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_shampoo import DistributedShampoo, eigenbasis
from hf_shampoo.blocking import ParamBlocking
from hf_shampoo.distributors import (
    DataParallelDistributor,
    SingleProcessDistributor,
    block_cost,
    greedy_assignment,
)
from hf_shampoo.distributors.placements import chunk_boxes
from hf_shampoo.distributors.sharded import ShardedDistributor
from hf_shampoo.stack import BlockRef, BlockStack

MODELS = ("resnet50", "gpt2", "gpt2-medium", "gpt2-tiny")
MIB = 2.0**20
OPTIONS = {  # the options several benchmarks take, their defaults given by each (arguments)
    "model": dict(choices=MODELS),
    "models": dict(nargs="+", choices=MODELS),
    "worlds": dict(type=int, nargs="+", help="world sizes (ranks)"),
    "threads": dict(type=int, help="torch's CPU threads"),
    "rounds": dict(type=int, help="interleaved timing rounds"),
    "repeats": dict(type=int, help="timed steps"),
    "steps": dict(type=int),
    "seeds": dict(type=int),
}


def arguments(doc: str, **defaults) -> argparse.ArgumentParser:
    """A benchmark's parser, described by the first line of its docstring, with the shared
    ``OPTIONS`` named in ``defaults`` (``threads=1``: ``--threads``, default 1)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, default in defaults.items():
        parser.add_argument(f"--{name}", default=default, **OPTIONS[name])
    return parser


class OperatorCount(TorchDispatchMode):
    """Counts the non-view ATen operators dispatched inside it (``operators``): on a GPU
    each is a kernel launch, so the count is the CPU proxy for a step's launch overhead.
    ``where`` names the part of the step being counted (``by_part``), for callers that
    tell parts apart."""

    def __init__(self) -> None:
        super().__init__()
        self.where = "step"
        self.by_part: dict[str, int] = {}

    @property
    def operators(self) -> int:
        return sum(self.by_part.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.by_part[self.where] = self.by_part.get(self.where, 0) + 1
        return func(*args, **(kwargs or {}))


def build_model(name: str) -> torch.nn.Module:
    """``resnet50`` (timm), ``gpt2`` (small: 12 layers, 768 wide, 124M), ``gpt2-medium``
    (24 layers, 1024 wide, 355M) and ``gpt2-tiny`` (2 layers, 64 wide: for tests)."""
    if name == "resnet50":
        import timm

        return timm.create_model("resnet50", pretrained=False)
    if name in ("gpt2", "gpt2-medium", "gpt2-tiny"):
        from transformers import GPT2Config, GPT2LMHeadModel

        sizes = {"gpt2": {}, "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=16),
                 "gpt2-tiny": dict(n_layer=2, n_embd=64, n_head=2, vocab_size=512,
                                   n_positions=64, bos_token_id=0, eos_token_id=0)}
        return GPT2LMHeadModel(GPT2Config(**sizes[name]))
    raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")


def command_line() -> str:
    """The running benchmark's command as a reader reruns it from the repository root:
    ``python -m benchmarks.NAME ARGS`` (also when it was started by its path)."""
    name = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    return shlex.join(["python", "-m", f"benchmarks.{name}", *sys.argv[1:]])


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on CPU): timings must include it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def parameters_with_grads(model: torch.nn.Module, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = trainable(model)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
    return params


def log(message: str) -> None:
    """A progress line on stderr (stdout holds the tables)."""
    print(message, file=sys.stderr, flush=True)


def table_row(*cells) -> str:
    """One markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table_head(*columns: str) -> str:
    """A markdown table's header row and the separator under it."""
    return table_row(*columns) + "\n" + "|---" * len(columns) + "|"


def markers(script: str) -> tuple[str, str]:
    """The comments around a script's section of a results page (``write_section``)."""
    return f"<!-- {script}.py:begin -->", f"<!-- {script}.py:end -->"


def load_average() -> str:
    return f"\nLoad average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}."


def write_section(path: str, text: str, begin: str, end: str) -> None:
    """Put ``text`` between the markers ``begin`` and ``end`` of a markdown file, replacing
    what was there (the markers and the section are appended if missing)."""
    old = open(path).read() if os.path.exists(path) else ""
    block = f"{begin}\n{text}\n{end}"
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        new = head + block + rest.split(end, 1)[1]
    else:
        new = old + ("\n" if old else "") + block + "\n"
    with open(path, "w") as f:
        f.write(new)


def timed(fn: Callable[[], object], repeats: int, device: str | torch.device = "cpu"
          ) -> list[float]:
    """Seconds of each of ``repeats`` calls, the device's queued work included."""
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def timed_once(fn: Callable[[], object], device: torch.device | str = "cpu") -> float:
    """Seconds of one call. On CUDA: events recorded around it on the current stream,
    after a host synchronisation (earlier work is not counted), read once it is done."""
    if torch.device(device).type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    torch.cuda.synchronize(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def median(values: list[float]) -> float:
    return statistics.median(values)


def cpuinfo(field: str) -> str:
    """The first ``field`` of ``/proc/cpuinfo`` ("" where there is none, or no such file)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's processor elsewhere)."""
    return cpuinfo("model name") or platform.processor() or platform.machine()


def hardware() -> str:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"{cpu_name()}, {torch.get_num_threads()} thread(s), {gpu}; "
            f"torch {torch.__version__}, Python {platform.python_version()}")


class StaleCounter:
    """Counts the factor matrices the refresh criterion checks and finds stale (a context
    manager around ``eigenbasis.check_basis``). With ``count_tolerance_zero=False`` the calls
    with τ = 0, where every matrix is stale by definition, are not counted. SOAP's QR
    refresh (Meta's QR algorithm, ``eigenbasis.qr_algorithm_direct``) checks the criterion
    before each of its iterations: only the check before the first one is counted."""

    def __init__(self, count_tolerance_zero: bool = True) -> None:
        self.checked = self.stale = 0
        self.count_tolerance_zero = count_tolerance_zero
        self._real = eigenbasis.check_basis
        self._real_qr = eigenbasis.qr_algorithm_direct
        self._in_qr = False

    def _count(self, stale, tolerance: float) -> None:
        if tolerance > 0 or self.count_tolerance_zero:
            self.checked += len(stale)
            self.stale += int(stale.sum())

    def __enter__(self):
        def counting(matrices, basis, tolerance, *args, **kwargs):
            result = self._real(matrices, basis, tolerance, *args, **kwargs)
            if not self._in_qr:
                self._count(result.stale, tolerance)
            return result

        def counting_qr(matrices, basis, iterations, tolerance=0.0, *args, **kwargs):
            first = self._real(matrices, basis, tolerance, zero_means_all=False)
            self._count(first.stale, tolerance)
            self._in_qr = True
            try:
                return self._real_qr(matrices, basis, iterations, tolerance, *args, **kwargs)
            finally:
                self._in_qr = False

        eigenbasis.check_basis = counting
        eigenbasis.qr_algorithm_direct = counting_qr
        return self

    def __exit__(self, *exc) -> None:
        eigenbasis.check_basis = self._real
        eigenbasis.qr_algorithm_direct = self._real_qr


class SimulatedRank(SingleProcessDistributor):
    """One rank's share of a ``world``-rank run, computed without communicating: assigns
    blocks like the data-parallel distributor and computes only ``rank``'s blocks (the
    all-gather is skipped; its volume is reported instead)."""

    def __init__(self, world: int, rank: int, communication_dtype=torch.float32,
                 assignment_cost: str = "memory") -> None:
        self.communication_dtype = communication_dtype
        self.world_size, self.rank, self.assignment_cost = world, rank, assignment_cost
        self.segment_numel = 0

    def assign(self, blocks, block_shapes, costs=None, slots=None, units=None):
        # the data-parallel distributor's own rule, without its process group
        return DataParallelDistributor.assign(self, blocks, block_shapes, costs, slots, units)

    def allocate_directions(self, stacks) -> None:
        super().allocate_directions(stacks)
        sizes = [0] * self.world_size
        for s in stacks:
            sizes[s.rank] += len(s.members) * s.directions[0].numel()
        self.segment_numel = max(sizes)

    def all_gather_bytes(self) -> int:
        return self.world_size * self.segment_numel * self.communication_dtype.itemsize


class SimulatedOwner(SingleProcessDistributor):
    """Rank ``rank`` of a ``world``-rank lossless FSDP2 run without communicating: the real
    assignment, only this rank's blocks computed (every direction is still applied)."""

    def __init__(self, world: int, rank: int) -> None:
        super().__init__()
        self.world_size, self.rank = world, rank

    def assign(self, blocks, block_shapes, costs=None, slots=None, units=None):
        return simulated_sharded(self.world_size).assign(blocks, block_shapes, costs,
                                                         units=units)


def simulated_step(params, distributor, max_dim: int, repeats: int
                   ) -> tuple[DistributedShampoo, float, float]:
    """One rank's optimizer (Adam grafting, float32) with ``distributor`` (None: all
    blocks): (the optimizer, its first refresh's seconds, the median of ``repeats`` steady
    steps)."""
    opt = DistributedShampoo(params, lr=1e-3, betas=(0.9, 0.999), grafting="adam",
                             max_preconditioner_dim=max_dim, precondition_frequency=10**6,
                             start_preconditioning_step=10**6, distributed="none")
    if distributor is not None:
        opt.distributor = distributor  # before the first step builds the layout
    opt.step()  # allocates state (a grafting-only step)
    for group in opt.param_groups:  # the next step is the first refresh, then steady steps
        group["step"] = group["start_preconditioning_step"] - 1
    refresh = timed(opt.step, 1)[0]
    return opt, refresh, median(timed(opt.step, repeats))


def simulated_sharded(world: int) -> ShardedDistributor:
    """The lossless distributor's plan for rank 0 of a ``world``-rank FSDP2 mesh (rows
    chunked as ``fully_shard`` does), without a process group."""
    return ShardedDistributor(rank=0, world_size=world, boxes_of=lambda params, names: {
        i: chunk_boxes(p.shape, world) for i, p in params.items()})


def blocks_of(params, max_dim: int) -> list[BlockRef]:
    blocks = []
    for index, p in enumerate(params):
        blocking = ParamBlocking.of(p.shape, max_dim)
        single = len(blocking.slices) == 1
        blocks += [BlockRef(0, index, b, p, str(index), blocking.merged, None if single else sl)
                   for b, sl in enumerate(blocking.slices)]
    return blocks


def block_shape(block) -> tuple[int, ...]:
    if block.slices is None:
        return block.merged
    return tuple(s.stop - s.start for s in block.slices)


def owners(params, world: int, scheme: str, max_dim: int) -> list[tuple[tuple[int, ...], int]]:
    """(shape, owner rank) of every block under the data-parallel assignment (``"ddp"``:
    greedy by ``block_cost``) or the lossless FSDP2 plan (``"fsdp"``)."""
    blocks = blocks_of(params, max_dim)
    shapes = [block_shape(b) for b in blocks]
    if scheme == "ddp":
        return list(zip(shapes, greedy_assignment([block_cost(s) for s in shapes], world)))
    return list(zip(shapes, simulated_sharded(world).assign(blocks, shapes)))


def state_bytes(shape: tuple[int, ...], group: dict) -> dict[str, int]:
    """Bytes of each state entry of one float32 block of ``shape`` under ``group``."""
    return BlockStack(0, shape, [], torch.float32).state_bytes(group)


def row_counts(rows: int, world: int) -> list[int]:
    """Each rank's rows of a dim of ``rows`` chunked as ``fully_shard`` does."""
    chunk = -(-rows // world)
    return [max(0, min(rows, (r + 1) * chunk) - min(rows, r * chunk)) for r in range(world)]
