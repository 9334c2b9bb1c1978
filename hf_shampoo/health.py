"""Health metrics of the preconditioner (docs/metrics.md): what a step records and what
``DistributedShampoo.metrics()`` returns.

A step records only what it already computes, and reads no gradient or parameter for it:
per owned stack (``StackHealth``, kept on ``BlockStack.health``) the decompositions that
failed and fell back (``BlockStack.count_failures``), each factor's condition number from
the eigenvalues its last refresh had, whether the eigenbasis criterion recomputed its basis,
and references to the per-block norms grafting took (no copy); per step (``StepHealth``)
how many blocks refreshed and the host seconds that took. ``collect`` turns these into the
flat dict of ``metrics()`` (``NAMES``), the same on every rank: it is reduced over the
ranks the blocks are spread over with two small collectives, so every rank calls it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from .distributors.collectives import gather_padded
from .linalg import stabilized_eigenvalues

PREFIX = "optimizer/"
#: every name ``metrics()`` can return (``graft_ratio/<kind>``: one per kind with grafting)
NAMES = ("steps", "preconditioning", "refresh_blocks", "refresh_seconds", "fallbacks",
         "condition_max", "condition_median", "basis_recomputed_fraction",
         "graft_ratio/<kind>", "state_bytes", "state_bytes_max_rank")


def condition_numbers(eigenvalues: Tensor, group) -> Tensor:
    """``λ_max / λ_min`` per row of ``(k, d)`` eigenvalues of ``A + εI``, over the
    eigenvalues the root is taken of (``linalg.stabilized_eigenvalues``): with
    ``rank_deficient="perturbation"`` the regularised ones (round-off below ε lifted to ε),
    with ``"pseudo_inverse"`` those above the cutoff (NaN where none is)."""
    lam, cutoff = stabilized_eigenvalues(eigenvalues, group)
    if cutoff is None:
        return lam.amax(dim=-1) / lam.amin(dim=-1)
    kept = lam > cutoff
    top = torch.where(kept, lam, -math.inf).amax(dim=-1)
    low = torch.where(kept, lam, math.inf).amin(dim=-1)
    return torch.where(kept.any(dim=-1), top / low, math.nan)


@dataclass
class StackHealth:
    """What the steps recorded for one stack (its owner's)."""

    fallbacks: int = 0  # decompositions that failed and kept the previous result, since read
    # factor name → per member: its condition number at its last refresh (NaN: none yet)
    condition: dict[str, Tensor] = field(default_factory=dict)
    # factor name → per member: 1 if the criterion found its basis stale at its last
    # refresh (recomputed), 0 if it kept it, NaN before its first check
    recomputed: dict[str, Tensor] = field(default_factory=dict)
    # the last step's grafting norms: (step, ‖graft(Ĝ)‖ per row, ‖P‖ per row, rows that
    # still graft), references to the tensors ``update_rules.apply_grafting`` made
    graft: tuple | None = None

    @staticmethod
    def _slot(table: dict[str, Tensor], name: str, n: int, like: Tensor) -> Tensor:
        slot = table.get(name)
        if slot is None or slot.shape[0] != n or slot.device != like.device:
            slot = table[name] = torch.full((n,), math.nan, dtype=like.dtype,
                                            device=like.device)
        return slot

    @staticmethod
    def _put(slot: Tensor, positions: list[int], values: Tensor) -> None:
        values = values.to(slot.dtype)
        if positions == list(range(slot.shape[0])):
            slot.copy_(values)
        elif positions:
            slot.index_copy_(0, torch.tensor(positions, device=slot.device), values)

    def record_condition(self, name: str, n: int, positions: list[int],
                         eigenvalues: Tensor, group) -> None:
        """Members ``positions`` (of ``n``) refreshed factor ``name``, whose ``A + εI`` has
        these eigenvalues (one row per position; ``group``: their settings)."""
        if not positions:
            return
        values = condition_numbers(eigenvalues.detach(), group)
        self._put(self._slot(self.condition, name, n, values), positions, values)

    def record_recomputed(self, name: str, n: int, positions: list[int], stale: Tensor
                          ) -> None:
        """The criterion found the bases of these members stale (``stale``, per position)."""
        if not positions:
            return
        values = stale.to(torch.float32)
        self._put(self._slot(self.recomputed, name, n, values), positions, values)


@dataclass
class StepHealth:
    """The optimizer's last refresh on this rank: its step, blocks and host seconds."""

    refresh_step: int = 0
    refresh_blocks: int = 0
    refresh_seconds: float = 0.0

    def record(self, jobs, step: int) -> None:
        """After a step's directions: remember it if any owned block refreshed."""
        blocks = sum(len(job.refresh_rows) for _, job in jobs)
        if blocks:
            self.refresh_step, self.refresh_blocks = step, blocks
            self.refresh_seconds = sum(job.refresh_seconds for _, job in jobs)


# --------------------------------------------------------------------- collecting
# the per-rank vector: these fields, then 3 per kind (grafted blocks, Σ‖graft‖², Σ‖P‖²),
# then the factors' condition numbers
_FIELDS = ("key", "fallbacks", "refresh_step", "refresh_blocks", "refresh_seconds",
           "recomputed", "checked", "state_bytes", "preconditioned", "warm", "conditioned",
           "basis_checked", "conditions")


def _kinds() -> list[str]:
    from .preconditioners import KINDS

    return sorted(KINDS)


def _local(layout, groups: list[dict], distributor, step_health: StepHealth,
           reset: bool) -> tuple[list[float], list[Tensor]]:
    """This rank's numbers (``_FIELDS`` but the last, then per kind its grafted blocks,
    Σ‖graft(Ĝ)‖² and Σ‖P‖² of the last step) and its factors' condition numbers (the
    stacks' tensors, NaN where a factor has none yet)."""
    from .config import is_preconditioning
    from .preconditioners import kind_of

    kinds = _kinds()
    row = dict.fromkeys(_FIELDS, 0.0)
    row["key"] = float(getattr(distributor, "shard_index", distributor.rank))
    row["refresh_step"] = float(step_health.refresh_step)
    row["refresh_blocks"] = float(step_health.refresh_blocks)
    row["refresh_seconds"] = step_health.refresh_seconds
    grafted = [0.0] * len(kinds)
    sums: list[list[Tensor]] = [[] for _ in kinds]
    conditions: list[Tensor] = []
    recomputed: list[Tensor] = []
    for stack in layout.owned:
        settings = stack.settings(groups)
        kind, n = kind_of(settings), len(stack.members)
        health = stack.health
        row["fallbacks"] += health.fallbacks
        if reset:
            health.fallbacks = 0
        row["state_bytes"] += sum(t.numel() * t.element_size() for t in stack.state.values())
        step = groups[stack.group_index]["step"]
        if kind.grafted:
            offsets = stack.refresh_offsets or [0] * n
            row["warm"] += n
            row["preconditioned"] += sum(is_preconditioning(settings, step, o)
                                         for o in offsets)
        if kind.statistics and settings["root_inverse"] == "eigh":
            row["conditioned"] += n
            conditions += list(health.condition.values())
        if (kind.statistics and kind.keeps_basis(settings)
                and settings["eigenbasis_tolerance"] > 0):
            row["basis_checked"] += n
            recomputed += list(health.recomputed.values())
        if kind.grafted and settings["grafting"] is not None:
            k = kinds.index(settings["preconditioner"])
            grafted[k] += n
            record = health.graft
            if record is not None and record[0] == step:
                _, graft_norm, norm, rows = record
                graft_norm, norm = graft_norm.flatten(), norm.flatten()
                if rows:  # rows still grafting (a staggered start): no preconditioner yet
                    keep = torch.ones(graft_norm.shape[0], dtype=torch.bool, device="cpu")
                    keep[list(rows)] = False
                    keep = keep.to(graft_norm.device)
                    graft_norm, norm = graft_norm[keep], norm[keep]
                sums[k] += [graft_norm.double().square().sum(), norm.double().square().sum()]
    if recomputed:
        flags = torch.cat([r.float().cpu() for r in recomputed])
        flags = flags[~flags.isnan()]
        row["recomputed"], row["checked"] = float(flags.sum()), float(len(flags))
    values = [row[name] for name in _FIELDS[:-1]]
    for k in range(len(kinds)):
        values.append(grafted[k])
        pair = torch.stack(sums[k]).view(-1, 2).sum(0).tolist() if sums[k] else [0.0, 0.0]
        values += pair
    return values, conditions


def _reduce_group(distributor):
    """The process group the blocks are spread over, or None where this rank's numbers
    are the whole optimizer's (one process, or ranks that each hold everything)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, False
    if distributor.group is not None:
        return distributor.process_group, distributor.group.size > 1
    return None, distributor.world_size > 1


def _gather(values: list[float], conditions: list[float], process_group, device
            ) -> list[tuple[list[float], list[float]]]:
    """Every rank's ``(values, conditions)`` (``values`` of the same length on every
    rank): both in one float64 vector, gathered at every rank's length
    (``collectives.gather_padded``)."""
    mine = torch.tensor(values + conditions, dtype=torch.float64, device=device)
    return [(row[:len(values)], row[len(values):]) for row in
            (g.cpu().tolist() for g in gather_padded(mine, process_group))]


def collect(layout, groups: list[dict], distributor, step_health: StepHealth,
            device: torch.device | None = None, reset: bool = True) -> dict[str, float]:
    """``metrics()``'s dict (docs/metrics.md): this rank's records, reduced over the ranks
    (``reset``: the failure counts start again from 0)."""
    values, conditions = _local(layout, groups, distributor, step_health, reset)
    finite_or_inf = []
    if conditions:
        flat = torch.cat([c.double().flatten().cpu() for c in conditions])
        finite_or_inf = flat[~flat.isnan()].tolist()
    process_group, spread = _reduce_group(distributor)
    if spread:
        rows = _gather(values, finite_or_inf, process_group,
                       device or torch.device("cpu"))
    else:
        rows = [(values, finite_or_inf)]
    # one row per part of the blocks: ranks with the same key hold the same blocks
    # (replicas: trainer groups of num_trainers_per_group, HSDP's replicate dim)
    unique: dict[float, tuple[list[float], list[float]]] = {}
    for row in rows:
        unique.setdefault(row[0][0], row)
    parts = list(unique.values())
    fields = [dict(zip(_FIELDS[:-1], v)) for v, _ in parts]
    total = {name: sum(f[name] for f in fields) for name in _FIELDS[1:-1]}
    out = {"steps": float(max((g["step"] for g in groups), default=0))}
    if total["warm"]:
        out["preconditioning"] = total["preconditioned"] / total["warm"]
    last = max(f["refresh_step"] for f in fields)
    at_last = [f for f in fields if f["refresh_step"] == last and last > 0]
    out["refresh_blocks"] = float(sum(f["refresh_blocks"] for f in at_last))
    out["refresh_seconds"] = max((f["refresh_seconds"] for f in at_last), default=0.0)
    out["fallbacks"] = total["fallbacks"]
    if total["conditioned"]:
        every = sorted(c for _, cs in parts for c in cs)
        out["condition_max"] = every[-1] if every else math.nan
        out["condition_median"] = statistics.median(every) if every else math.nan
    if total["basis_checked"]:
        out["basis_recomputed_fraction"] = (total["recomputed"] / total["checked"]
                                            if total["checked"] else math.nan)
    base = len(_FIELDS) - 1
    for k, kind in enumerate(_kinds()):
        blocks = sum(v[base + 3 * k] for v, _ in parts)
        if not blocks:
            continue
        graft = sum(v[base + 3 * k + 1] for v, _ in parts)
        direction = sum(v[base + 3 * k + 2] for v, _ in parts)
        out[f"graft_ratio/{kind}"] = (math.sqrt(graft / direction) if direction > 0
                                      else math.nan)
    out["state_bytes"] = total["state_bytes"]
    out["state_bytes_max_rank"] = max(f["state_bytes"] for f in fields)
    return {PREFIX + name: float(value) for name, value in out.items()}
