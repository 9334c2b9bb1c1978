"""Ranks of one group that hold different parameters, or the same parameters with
different settings, are refused before they exchange anything (docs/design.md §4 and §8,
docs/parallelism.md#limits).

The data-parallel and sharded distributors run collectives whose sizes come from the
layout: one all-gather of every owner's directions (``ddp``), flags per parameter and
parts per block (``sharded``, ``zero``). Ranks that hold different parameters, as pipeline
stages do, would call them with different sizes: gloo aborts the process, NCCL hangs. Ranks
that hold the same parameters with different settings (one rank's ``lr`` or kind not the
other's) would exchange directions computed with either rank's settings, so that the
replicas stay equal to each other and equal no run of either setting.

A ``Plan`` is what a layout is made of, per parameter in layout order: its index, shape,
dtype, DTensor placements and mesh (``param_key``), and its blocks (shape, group, working
dtype, vector settings, assignment cost): everything the owners, the buffers and the
exchanged parts derive from, nothing of the device; and ``settings``, per parameter group
that has blocks, every setting that enters a block's numbers (``setting``; the optimizer
chooses them: every keyword of the table that acts for the group's kinds, ``compile``
aside, and ``peak_lr`` where weight decay divides by it), as the group holds them at the
moment of the check. ``check`` compares it across the ranks once per layout (the optimizer
calls it before the layout's first collective, at the first step or, where laying out is
itself a collective, before that): one ``all_gather`` of six integers per rank (the plan's
length and a digest), which has the same size on every rank and so cannot mismatch. Only
when the digests differ, a second ``all_gather`` of every rank's plan (padded to the
longest, whose length every rank learnt from the first) says what differs, and every rank
raises the same ``ValueError`` naming itself, the ranks that differ and the first
difference (a setting: its group, its name and every rank's value), before any state or
parameter changed.

What it cannot see: stages whose parameters have the same shapes, dtypes and settings
(plain tensors, or DTensors on sub-meshes of the same shape) look exactly like data-parallel
replicas, since values are not compared; settings changed on some ranks only after the
check (it runs once per layout, not at every step: a learning-rate schedule changes ``lr``
alike on every rank); and a layout that changes on some ranks only (a group added or a
parameter unfrozen on one rank alone) makes those ranks call the check alone, which only a
collective at every step could prevent.
"""

from __future__ import annotations

import hashlib
import json
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .collectives import gather_padded
from .placements import STAGES, is_dtensor, spans_group

__all__ = ["Plan", "check", "param_key", "setting"]

#: bytes of a rank's plan sent when ranks differ; the parameters beyond are left out
PAYLOAD_LIMIT = 1 << 18
#: shapes listed per rank in the error
SHAPES_SHOWN = 6


def param_key(param: Tensor, world: int | Sequence[int]) -> list:
    """What of a parameter the exchange depends on: shape, dtype, and a DTensor's
    placements and mesh: its global ranks where it spans the group (``world``: the world's
    size, or the group's global ranks), else only its shape (a sub-mesh is each rank's own:
    tensor parallel inside data parallel puts rank 0's on ranks [0, 1] and rank 2's on
    [2, 3]; ``placements.holdings`` gathers them)."""
    key: list = [list(param.shape), str(param.dtype).removeprefix("torch.")]
    if is_dtensor(param):
        ranks = param.device_mesh.mesh
        mesh = ranks.flatten().tolist() if spans_group(param, world) else \
            {"sub-mesh": list(ranks.shape)}
        key += [mesh, [repr(p) for p in param.placements]]
    return key


