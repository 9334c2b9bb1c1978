"""The optimizer's state layout on disk (docs/design.md §6).

``state_dict()`` follows torch's structure: ``{"state": {param_index: {...}},
"param_groups": [...]}``. A parameter's entry holds, for each of its blocks ``b`` that this
rank owns, ``"block_{b}.{name}"`` tensors (names as in ``stack.py``). Block identities
``(param_index, b)`` do not depend on the world size, so a state can be re-sharded by
block. Groups keep their hyperparameters and the step counter ``"step"``. Everything loads
with ``torch.load(weights_only=True)``; nothing here communicates.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from typing import Any

import torch

from ..blocking import ParamBlocking
from ..config import LAYOUT_KEYS, RUNTIME_KEYS
from ..delayed_refresh import is_pending

# Layout keywords a checkpoint may hold another value of: the saved one is taken. A
# refresh_delay changes only whether each block keeps its due step (and what the
# checkpoint holds pending), so a run saved with one delay resumes with it, exactly, in an
# optimizer built with another (make_optimizer, the Trainer and timm default to 1 after
# 0.2.0: their checkpoints from before resume as they were saved).
ADOPTED = ("refresh_delay",)

# "block_{b}.{name}"; with fsdp_mode="local", "shard{s}of{n}.block_{b}.{name}"
_KEY = re.compile(r"^(shard\d+of\d+\.)?block_(\d+)\.(\w+)$")


def pack(
    param_groups: list[dict], owned_stacks: list, rank: int = 0, world_size: int = 1,
    complete: bool = True, prefix: str = "", laid_out: Iterable[int] | None = None,
    extra: dict[int, dict[str, torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """The state dict of ``owned_stacks``. ``"shard"`` records whose blocks it holds: a
    state that is not ``complete`` (one rank's blocks of a distributed run) must hold
    every block the loading rank owns, so that a rank-0-only save never silently resumes
    without state. ``prefix`` starts every key (``fsdp_mode="local"``). ``laid_out``: the
    parameters that have blocks (None: all); a frozen one has no entry, as in torch.
    ``extra``: entries packed beside a stack's state (``id(stack)`` → name → stacked
    tensor: ``refresh_delay``'s pending results)."""
    groups, index = [], 0
    first: dict[int, int] = {}  # a tensor listed twice is one parameter: keyed by identity
    for group in param_groups:
        packed = {k: _encode(v) for k, v in group.items() if k != "params"}
        for param in group["params"]:
            first.setdefault(id(param), index)
            index += 1
        packed["params"] = [first[id(param)] for param in group["params"]]
        groups.append(packed)
    # an entry for every parameter with blocks, also one whose blocks another rank owns:
    # torch.distributed.checkpoint's set_optimizer_state_dict (strict) wants one per parameter
    laid_out = sorted(set(first.values())) if laid_out is None else sorted(laid_out)
    state: dict[int, dict[str, torch.Tensor]] = {i: {} for i in laid_out}
    extra = extra or {}
    for stack in owned_stacks:
        if not stack.state:
            continue
        tensors = {**stack.state, **extra.get(id(stack), {})}
        for i, block in enumerate(stack.members):
            entry = state.setdefault(block.param_index, {})
            for name, tensor in tensors.items():
                entry[f"{prefix}block_{block.block_index}.{name}"] = tensor[i]
    shard = {"rank": rank, "world_size": world_size, "complete": complete}
    return {"state": state, "param_groups": groups, "shard": shard}


_DTYPE_PREFIX = "torch."


def is_state_key(key: Any) -> bool:
    """Whether ``key`` names one of this optimizer's state tensors (``block_{b}.{name}``,
    with a shard prefix in ``fsdp_mode="local"``), not a key that other code stored."""
    return isinstance(key, str) and _KEY.match(key) is not None


def _encode(value: Any) -> Any:
    """Group values as plain Python: dtypes become their names ("torch.float32"), which
    torch.distributed.checkpoint's state-dict helpers can gather and broadcast; dicts and
    lists are copies (``dcp.load`` fills a state dict's nested values in place, which must
    not change the optimizer's own groups: it wrote ``"2"`` beside ``2`` into
    ``inverse_exponent_override``)."""
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, (dict, list)):
        return copy.deepcopy(value)
    return value


def _decode(key: str, value: Any) -> Any:
    """Undo ``_encode`` and what torch's full-state-dict helpers do to group values
    (tuples become lists, integer dict keys become strings)."""
    if isinstance(value, str) and value.startswith(_DTYPE_PREFIX):
        dtype = getattr(torch, value[len(_DTYPE_PREFIX):], None)
        if isinstance(dtype, torch.dtype):
            return dtype
    if key == "betas" and isinstance(value, list):
        return tuple(value)
    if key == "inverse_exponent_override" and isinstance(value, dict):
        return {_int_key(k): ({_int_key(d): e for d, e in v.items()} if isinstance(v, dict)
                              else v) for k, v in value.items()}
    return value


