"""The ranks of tests/test_generated_dp_layouts.py: one ``mp.spawn`` per world size runs every
drawn case of that world in sequence (DDP cases, ZeRO 1/2 flat-partition cases, and the
resumes of smaller worlds' checkpoints), each rank writing its per-case results to
``rank{r}.pt`` after every case: ``{case_id: [failure, ...]}`` (empty: every check held),
and ``running`` naming the case in progress (a hang leaves it there).

The one-process reference of case ``i`` is run by rank ``i % world`` (with
``distributed="none"``) and broadcast, so that the ranks share the reference work.
"""

from __future__ import annotations

import datetime
import os
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hf_shampoo import DistributedShampoo
from hf_shampoo.checkpoint import consolidate_checkpoint, load_sharded, save_sharded
from tests import layout_cases as lc
from tests.distributed_worker import after_step, before_step, small_factors_quantized
from tests.helpers import leave_gloo_world

#: how long a rank waits in a collective of the world group before it gives up (a case
#: whose ranks disagree must not hang the test; subgroups keep torch's default)
TIMEOUT_S = 120


def join(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))


# ------------------------------------------------------------------ shared pieces
def make_params(case: dict, values: list[torch.Tensor] | None = None
                ) -> list[torch.nn.Parameter]:
    values = values if values is not None else lc.full_params(case["shapes"],
                                                              case["data_seed"])
    return [torch.nn.Parameter(t.clone()) for t in values]


def make_optimizer(case: dict, params, **extra) -> DistributedShampoo:
    config = case["config"]
    return DistributedShampoo(lc.param_groups(params, case["names"], config),
                              **lc.optimizer_kwargs(config), **extra)


def grads_at(case: dict, step: int, zeros_for_missing: bool = False):
    grads = lc.full_grads(case["shapes"], case["data_seed"], step, case["no_grad"])
    if zeros_for_missing:
        grads = [torch.zeros(s) if g is None else g for g, s in zip(grads, case["shapes"])]
    return grads


def train(case: dict, params, opt, first: int, last: int, zeros_for_missing=False,
          after=None) -> None:
    """Steps ``first..last`` of the case (``train()`` / ``eval()`` as the Trainer calls
    them for iterate averaging); ``after(step)`` after each."""
    config = case["config"]
    with small_factors_quantized(config):
        for step in range(first, last + 1):
            for p, g in zip(params, grads_at(case, step, zeros_for_missing)):
                p.grad = g
            before_step(opt, config)
            opt.step()
            after_step(opt, config, step)
            if after is not None:
                after(step)


def state_sizes(opt) -> dict[str, int]:
    """``{"param.block_b.name": numel}`` of the state this rank holds."""
    state = opt.local_state_dict()["state"]
    return {f"{i}.{k}": t.numel() for i, entry in state.items() for k, t in entry.items()}


def compare(what: str, got, expected) -> list[str]:
    """``[]`` when every tensor is equal bit for bit, else one line with the largest
    difference."""
    got, expected = list(got), list(expected)
    if len(got) != len(expected):
        return [f"{what}: {len(got)} tensors, expected {len(expected)}"]
    bad = [(i, (a.double() - b.double()).abs().max().item() if a.shape == b.shape else
            f"shape {tuple(a.shape)} vs {tuple(b.shape)}")
           for i, (a, b) in enumerate(zip(got, expected)) if not torch.equal(a, b)]
    if not bad:
        return []
    return [f"{what}: not bit-identical to one process: parameters {[i for i, _ in bad]}, "
            f"max abs diff {max((d for _, d in bad if isinstance(d, float)), default=0):.3e}"
            f" ({bad})"]


def one_process(case: dict, zeros_for_missing: bool = False) -> dict:
    """The uninterrupted one-process run: final parameters and state sizes."""
    params = make_params(case)
    opt = make_optimizer(case, params, distributed="none")
    train(case, params, opt, 1, case["steps"], zeros_for_missing)
    return {"params": [p.detach().clone() for p in params], "state": state_sizes(opt)}