def setting(value, real: bool = False) -> str:
    """A setting as the check compares it and the error shows it: floats exactly (their
    ``repr``), a one-element tensor (torch's tensor ``lr``) as its float, a dtype as
    torch names it; ``real``: numbers as floats (``lr=1`` is ``lr=1.0``), also inside a
    tuple (``betas``) or as a dict's values (``inverse_exponent_override``)."""
    if isinstance(value, Tensor):
        value = float(value.detach().cpu().item())
    if value is None or isinstance(value, (bool, str, torch.dtype)):
        return repr(value) if not isinstance(value, torch.dtype) else str(value)
    if isinstance(value, numbers.Integral) and not real:
        return repr(int(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))
    if isinstance(value, (tuple, list)):
        items = [setting(v, real) for v in value]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if isinstance(value, Mapping):
        items = sorted((setting(k), setting(v, real)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    return repr(value)


@dataclass(frozen=True)
class Plan:
    """One entry per laid-out parameter, in layout order: ``{"index", "name" (None
    without ``param_names``), "param": param_key, "blocks": [[shape, group, work dtype,
    settings, cost], ...]}``; ``agreed``: whether every rank was found to hold the same
    (names are not compared); ``settings``: ``((group index, ((keyword, setting(value)),
    ...)), ...)`` for the groups the blocks are in, as they were when last checked (the
    optimizer fills them in just before the check: ``with_settings``)."""

    entries: tuple = ()
    agreed: bool = False
    settings: tuple = ()

    def extended(self, entries: Iterable[dict]) -> Plan:
        """This plan with the entries of newly laid-out parameters, not yet agreed."""
        entries = tuple(entries)
        return Plan(self.entries + entries, False) if entries else self

    def with_settings(self, settings: Iterable) -> Plan:
        """This plan with its groups' settings as they are now, not yet agreed."""
        return Plan(self.entries, False, tuple(settings))

    def checked(self) -> Plan:
        """This plan, agreed."""
        return Plan(self.entries, True, self.settings)

    def groups(self) -> list[int]:
        """The parameter groups its blocks are in, in order."""
        return sorted({block[1] for entry in self.entries for block in entry["blocks"]})


def _keys(entries: Sequence[dict]) -> list:
    return [[e["index"], e["param"], e["blocks"]] for e in entries]


def _digest(entries: Sequence[dict], settings: Sequence) -> list[int]:
    text = json.dumps([_keys(entries), list(settings)], separators=(",", ":"))
    raw = hashlib.sha256(text.encode()).digest()
    return [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, 32, 8)]


def _payload(entries: Sequence[dict], settings: Sequence) -> bytes:
    """The plan as JSON, cut to ``PAYLOAD_LIMIT`` bytes by leaving out parameters from the
    end, then groups' settings (``count`` says how many parameters there are, ``groups``
    how many groups' settings)."""
    kept, shown = list(entries), list(settings)
    while True:
        data = json.dumps({"count": len(entries), "entries": kept, "groups": len(settings),
                           "settings": shown}, separators=(",", ":")).encode()
        if len(data) <= PAYLOAD_LIMIT or not (kept or shown):
            return data
        if kept:
            kept = kept[: len(kept) // 2]
        else:
            shown = shown[: len(shown) // 2]


def check(plan: Plan, group=None, device: torch.device | None = None) -> None:
    """Raise ``ValueError`` on every rank of ``group`` (None: the world, as the optimizer
    checks) unless every rank's ``plan`` is the same; a collective every rank of the group
    calls."""
    device = device or torch.device("cpu")
    world = dist.get_world_size(group)
    entries = plan.entries
    payload = _payload(entries, plan.settings)
    mine = torch.tensor([len(entries), len(payload), *_digest(entries, plan.settings)],
                        dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    table = [tuple(row.tolist()) for row in rows]
    if all(row[:1] + row[2:] == table[0][:1] + table[0][2:] for row in table):
        return
    # they differ: every rank learns every plan (the same size everywhere: the longest)
    mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    gathered = gather_padded(mine, group, lengths=[row[1] for row in table])
    plans = [json.loads(bytes(g.cpu().tolist()).decode()) for g in gathered]
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    raise ValueError(message(plans, [row[:1] + row[2:] for row in table], ranks,
                             dist.get_rank()))


def message(plans: Sequence[dict], keys: Sequence[tuple], ranks: Sequence[int],
            me: int) -> str:
    """The error: which ranks hold what, where the first difference is, the way out.
    ``plans`` and ``keys`` (count and digest) per rank of the group, ``ranks`` their
    global ranks, ``me`` this one's. A setting that differs is named first, unless the
    ranks hold different parameters too (then it follows)."""
    kinds: dict[tuple, list[int]] = {}
    for rank, key in zip(ranks, keys):
        kinds.setdefault(key, []).append(rank)
    # the plan most ranks hold (ties: the lowest rank's) is the one the others differ from
    order = sorted(kinds.values(), key=lambda held: (-len(held), held[0]))
    reference, others = order[0], order[1:]
    plan_of = {rank: plan for rank, plan in zip(ranks, plans)}
    differing = sorted(r for held in others for r in held)
    base = plan_of[reference[0]]
    settings = _settings_differences([plan_of[held[0]] for held in others], base, ranks,
                                     plan_of)
    if settings and not any(_params_differ(plan_of[held[0]], base) for held in others):
        return " ".join(["DistributedShampoo: ranks of the process group differ in "
                         + settings[0], *settings[1:], SAME_SETTINGS,
                         f"This is rank {me}; nothing was changed."])
    lines = [
        f"DistributedShampoo: {_who(differing)} {_verb(differing, 'hold')} different "
        f"parameters from {_who(reference)}, so the blocks the ranks share would not line up (gloo "
        "aborts, NCCL hangs): " + "; ".join(
            _holding(held, plan_of[held[0]]) for held in sorted(order, key=lambda h: h[0]))
        + "."]
    for held in others:
        lines.append(_first_difference(held[0], plan_of[held[0]], reference[0], base,
                                       bool(settings)))
    if settings:
        lines.append("The ranks also differ in " + settings[0])
        lines += settings[1:]
    lines.append(f"This is rank {me}; nothing was changed. {STAGES}")
    return " ".join(lines)


#: what the error says after a setting that differs
SAME_SETTINGS = ("Every setting that enters a block's numbers (every keyword of the group "
                 "that acts for its kind, compile aside, as the group held it at the check) "
                 "must be the same on every rank of the group, else each block's direction "
                 "is computed with its owner's settings; give every rank the same settings "
                 "(docs/parallelism.md#limits).")


def _params_differ(plan: dict, base: dict) -> bool:
    """Whether two plans hold different parameters (not: blocked otherwise)."""
    return plan["count"] != base["count"] or any(
        [a["index"], a["param"]] != [b["index"], b["param"]]
        for a, b in zip(plan["entries"], base["entries"]))


def _group_settings(plan: dict) -> dict[int, dict[str, str]]:
    return {group: dict(pairs) for group, pairs in plan.get("settings", [])}


def _differing_settings(plan: dict, base: dict) -> tuple[int, list[str]] | None:
    """The first group whose settings differ between two plans, and its keywords that
    differ (those both use first, then those only one uses); None where the settings they
    sent agree."""
    mine, theirs = _group_settings(plan), _group_settings(base)
    for group in sorted(mine.keys() & theirs.keys()):
        a, b = mine[group], theirs[group]
        names = [*b, *(k for k in a if k not in b)]
        both = [k for k in names if k in a and k in b and a[k] != b[k]]
        one = [k for k in names if (k in a) != (k in b)]
        if both or one:
            return group, both + one
    return None


def _settings_differences(plans: Sequence[dict], base: dict, ranks: Sequence[int],
                          plan_of: dict) -> list[str]:
    """Sentences on the settings that differ: per group first found differing on some
    rank, its first differing keyword with every rank's value and the names of the others
    that differ; empty where they agree."""
    found: dict[int, list[str]] = {}
    for plan in plans:
        where = _differing_settings(plan, base)
        if where is not None:
            keys = found.setdefault(where[0], [])
            keys += [k for k in where[1] if k not in keys]
    sentences = []
    for group, keys in found.items():
        values: dict[str, list[int]] = {}
        for rank in ranks:
            values.setdefault(_setting_of(plan_of[rank], group, keys[0]), []).append(rank)
        held = sorted(values.items(), key=lambda item: item[1][0])
        text = f"parameter group {group}'s setting {keys[0]!r}: " + ", ".join(
            f"{_who(who)} {'has' if len(who) == 1 else 'have'} {value}" for value, who in held)
        if len(keys) > 1:
            text += (f" (and {'its settings' if len(keys) > 2 else 'its setting'} "
                     f"{', '.join(repr(k) for k in keys[1:])})")
        sentences.append(text + ".")
    prefix = ["", *["Also in "] * (len(sentences) - 1)]
    return [p + t for p, t in zip(prefix, sentences)]


def _setting_of(plan: dict, group: int, key: str) -> str:
    settings = _group_settings(plan)
    if group not in settings:
        return "no such group" if plan.get("groups", 0) == len(settings) else \
            "a group it did not send"
    return settings[group].get(key, "none (its kind does not use it)")


def _who(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else \
        "ranks " + ", ".join(str(r) for r in ranks)


def _verb(ranks: Sequence[int], verb: str) -> str:
    return verb + "s" if len(ranks) == 1 else verb


def _shape(entry: dict) -> str:
    return str(tuple(entry["param"][0]))


def _holding(ranks: Sequence[int], plan: dict) -> str:
    entries, count = plan["entries"], plan["count"]
    shapes = [_shape(e) for e in entries[:SHAPES_SHOWN]]
    if count > len(shapes):
        shapes.append(f"... {count - len(shapes)} more")
    noun = "parameter" if count == 1 else "parameters"
    return (f"{_who(ranks)} {_verb(ranks, 'hold')} {count} {noun} to optimize, of shapes "
            f"[{', '.join(shapes)}]")


def _described(entry: dict, detail: int, named: bool = True) -> str:
    """A parameter in the error: index, name (``named``), shape and dtype; with ``detail``
    1 its mesh and placements too, with 2 its blocks as well."""
    param = entry["param"]
    name = f" {entry['name']!r}" if named and entry["name"] is not None else ""
    text = f"parameter {entry['index']}{name} of shape {_shape(entry)} {param[1]}"
    if detail >= 1 and len(param) > 2:
        mesh = param[2]
        where = f"a sub-mesh of shape {tuple(mesh['sub-mesh'])}" if isinstance(mesh, dict) \
            else f"mesh ranks {mesh}"
        text += f" on {where} placed ({', '.join(param[3])})"
    elif detail >= 1:
        text += " (a plain tensor)"
    if detail >= 2:
        blocks = [f"{tuple(b[0])} in group {b[1]} ({b[2]}{', ' + b[3] if b[3] != '()' else ''}"
                  f", cost {b[4]!r})" for b in entry["blocks"]]
        text += f" blocked as [{', '.join(blocks)}]"
    return text


def _first_difference(rank: int, plan: dict, base_rank: int, base: dict,
                      settings_differ: bool = False) -> str:
    """Where ``rank``'s plan first departs from ``base_rank``'s (``settings_differ``: the
    error names a setting that differs after this)."""
    mine, theirs = plan["entries"], base["entries"]
    for position, (a, b) in enumerate(zip(mine, theirs)):
        if _keys([a]) == _keys([b]):
            continue
        detail = 0  # the least that shows the difference (names are not compared)
        while detail < 2 and _described(a, detail, False) == _described(b, detail, False):
            detail += 1
        text = (f"Rank {rank} differs from rank {base_rank} first at its parameter "
                f"{position} to optimize: {_described(a, detail)} there, "
                f"{_described(b, detail)} on rank {base_rank}")
        if detail == 2 and settings_differ:
            text += " (the same parameter, blocked otherwise: the settings differ, below)"
        elif detail == 2:
            text += (" (the same parameter, blocked otherwise although the ranks' settings "
                     "agree: is another version of hf_shampoo or torch installed on some "
                     "rank?)")
        return text + "."
    shared = min(len(mine), len(theirs))
    complete = len(mine) == plan["count"] and len(theirs) == base["count"]
    if complete and len(mine) != len(theirs):
        longer, extra = (rank, mine) if len(mine) > len(theirs) else (base_rank, theirs)
        return (f"Rank {rank} and rank {base_rank} agree on their first {shared} parameters "
                f"to optimize; rank {longer} has more, from {_described(extra[shared], 0)}.")
    return (f"Rank {rank} and rank {base_rank} agree on the first {shared} parameters "
            "to optimize they sent each other; they differ further on.")