def _int_key(key: Any) -> Any:
    return int(key) if isinstance(key, str) and key.isdigit() else key


def to_cpu(state: dict) -> dict:
    """A copy of a ``state`` mapping with every tensor cloned to CPU (for gathering)."""
    return {
        index: {key: tensor.detach().to("cpu", copy=True) for key, tensor in entry.items()}
        for index, entry in state.items()
    }


def merge_shards(shards: list[dict]) -> dict:
    """Union of per-rank ``state`` mappings, ordered by parameter and key. Blocks that
    several trainer groups hold are identical; the first copy is kept."""
    merged: dict[int, dict] = {}
    for shard in shards:
        for index, entry in shard.items():
            target = merged.setdefault(index, {})
            for key, tensor in entry.items():
                target.setdefault(key, tensor)
    return {index: dict(sorted(merged[index].items(), key=lambda kv: _sort_key(kv[0])))
            for index in sorted(merged)}


def _sort_key(key: str) -> tuple:
    match = _KEY.match(key)
    if match is None:
        return ("", -1, key)
    return (match.group(1) or "", int(match.group(2)), match.group(3))


def _refuse(message: str) -> None:
    raise ValueError(
        f"DistributedShampoo.load_state_dict: {message}; the checkpoint was saved for a "
        "different model, parameter grouping or blocking, so it was not loaded"
    )


