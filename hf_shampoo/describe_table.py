"""The describe table: what each parameter got from the optimizer, one row per parameter.

``describe(optimizer)`` prints it (name, shape, role, blocks, preconditioner, grafting,
weight decay, owning rank, state bytes, then the blocks, elements and state per rank);
``describe_rows(optimizer)`` gives the rows as dicts. Built from the optimizer's public
``describe_blocks()`` (one row per block) and ``param_groups``, with the role the module
rules found (``model_rules.role_of``); a wrapped ``DistributedShampoo`` (Accelerate's
``AcceleratedOptimizer`` and the like: ``integrations/accelerate.py``'s ``find_shampoo``) is
looked through.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .config import diagonal_dims
from .model_rules import role_of
from .preconditioners import KINDS


def _preconditioner_label(group: Mapping[str, Any], shape: tuple[int, ...],
                          name: str = "") -> str:
    kind, label = KINDS[group["preconditioner"]], group["preconditioner"]
    own = kind.describe_label(name, group)
    if own is not None:  # a kind that says more (riemannian_lora: which factor of which pair)
        return f"{label} ({own})"
    override = (group.get("inverse_exponent_override") or {}).get(len(shape))
    if kind.statistics and isinstance(override, dict):
        off = [str(d) for d, e in sorted(override.items()) if e == 0]
        if off:
            label += f" (dim {','.join(off)} off)"
    if kind.diagonal_factors and (diagonal := diagonal_dims(tuple(shape), group)):
        label += f" (dim {diagonal[0]} diagonal)"
    sketched_dims = getattr(kind, "sketched_dims", None)
    if sketched_dims is not None:  # sketchy: the rank of each sketched dim
        ranks: dict[int, list[str]] = {}
        for j in sketched_dims(tuple(shape), group):
            ranks.setdefault(kind.rank(group, shape[j]), []).append(str(j))
        label += " (" + (", ".join(f"rank {r} on dim{'s' if len(dims) > 1 else ''} "
                                   f"{','.join(dims)}" for r, dims in ranks.items())
                         or "no dim sketched") + ")"
    return label


def _blocks_label(shapes: list[tuple[int, ...]]) -> str:
    counts: dict[tuple[int, ...], int] = {}
    for shape in shapes:
        counts[tuple(shape)] = counts.get(tuple(shape), 0) + 1
    return " + ".join(f"{n}x{tuple(s)}" for s, n in counts.items())



def describe_rows(optimizer: Any) -> list[dict[str, Any]]:
    """One row per parameter: name, shape, role (the module rules', "-" for groups built
    without them), blocks, preconditioner (with the sketch rank of each sketched dim for
    ``sketchy``; blocks that differ are joined by ``" | "``), grafting, weight decay,
    owning rank(s), ``state_bytes`` (of its blocks, as ``describe_blocks()``), and
    ``experts`` (the number of experts of a parameter blocked per expert, ``experts=True``;
    else 0). Built from ``optimizer.describe_blocks()`` and ``param_groups``; a frozen
    parameter (``requires_grad=False``, no gradient) has no blocks and no state
    (``"frozen": True``)."""
    from .integrations.accelerate import find_shampoo

    shampoo = find_shampoo(optimizer)
    if shampoo is None:
        raise TypeError(f"describe: not a DistributedShampoo (got {type(optimizer).__name__})")
    owner: list[tuple[dict, Tensor]] = [
        (group, param) for group in shampoo.param_groups for param in group["params"]
    ]
    rows: dict[int, dict[str, Any]] = {}
    for block in shampoo.describe_blocks():
        index = block["param_index"]
        group, param = owner[index]
        row = rows.setdefault(
            index,
            {
                "name": block["name"],
                "shape": tuple(param.shape),
                "role": role_of(param),
                "block_shapes": [],
                "ranks": set(),
                "labels": [],
                "grafting": block["grafting"] or "-",
                "weight_decay": group["weight_decay"],
                "state_bytes": 0,
            },
        )
        label = _preconditioner_label({**group, "preconditioner": block["preconditioner"]},
                                      block["shape"], block["name"])
        if label not in row["labels"]:  # blocks of other shapes may say otherwise (sketchy)
            row["labels"].append(label)
        row["block_shapes"].append(tuple(block["shape"]))
        row["ranks"].add(block["rank"])
        row["state_bytes"] += block["state_bytes"]
    for index, (group, param) in enumerate(owner):
        if index not in rows:  # frozen: requires_grad=False and no gradient, so no blocks
            rows[index] = {"name": shampoo.param_name(index), "shape": tuple(param.shape),
                           "role": role_of(param), "block_shapes": [], "ranks": set(),
                           "preconditioner": "-", "grafting": "-",
                           "weight_decay": group["weight_decay"], "state_bytes": 0,
                           "frozen": True}
    out = []
    for index in sorted(rows):
        row = rows[index]
        frozen = row.setdefault("frozen", False)
        if "labels" in row:
            row["preconditioner"] = " | ".join(row.pop("labels"))
        group, param = owner[index]
        row["experts"] = int(param.shape[0]) if group.get("experts") and param.ndim else 0
        row["blocks"] = "frozen: no state" if frozen else _blocks_label(row["block_shapes"])
        if row["experts"] and not frozen:  # blocked per expert: say so, with one expert's
            shapes = row["block_shapes"]
            unit = _blocks_label(shapes[:max(len(shapes) // row["experts"], 1)])
            row["blocks"] = f"{row['experts']} experts, each {unit}"
        row["rank"] = "-" if frozen else ",".join(str(r) for r in sorted(row.pop("ranks")))
        row.pop("ranks", None)
        out.append(row)
    return out


def describe(optimizer: Any) -> str:
    """A table of every parameter: name, shape, role, blocks, preconditioner, grafting,
    weight decay, owning rank and state (the bytes of its blocks' state), then the number of
    blocks and their elements per rank, the ranks the blocks are spread over (the world, or
    a pipeline stage's group: its global ranks; the ``rank`` column counts within it) and
    the state per rank."""
    rows = describe_rows(optimizer)
    header = ("name", "shape", "role", "blocks", "preconditioner", "grafting", "wd", "rank",
              "state")
    table = [header] + [
        (
            r["name"],
            str(r["shape"]),
            r["role"],
            r["blocks"],
            r["preconditioner"],
            r["grafting"],
            f"{r['weight_decay']:g}",
            r["rank"],
            _size(r["state_bytes"]),
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    from .integrations.accelerate import find_shampoo

    blocks = find_shampoo(optimizer).describe_blocks()
    per_rank: dict[int, list[int]] = {}
    for block in blocks:
        count = per_rank.setdefault(block["rank"], [0, 0, 0])
        count[0] += 1
        count[1] += int(torch.Size(block["shape"]).numel())
        count[2] += block["state_bytes"]
    frozen = sum(r["frozen"] for r in rows)
    lines.append(
        f"{len(rows)} parameters ({frozen} frozen, without state), {len(blocks)} blocks; "
        "per rank: "
        + ", ".join(
            f"rank {r}: {n} blocks / {e} elements" for r, (n, e, _) in sorted(per_rank.items())
        )
    )
    group = getattr(find_shampoo(optimizer).distributor, "group", None)
    lines.append("blocks spread over " + ("one process" if group is None else
                                          group.describe()))
    lines.append(
        "optimizer state per rank: "
        + ", ".join(f"rank {r}: {_size(b)} ({b / max(e, 1):.1f} bytes per parameter element)"
                    for r, (_, e, b) in sorted(per_rank.items()))
    )
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
