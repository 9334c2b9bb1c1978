"""Sharded optimizer checkpoints on ``torch.distributed.checkpoint`` (docs/design.md §4, §6): the
state dict of ``layout.py`` in a flat form, written and read by torch DCP.

Each rank writes the blocks it owns; loading asks for the blocks the loading rank owns,
wherever they were written, so a checkpoint saved on 2 ranks resumes on 1, 3 or 8 (the
state is re-sharded by block identity ``(parameter, block)``, which does not depend on
the world size). ``consolidate_checkpoint`` turns such a directory into one ordinary
``torch.save`` file that ``load_state_dict`` accepts anywhere.

The flat key layout is ``"state.{param_index}.block_{b}.{name}"`` plus ``"param_groups"``.

Before reading, the directory is checked against its ``.metadata`` (DCP writes it last, once
every rank has written): a missing directory, a save cut short (no ``.metadata``) and a shard
file that is missing or shorter than the metadata says each raise ``integrity.CheckpointError``
naming the checkpoint and the file, before anything is loaded; every rank checks every file, so
all ranks refuse together.
"""

from __future__ import annotations

import io
import os
import tempfile
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from .integrity import CheckpointError, read_checked_metadata

GROUPS_KEY = "param_groups"


def _groups_to_bytes(groups: list[dict]) -> bytes:
    # One opaque leaf: DCP would otherwise flatten the groups into many keys.
    buffer = io.BytesIO()
    torch.save(groups, buffer)
    return buffer.getvalue()


def flatten(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Optimizer state dict → flat ``{key: tensor}`` plus the groups (clones tensors, so
    that each is written alone rather than with the stack it views)."""
    flat: dict[str, Any] = {GROUPS_KEY: _groups_to_bytes(state_dict["param_groups"])}
    # "shard" is not saved: a sharded checkpoint is complete once every rank wrote its part
    for index, entry in state_dict["state"].items():
        for key, tensor in entry.items():
            flat[f"state.{index}.{key}"] = tensor.detach().clone()
    return flat


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    """Flat keys → ``{"state": {param_index: {...}}, "param_groups": [...]}``."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        if key == GROUPS_KEY:
            continue
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    groups = torch.load(io.BytesIO(flat[GROUPS_KEY]), weights_only=True)
    return {"state": state, "param_groups": groups}


def save_sharded(optimizer, checkpoint_dir: str | os.PathLike) -> None:
    """Every rank of the optimizer's group writes its own blocks into ``checkpoint_dir``
    (a collective over that group: each pipeline stage into a directory of its own)."""
    dcp.save(flatten(optimizer.local_state_dict()), checkpoint_id=os.fspath(checkpoint_dir),
             process_group=optimizer.distributor.process_group)


def _read(checkpoint_dir: str | os.PathLike, template: dict[str, Any], group=None) -> None:
    """``dcp.load`` with its ``CheckpointException`` (a ``BaseException``) as ours."""
    try:
        dcp.load(template, checkpoint_id=os.fspath(checkpoint_dir), process_group=group)
    except CheckpointException as error:
        reasons = "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}"
                            for rank, (exc, _) in sorted(error.failures.items()))
        raise CheckpointError(checkpoint_dir, f"reading it failed ({reasons})") from None


def load_sharded(optimizer, checkpoint_dir: str | os.PathLike) -> None:
    """Every rank reads the blocks it owns now (a collective over the optimizer's group), at
    any world size. A missing, cut-short or damaged checkpoint raises ``CheckpointError`` on
    every rank before anything is loaded."""
    saved = read_checked_metadata(checkpoint_dir).state_dict_metadata
    template: dict[str, Any] = {GROUPS_KEY: b""}
    # every entry saved for a block this rank owns, also those this optimizer's settings
    # would not make (a refresh_delay the checkpoint has and this optimizer lacks: the
    # load takes the checkpoint's); which entries a block needs, the load checks
    owned = {(str(index), key.rsplit(".", 1)[0]) for index, key in optimizer.owned_state_keys()}
    for flat_key, meta in saved.items():
        parts = flat_key.split(".", 2)
        if len(parts) == 3 and parts[0] == "state" \
                and (parts[1], parts[2].rsplit(".", 1)[0]) in owned:
            template[flat_key] = torch.empty(meta.size, dtype=meta.properties.dtype, device="cpu")
    _read(checkpoint_dir, template, optimizer.distributor.process_group)
    optimizer.load_state_dict(unflatten(template))


def consolidate_checkpoint(
    checkpoint_dir: str | os.PathLike, output_file: str | os.PathLike
) -> None:
    """Write every rank's blocks of a sharded checkpoint into one ``torch.save`` file
    (no process group needed).

    A checkpoint of ``save_sharded``: ``optimizer.load_state_dict(torch.load(output_file))``
    then works in one process or on every rank of any world size. A checkpoint written with
    torch's state-dict helpers (``dcp.save({"optim": get_optimizer_state_dict(part, opt),
    ...})``, as torchtitan saves one optimizer per pipeline stage): the file holds that
    dictionary with every rank's entries merged (every stage's parameters, by name), which
    ``set_optimizer_state_dict(whole_model, optimizer, state["optim"], ...)`` loads into one
    optimizer over the whole model (docs/parallelism.md#pipeline-parallel)."""
    read_checked_metadata(checkpoint_dir)
    with tempfile.TemporaryDirectory() as tmp:
        flat_file = os.path.join(tmp, "flat.pt")
        try:
            dcp_to_torch_save(os.fspath(checkpoint_dir), flat_file)
        except CheckpointException as error:
            raise CheckpointError(checkpoint_dir, f"reading it failed ({error})") from None
        flat = torch.load(flat_file, weights_only=True)
    torch.save(unflatten(flat) if GROUPS_KEY in flat and isinstance(flat[GROUPS_KEY], bytes)
               else flat, os.fspath(output_file))