def shared_reference(case: dict, index: int, fn) -> Any:
    """``fn()`` on rank ``index % world``, broadcast to every rank (its exception, as
    text, too)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    box: list[Any] = [None]
    if rank == index % world:
        try:
            box[0] = ("ok", fn())
        except Exception:
            box[0] = ("error", traceback.format_exc())
    dist.broadcast_object_list(box, src=index % world)
    return box[0]


# ------------------------------------------------------------------ DDP
def checkpoint_dir(root: str, case_id: str) -> str:
    return os.path.join(root, "checkpoints", case_id)


def save_checkpoint(case: dict, params, opt, directory: str) -> None:
    """The documented DDP saves: ``save_sharded`` (every rank), or ``consolidate_state_dict``
    then rank 0's ``state_dict()``; rank 0 saves the parameters."""
    how = case["checkpoint"]["how"]
    if how == "sharded":
        save_sharded(opt, os.path.join(directory, "optimizer"))
    else:
        opt.consolidate_state_dict(to=0)
        if dist.get_rank() == 0:
            torch.save(opt.state_dict(), os.path.join(directory, "optimizer.pt"))
    if dist.get_rank() == 0:
        torch.save([p.detach().clone() for p in params], os.path.join(directory, "params.pt"))
    dist.barrier()


def resume(case: dict, directory: str, one: bool, **extra) -> list[torch.Tensor]:
    """Load the checkpoint written after step ``at`` into a fresh optimizer and train the
    remaining steps; ``one``: in this process alone (a sharded checkpoint through
    ``consolidate_checkpoint``, which needs no process group)."""
    at = case["checkpoint"]["at"]
    params = make_params(case, torch.load(os.path.join(directory, "params.pt"),
                                          weights_only=True))
    with small_factors_quantized(case["config"]):  # the layout the saved state has
        opt = make_optimizer(case, params, **extra)
        if case["checkpoint"]["how"] == "sharded":
            if one:
                consolidated = os.path.join(directory, f"consolidated{dist.get_rank()}.pt")
                consolidate_checkpoint(os.path.join(directory, "optimizer"), consolidated)
                opt.load_state_dict(torch.load(consolidated, weights_only=True))
            else:
                load_sharded(opt, os.path.join(directory, "optimizer"))
        else:
            opt.load_state_dict(torch.load(os.path.join(directory, "optimizer.pt"),
                                           weights_only=True))
    train(case, params, opt, at + 1, case["steps"])
    return [p.detach().clone() for p in params]


def check_state_partition(case: dict, mine: dict[str, int], reference: dict[str, int]
                          ) -> list[str]:
    """Every trainers-group of ranks holds one process's state once: within a group the
    ranks' keys are disjoint and together the reference's keys with the same sizes, and
    the ranks at the same position of every group hold the same keys."""
    world = dist.get_world_size()
    size = lc.trainers_size(case["trainers"], world)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    failures = []
    for start in range(0, world, size):
        group = everyone[start:start + size]
        keys = [set(s) for s in group]
        overlap = sum(len(k) for k in keys) - len(set().union(*keys))
        merged = {k: v for s in group for k, v in s.items()}
        if overlap or merged != reference:
            missing = sorted(set(reference) - set(merged))[:5]
            extra = sorted(set(merged) - set(reference))[:5]
            failures.append(
                f"state of ranks {start}..{start + size - 1}: {overlap} keys held twice, "
                f"{sum(merged.values())} elements vs one process's "
                f"{sum(reference.values())}; missing {missing}, extra {extra}")
        if size < world and [set(s) for s in group] != [set(s) for s in everyone[:size]]:
            failures.append(f"ranks {start}..{start + size - 1} own other blocks than ranks "
                            f"0..{size - 1}")
    return failures