def unpack(
    state_dict: dict[str, Any], param_groups: list[dict], owned_stacks: list,
    rank: int = 0, world_size: int = 1, prefix: str = "", blockings: dict | None = None,
) -> dict[int, dict[int, dict[str, torch.Tensor]]]:
    """Validate ``state_dict`` against this optimizer completely, then load it.

    ``prefix``: this rank's key prefix (``fsdp_mode="local"``); ``blockings``: each
    parameter's blocking (default: of its full shape). Returns the entries that are not
    state (``refresh_delay``'s pending results: ``id(stack)`` → position → name →
    tensor), for ``delayed_refresh.restore``."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        _refuse("expected a dict with 'state' and 'param_groups'")
    shard = state_dict.get("shard")
    # A state without the marker (e.g. through torch.distributed.checkpoint's helpers,
    # which keep only "state" and "param_groups") is checked as strictly as a shard.
    complete = bool(shard.get("complete", False)) if isinstance(shard, dict) else False
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    if len(saved_groups) != len(param_groups):
        _refuse(f"it has {len(saved_groups)} parameter groups, this optimizer {len(param_groups)}")
    id_to_index: dict[Any, int] = {}
    index = 0
    merged_groups = []
    for gi, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        saved = {k: _decode(k, v) for k, v in saved.items()}
        if len(saved["params"]) != len(group["params"]):
            _refuse(
                f"group {gi} has {len(saved['params'])} parameters in it, "
                f"{len(group['params'])} here"
            )
        for key in LAYOUT_KEYS:
            if key in ADOPTED and key in saved:
                continue  # the checkpoint's value is loaded, as torch loads a saved lr
            if key in saved and saved[key] != group[key]:
                _refuse(f"group {gi} has {key}={saved[key]!r}, this optimizer {group[key]!r}")
        for saved_id in saved["params"]:
            id_to_index.setdefault(saved_id, index)  # a repeated id: its first position
            index += 1
        merged_groups.append({**group, **{k: v for k, v in saved.items()
                                          if k != "params" and k not in RUNTIME_KEYS}})

    # Where each owned block lives, and what it must hold.
    owned: dict[tuple[int, int], tuple[Any, int]] = {}
    for stack in owned_stacks:
        for i, block in enumerate(stack.members):
            owned[(block.param_index, block.block_index)] = (stack, i)
    loads: dict[int, dict[int, dict[str, torch.Tensor]]] = {}  # stack id → member → tensors
    for saved_id, entry in saved_state.items():
        if saved_id not in id_to_index:
            _refuse(f"it has state for unknown parameter {saved_id!r}")
        param_index = id_to_index[saved_id]
        for key, tensor in entry.items():
            match = _KEY.match(str(key))
            if match is None:
                _refuse(f"unexpected entry {key!r} for parameter {param_index}")
            if (match.group(1) or "") != prefix:
                continue  # another shard's blocks (fsdp_mode="local")
            block_index, name = int(match.group(2)), match.group(3)
            where = owned.get((param_index, block_index))
            if where is None:
                continue  # a block another rank owns (or a consolidated checkpoint)
            stack, i = where
            expected = stack.expected_state(stack.settings(merged_groups))
            if name not in expected:
                _refuse(f"parameter {stack.members[i].name!r} has unexpected state {name!r}")
            shape = expected[name][0]
            if tuple(tensor.shape) != tuple(shape):
                _refuse(
                    f"{name} of parameter {stack.members[i].name!r} (block {block_index}) has "
                    f"shape {tuple(tensor.shape)}, expected {tuple(shape)}"
                )
            loads.setdefault(id(stack), {}).setdefault(i, {})[name] = tensor
    _check_blocks_exist(saved_state, id_to_index, param_groups, prefix, blockings)
    has_state = any(len(entry) for entry in saved_state.values())
    for stack in owned_stacks:
        members = loads.get(id(stack), {})
        if len(members) == len(stack.members) or not has_state:
            continue
        missing = [b for i, b in enumerate(stack.members) if i not in members][0]
        if not members and complete:
            continue  # a complete state of a block that never took a step
        if not complete:
            where = f"rank {shard['rank']} of a {shard['world_size']}-rank run" if isinstance(
                shard, dict) and "rank" in shard else "some ranks"
            raise ValueError(
                f"DistributedShampoo.load_state_dict: this state holds only the blocks of "
                f"{where}, and lacks parameter {missing.name!r} block {missing.block_index}, "
                f"which rank {rank} of {world_size} owns; loading it would leave this rank's "
                "blocks without state. Save after optimizer.consolidate_state_dict() (every "
                "rank calls it; rank 0's state_dict() then holds all blocks), or save and load "
                "sharded (hf_shampoo.checkpoint.save_sharded, or torch.distributed.checkpoint "
                "with get_optimizer_state_dict / set_optimizer_state_dict)"
            )
        _refuse(f"it lacks the state of parameter {missing.name!r} block {missing.block_index}")
    # a block that has state has all of it: a tensor left out (another kind's or
    # quantisation's names, a damaged file) would otherwise restart from its initial value
    for stack in owned_stacks:
        members = loads.get(id(stack))
        if not members:
            continue
        expected = stack.expected_state(stack.settings(merged_groups))
        for i, tensors in sorted(members.items()):
            absent = [name for name in expected if name not in tensors]
            if absent:
                block = stack.members[i]
                _refuse(f"parameter {block.name!r} block {block.block_index} lacks its "
                        f"{', '.join(absent)}")

    # Everything checked: now change the optimizer.
    for group, merged in zip(param_groups, merged_groups):
        # as torch: the saved hyperparameters and parameter names, or the group's own
        # names where the saved group has none
        # (saved names for another list of parameters, as torch's flattened state-dict
        # helpers give a whole model's group one stage's names, are not taken)
        names = merged.get("param_names")
        if names is not None and len(names) != len(group["params"]):
            merged = {**merged, "param_names": group.get("param_names")}
            if merged["param_names"] is None:
                del merged["param_names"]
        group.update({k: v for k, v in merged.items() if k != "params"})
    pending: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for stack in owned_stacks:
        stack.state.clear()
        stack.failures.clear()
        members = loads.get(id(stack))
        if not members:
            continue
        stack.materialize(stack.settings(param_groups))
        for i, tensors in members.items():
            for name, tensor in tensors.items():
                if is_pending(name):
                    pending.setdefault(id(stack), {}).setdefault(i, {})[name] = tensor
                else:
                    stack.state[name][i].copy_(tensor)
    return pending


def _check_blocks_exist(saved_state, id_to_index, param_groups, prefix="", blockings=None):
    """Refuse block indices the current blocking does not have (other max_preconditioner_dim)."""
    params: list = [p for group in param_groups for p in group["params"]]
    dims: list[int] = [group["max_preconditioner_dim"] for group in param_groups
                       for _ in group["params"]]
    experts: list[bool] = [group.get("experts", False) for group in param_groups
                           for _ in group["params"]]
    for saved_id, entry in saved_state.items():
        index = id_to_index[saved_id]
        if blockings is not None and index in blockings:
            count = len(blockings[index].slices)
        else:
            count = len(ParamBlocking.of(params[index].shape, dims[index],
                                         experts=experts[index]).slices)
        for key in entry:
            match = _KEY.match(str(key))
            if (match.group(1) or "") != prefix:
                continue
            block_index = int(match.group(2))
            if block_index >= count:
                _refuse(
                    f"parameter {index} has state for block {block_index} but is cut into "
                    f"{count} block(s) here"
                )
