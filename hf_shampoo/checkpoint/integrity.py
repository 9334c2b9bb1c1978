"""Whether a checkpoint directory is whole (docs/checkpoints.md, "Faults"): the error type a
person can act on, and the completion mark that tells a whole checkpoint from one whose save
was cut short.

A checkpoint is whole once every rank has written its part. The tools mark that in their own
ways: torch's DCP writes ``.metadata`` last, after every rank's shards; the HF Trainer writes
``trainer_state.json`` last (rank 0, after the model, optimizer, scheduler and its own RNG
state); Accelerate marks nothing, so ``integrations.accelerate.save_state`` writes
``COMPLETE_MARK`` once every rank is done. ``CheckpointError`` says which checkpoint, which
file, what is wrong with it and what to do (resume from the previous checkpoint); it is an
``Exception`` (torch's own ``CheckpointException`` is a ``BaseException``, which ``except
Exception`` misses) and a ``ValueError``, as the refusals of ``load_state_dict`` are. It is
defined in ``errors.py`` with the package's other exceptions and exported here as well.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from ..errors import CHECKPOINT_ADVICE, CheckpointError

COMPLETE_MARK = "hf_shampoo_complete.json"
TRAINER_STATE = "trainer_state.json"  # what the HF Trainer writes last
DCP_METADATA = ".metadata"  # what torch.distributed.checkpoint writes last

ADVICE = CHECKPOINT_ADVICE  # the name it had here, before errors.py


def mark_complete(checkpoint: str | os.PathLike) -> Path:
    """Write ``COMPLETE_MARK`` into ``checkpoint``: the size of every file in it, written to a
    temporary name and renamed (so the mark itself is never half-written). Call it on one
    process, after every rank has finished writing. Returns the mark's path."""
    root = Path(checkpoint)
    sizes = {str(p.relative_to(root)): p.stat().st_size
             for p in sorted(root.rglob("*")) if p.is_file() and p.name != COMPLETE_MARK}
    mark = root / COMPLETE_MARK
    partial = root / (COMPLETE_MARK + ".partial")
    partial.write_text(json.dumps({"files": sizes}, indent=1, sort_keys=True))
    os.replace(partial, mark)
    return mark


def check_marked(checkpoint: str | os.PathLike) -> None:
    """Raise ``CheckpointError`` unless ``checkpoint`` holds a ``COMPLETE_MARK`` and every
    file it lists is there with the size it had when the mark was written."""
    root = Path(checkpoint)
    if not root.is_dir():
        raise CheckpointError(root, "there is no such directory")
    mark = root / COMPLETE_MARK
    if not mark.is_file():
        raise CheckpointError(
            root, f"it has no {COMPLETE_MARK}, which is written once every rank has finished "
            "saving: its save was cut short (or it was not written by "
            "hf_shampoo.integrations.accelerate.save_state)")
    try:
        files = json.loads(mark.read_text())["files"]
    except (ValueError, KeyError) as error:
        raise CheckpointError(root, f"its {COMPLETE_MARK} cannot be read ({error})",
                              file=mark) from None
    for name, size in files.items():
        path = root / name
        if not path.is_file():
            raise CheckpointError(root, "the file is missing", file=path)
        if path.stat().st_size != size:
            raise CheckpointError(
                root, f"the file has {path.stat().st_size} bytes where {size} were written: "
                "it was cut short or changed after the save", file=path)


def trainer_checkpoint_problem(checkpoint: str | os.PathLike) -> str | None:
    """Why the Trainer could not resume from ``checkpoint``, or None when it can: its
    ``trainer_state.json`` (written last) is missing, a ``COMPLETE_MARK`` in it does not
    match its files, or a folder of DCP shards in it (FSDP's sharded state) is cut short."""
    root = Path(checkpoint)
    if not (root / TRAINER_STATE).is_file():
        return (f"it has no {TRAINER_STATE}, which the Trainer writes last: its save was cut "
                "short")
    try:
        if (root / COMPLETE_MARK).exists():
            check_marked(root)
        check_dcp_folders(root)
    except CheckpointError as error:
        return error.problem
    return None


def check_dcp_folders(root: str | os.PathLike) -> None:
    """``dcp.read_checked_metadata`` on every folder under ``root`` that holds DCP shards
    (``*.distcp``: FSDP's sharded model and optimizer in a Trainer or Accelerate checkpoint)."""
    for folder in sorted({p.parent for p in Path(root).rglob("*.distcp")}):
        read_checked_metadata(folder)


def marked_problem(checkpoint: str | os.PathLike) -> str | None:
    """Why ``check_marked(checkpoint)`` refuses it (its message), or None when it passes."""
    try:
        check_marked(checkpoint)
    except CheckpointError as error:
        return str(error)
    return None


def newest_complete(parent: str | os.PathLike, pattern: str = r"checkpoint[-_](\d+)",
                    problem: Callable[[Path], str | None] = marked_problem,
                    ) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest directory under ``parent`` whose name matches ``pattern`` (its number
    orders them) and in which ``problem`` finds nothing (by default: a valid
    ``COMPLETE_MARK``); and the newer ones passed over, each with why. ``(None, skipped)``
    when none is complete."""
    root = Path(parent)
    if not root.is_dir():
        return None, []
    numbered = []
    for path in root.iterdir():
        found = re.fullmatch(pattern, path.name)
        if found and path.is_dir():
            numbered.append((int(found.group(1)), path))
    skipped: list[tuple[Path, str]] = []
    for _, path in sorted(numbered, reverse=True):
        why = problem(path)
        if why is None:
            return path, skipped
        skipped.append((path, why))
    return None, skipped


def read_checked_metadata(checkpoint_dir: str | os.PathLike):
    """The DCP metadata of ``checkpoint_dir``, once every file it refers to is there and long
    enough; ``CheckpointError`` (naming the file) otherwise."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise CheckpointError(root, "there is no such directory")
    if not (root / DCP_METADATA).is_file():
        raise CheckpointError(
            root, f"it has no {DCP_METADATA}, which torch.distributed.checkpoint writes last, "
            "once every rank has written its shards: its save was cut short",
            file=root / DCP_METADATA)
    from torch.distributed.checkpoint import FileSystemReader  # only when a DCP folder is read

    try:
        metadata = FileSystemReader(os.fspath(root)).read_metadata()
    except Exception as error:  # noqa: BLE001 - any unreadable metadata is the same fault
        raise CheckpointError(root, f"its {DCP_METADATA} cannot be read ({error})",
                              file=root / DCP_METADATA) from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        path = root / name
        if not path.is_file():
            raise CheckpointError(root, "the shard file is missing", file=path)
        if path.stat().st_size < end:
            raise CheckpointError(
                root, f"the shard file has {path.stat().st_size} bytes where the metadata "
                f"needs {end}: it was cut short", file=path)
    return metadata