def run_ddp_case(case: dict, case_id: str, index: int, root: str) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    checkpoint = case["checkpoint"]
    directory = checkpoint_dir(root, case_id)
    failures: list[str] = []
    state = None
    try:
        if checkpoint is not None and rank == 0:
            os.makedirs(directory, exist_ok=True)
        dist.barrier()
        params = make_params(case)
        opt = make_optimizer(case, params, distributed=case["distributed"],
                             num_trainers_per_group=case["trainers"])
        save_at = checkpoint["at"] if checkpoint else None
        train(case, params, opt, 1, case["steps"],
              after=lambda step: save_checkpoint(case, params, opt, directory)
              if step == save_at else None)
        kind = type(opt.distributor).__name__
        if kind != "DataParallelDistributor":
            failures.append(f"distributor {kind}, expected DataParallelDistributor")
        got = [p.detach().clone() for p in params]
        state = state_sizes(opt)
    except Exception:
        failures.append(f"rank {rank} raised:\n{traceback.format_exc()}")
        got = None
    status, reference = shared_reference(case, index, lambda: one_process(case))
    if status != "ok":
        return failures + [f"the one-process reference raised:\n{reference}"]
    if got is not None:
        failures += compare("DDP after every step", got, reference["params"])
    if state is not None and not any("raised" in f for f in failures):
        failures += check_state_partition(case, state, reference["state"])
    if checkpoint is None:
        return failures
    if rank == index % world:
        torch.save(reference["params"], os.path.join(directory, "reference.pt"))
    if checkpoint["resume_world"] == world:  # another num_trainers_per_group, here
        try:
            resumed = resume(case, directory, one=False, distributed=case["distributed"],
                             num_trainers_per_group=checkpoint["resume_trainers"])
            failures += compare(f"resumed with num_trainers_per_group="
                                f"{checkpoint['resume_trainers']}", resumed,
                                reference["params"])
        except Exception:
            failures.append(f"rank {rank}: resuming raised:\n{traceback.format_exc()}")
    elif checkpoint["resume_world"] == 1:
        status, resumed = shared_reference(
            case, index, lambda: resume(case, directory, one=True, distributed="none"))
        if status != "ok":
            failures.append(f"resuming in one process raised:\n{resumed}")
        else:
            failures += compare("resumed in one process", resumed, reference["params"])
    dist.barrier()
    return failures


def run_resume_job(case: dict, case_id: str, root: str) -> list[str]:
    """A smaller world's checkpoint of ``case`` resumed on this world."""
    checkpoint = case["checkpoint"]
    directory = checkpoint_dir(root, case_id)
    expected_file = os.path.join(directory, "reference.pt")
    if not os.path.exists(expected_file):
        return [f"no checkpoint of world {case['world']} to resume (its case failed?)"]
    try:
        resumed = resume(case, directory, one=False, distributed=case["distributed"],
                         num_trainers_per_group=checkpoint["resume_trainers"])
    except Exception:
        return [f"rank {dist.get_rank()}: resuming raised:\n{traceback.format_exc()}"]
    return compare(f"resumed on {dist.get_world_size()} ranks with num_trainers_per_group="
                   f"{checkpoint['resume_trainers']}", resumed,
                   torch.load(expected_file, weights_only=True))


# ------------------------------------------------------------------ ZeRO 1/2
@dataclass
class FragmentAddress:
    """DeepSpeed's ``fragment_address``."""

    numel: int
    start: int


@dataclass
class Fragment:
    """What DeepSpeed's ``get_hp_fragment_mapping`` links to a parameter
    (``tensor_fragment``): its piece of the flat fp32 partition."""

    lp_fragment: torch.Tensor
    lp_fragment_address: FragmentAddress
    hp_fragment: torch.Tensor
    hp_fragment_address: FragmentAddress
    use_offload: bool = False

    def update_lp(self) -> None:
        self.lp_fragment.data.copy_(self.hp_fragment.data)


class FakeZero:
    """What ``deepspeed.initialize`` does to the optimizer's groups with ZeRO 1/2, and what
    its engine does around ``optimizer.step()``, with the partitions drawn by the case: each
    group's parameters flattened (``order``, with ``gaps`` of padding) and cut at
    ``bounds``, this rank's fp32 partition in the group instead of the parameters, every
    parameter linked to its piece (``_hp_mapping``, None when this rank holds none) and to
    the data-parallel group (``_dp_group``)."""

    def __init__(self, case: dict, params, opt: DistributedShampoo) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.case, self.params, self.opt = case, params, opt
        self.groups = opt.param_groups  # DeepSpeed keeps the list, shows one at a time
        self.layouts = []  # per group: [(param index, offset in the flat buffer)], flat
        members_of = lc.group_members(case["shapes"], case["config"])
        for group, members, flat in zip(self.groups, members_of, case["flats"]):
            assert [id(p) for p in group["params"]] == [id(params[i]) for i in members]
            offsets, at = [], 0
            for position, gap in zip(flat["order"], flat["gaps"]):
                at += gap
                offsets.append((members[position], at))
                at += params[members[position]].numel()
            lo, hi = flat["bounds"][self.rank], flat["bounds"][self.rank + 1]
            partition = torch.nn.Parameter(self.flatten([p.detach() for p in params],
                                                        offsets, flat)[lo:hi].clone())
            for index, offset in offsets:
                p = params[index]
                start, end = max(offset, lo), min(offset + p.numel(), hi)
                p._dp_group = dist.group.WORLD
                p._hp_mapping = None if start >= end else Fragment(
                    p.detach().view(-1)[start - offset:end - offset],
                    FragmentAddress(end - start, start - offset),
                    partition.detach()[start - lo:end - lo],
                    FragmentAddress(end - start, start - lo))
            group["params"] = [partition]
            self.layouts.append((offsets, flat))

    @staticmethod
    def flatten(tensors, offsets, flat) -> torch.Tensor:
        out = torch.zeros(flat["length"])
        for index, offset in offsets:
            out[offset:offset + tensors[index].numel()] = tensors[index].reshape(-1)
        return out

    def step(self, grads: list[torch.Tensor]) -> None:
        """The engine's step: the gradient partitions (zeros where a parameter has none),
        ``optimizer.step()`` per group or for all groups, then every rank's fp32 partition
        all-gathered into the model's parameters."""
        for group, (offsets, flat) in zip(self.groups, self.layouts):
            lo, hi = flat["bounds"][self.rank], flat["bounds"][self.rank + 1]
            group["params"][0].grad = self.flatten(grads, offsets, flat)[lo:hi].clone()
        if self.case["calls"] == "per_group":
            for group in self.groups:
                self.opt.param_groups = [group]
                self.opt.step()
            self.opt.param_groups = self.groups
        else:
            self.opt.step()
        for group, (offsets, _) in zip(self.groups, self.layouts):
            pieces: list[Any] = [None] * self.world
            dist.all_gather_object(pieces, group["params"][0].detach().clone())
            full = torch.cat(pieces)
            for index, offset in offsets:
                p = self.params[index]
                p.data.copy_(full[offset:offset + p.numel()].view_as(p))
            group["params"][0].grad = None


def run_zero_case(case: dict, case_id: str, index: int) -> list[str]:
    rank = dist.get_rank()
    failures: list[str] = []
    got = state = None
    try:
        params = make_params(case)
        opt = make_optimizer(case, params)
        zero = FakeZero(case, params, opt)
        with small_factors_quantized(case["config"]):
            for step in range(1, case["steps"] + 1):
                zero.step(grads_at(case, step, zeros_for_missing=True))
        with opt._own_view():
            kind = type(opt.distributor).__name__
            state = state_sizes(opt)
        if kind != "ZeroDistributor":
            failures.append(f"distributor {kind}, expected ZeroDistributor")
        steps = {g["step"] for g in zero.groups}
        if steps != {case["steps"]}:
            failures.append(f"the groups' step counters {sorted(steps)}, expected "
                            f"{case['steps']}")
        got = [p.detach().clone() for p in params]
    except Exception:
        failures.append(f"rank {rank} raised:\n{traceback.format_exc()}")
    status, reference = shared_reference(
        case, index, lambda: one_process(case, zeros_for_missing=True))
    if status != "ok":
        return failures + [f"the one-process reference raised:\n{reference}"]
    if got is not None:
        failures += compare("ZeRO after every step", got, reference["params"])
    if state is not None and not any("raised" in f for f in failures):
        failures += check_state_partition(dict(case, trainers=-1), state, reference["state"])
    return failures


# ------------------------------------------------------------------ the spawn's entry
def run_world(rank: int, world: int, init_file: str, jobs_file: str, out_dir: str) -> None:
    """Every job of ``jobs_file`` (``[(job, case_id, index, case)]``, job one of "ddp",
    "zero", "resume") on this world, in order."""
    join(rank, world, init_file)
    jobs = torch.load(jobs_file, weights_only=False)
    root = os.path.dirname(jobs_file)
    results: dict[str, Any] = {"cases": {}, "running": None}
    out_file = os.path.join(out_dir, f"rank{rank}.pt")
    for job, case_id, index, case in jobs:
        results["running"] = f"{job}:{case_id}"
        torch.save(results, out_file)
        with lc.drawn_calls(case):
            if job == "ddp":
                failures = run_ddp_case(case, case_id, index, root)
            elif job == "zero":
                failures = run_zero_case(case, case_id, index)
            else:
                failures = run_resume_job(case, case_id, root)
        results["cases"][f"{job}:{case_id}"] = failures
    results["running"] = None
    torch.save(results, out_file)
    leave_gloo_world()
