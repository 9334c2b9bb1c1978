"""``refresh_delay``: a block's refresh computed off the step's critical path and used ``d``
steps later (docs/design.md §3, "Delayed refreshes").

With ``refresh_delay = d >= 1``, a refresh due at step ``t`` (roots, eigenbases, the
adaptive criterion, Sketchy's low-rank roots) is computed from a snapshot of the blocks'
state taken at step ``t`` after their statistics took its gradient, and written into the
state at the start of step ``t + d``; steps ``t .. t + d - 1`` use the previous result.
The numbers depend on ``d`` only: the snapshot is computed by the same code whether it
runs in the background (``Refresher`` with ``background=True``: a worker thread, which
torch's operators let run beside the step because they release the GIL; on CUDA on a side
stream) or at once.

What a refresh writes (``outputs``: the kinds' ``inverse_root_*``, ``eigenvectors_*``,
``eigenvalues_*``, ``sketch_root_*`` and the eigenvalue-corrected kind's column orders)
is held by the refresh in flight until it applies; a checkpoint holds it per block as
``pending_<name>`` entries beside the step it applies at (``refresh_due_step``, the one
piece of it the optimizer keeps between steps), so that a save with a refresh pending
resumes exactly. ``store`` makes those entries in host memory when a checkpoint is packed
(every block has them, so the checkpoint's keys and shapes do not depend on what was in
flight, as ``torch.distributed.checkpoint`` needs) and ``restore`` reads them back after a
load: between checkpoints they take no memory, and never the GPU's.

A decomposition that failed in the background is counted, warned about or raised
(``ShampooNumericalError``) on the step that applies it, as a synchronous one is on the
step that computes it.

The worker never changes torch's thread count (``torch.set_num_threads`` from one thread
sets it for the whole process, the training thread included): its LAPACK calls run with
the count the process has (``linalg.thread_count_untouched``), one per stack of matrices,
so a result depends on that count as any operator's may, never on timing.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .linalg import thread_count_untouched
from .preconditioners import kind_of
from .preconditioners.refresh import split_first

#: state a refresh writes (the rest: statistics, updated every step, and the stages')
OUTPUT_PREFIXES = ("inverse_root_", "eigenvectors_", "eigenvalues_", "sketch_root_")
PENDING = "pending_"
DUE = "refresh_due_step"


def delay_of(group) -> int:
    """The group's ``refresh_delay`` (0 for a kind that does not refresh)."""
    return int(group.get("refresh_delay", 0) or 0) if kind_of(group).refreshes else 0


def outputs(stack, group) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name → (per-block shape, dtype) of what a refresh of ``stack`` writes."""
    kind = kind_of(group)
    shapes = {name: shape for name, shape in kind.state_shapes(stack, group).items()
              if name.startswith(OUTPUT_PREFIXES)}
    shapes.update(kind.delayed_extras(stack, group))
    return shapes


def state_shapes(stack, group) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The checkpoint entries ``refresh_delay`` adds: a ``pending_`` copy of every output
    (made by ``store`` when a checkpoint is packed, never kept: ``is_pending``) and the
    step it applies at (0: none; kept)."""
    shapes = {PENDING + name: shape for name, shape in outputs(stack, group).items()}
    shapes[DUE] = ((1,), torch.int64)
    return shapes


def is_pending(name: str) -> bool:
    """Whether a checkpoint entry is a pending result (only in checkpoints, not state)."""
    return name.startswith(PENDING)


@dataclass
class Pending:
    """One submitted refresh of some members of a stack: applied at ``due``."""

    due: int
    positions: list[int]  # stack positions of the refreshed blocks
    future: Future


class _Calls:
    """Stands in for a stack (or its health record) in the worker: reads go to the real
    stack (its shape, members), the calls that report (``count_failures``, ``health``'s
    ``record_*``) are kept to be made on the step that applies the result."""

    def __init__(self, stack, calls: list, prefix: str = "") -> None:
        self._stack, self._calls, self._prefix = stack, calls, prefix

    def __getattr__(self, name: str):
        if self._prefix == "" and name == "health":
            return _Calls(self._stack.health, self._calls, "health.")
        if name == "count_failures" or self._prefix:
            def record(*args, **kwargs) -> None:
                self._calls.append((self._prefix + name, args, kwargs))
            return record
        return getattr(self._stack, name)


def _replay(stack, calls: list) -> None:
    for name, args, kwargs in calls:
        target = stack
        if name.startswith("health."):
            target, name = stack.health, name[len("health."):]
        getattr(target, name)(*args, **kwargs)


def _release(pool: ThreadPoolExecutor) -> None:
    """An optimizer's worker told to end (its pending jobs dropped), never waited for: the
    garbage collector runs this wherever it runs, inside ``threading``'s own critical
    sections too (a thread starting holds the lock a join takes: joining there hung a
    process, found by the generated layouts). The thread ends by itself right after."""
    pool.shutdown(wait=False, cancel_futures=True)


class Refresher:
    """Runs the delayed refreshes of one optimizer, one after another, in one worker
    thread (created at the first refresh, told to end when the optimizer goes). With
    ``background=False`` each is computed at once in that thread (the same code and the
    same thread settings, so the same numbers: the reference the background run equals)."""

    def __init__(self, background: bool = True) -> None:
        self.background = background
        self._pool: ThreadPoolExecutor | None = None
        self._streams: dict[torch.device, Any] = {}

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:  # only the stepping thread submits
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="hf_shampoo_refresh")
            weakref.finalize(self, _release, self._pool)
        return self._pool

    def _side_stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def submit(self, compute: Callable[[], Any], device: torch.device,
               snapshot: list[Tensor]) -> Future:
        """Run ``compute`` in the worker; on CUDA on a side stream that first waits for
        the snapshot (``snapshot``'s tensors are kept from the allocator until it ran)."""
        if device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
            stream = self._side_stream(device)
            for tensor in snapshot:
                tensor.record_stream(stream)

            def on_stream():
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    out = compute()
                    done = torch.cuda.Event()
                    done.record(stream)
                return out, done
            future = self._executor().submit(on_stream)
        else:
            future = self._executor().submit(lambda: (compute(), None))
        if not self.background:
            future.result()  # at once: the delayed result computed synchronously
        return future


def submit(stack, job, refresher: Refresher, workspace_type: type) -> None:
    """The refresh of ``job.refresh_rows`` from a snapshot of their state now (after this
    step's statistics), applied at ``job.step + refresh_delay``; the worker gets its own
    ``workspace_type()`` (the step's scratch is not shared)."""
    group = dict(job.group)  # the settings now (a ChainMap flattened; lr changes later)
    kind = kind_of(group)
    rows = job.refresh_rows
    n = job.grad.shape[0]
    device = job.grad.device
    everything = rows == list(range(n))
    index = None if everything else torch.tensor(rows, device=device)
    snapshot = {}
    for name in kind.state_shapes(stack, group):
        tensor = job.state[name]
        snapshot[name] = tensor.clone() if index is None else tensor.index_select(0, index)
    for name, (shape, dtype) in kind.delayed_extras(stack, group).items():
        snapshot[name] = kind.initial_delayed(name, shape, dtype, len(rows), device)
    local = {r: i for i, r in enumerate(rows)}
    shadow = type(job)(
        group=group, step=job.step, members=[job.members[r] for r in rows],
        state=snapshot, grad=torch.empty((len(rows), 0), device=device), param=None,
        refresh_rows=list(range(len(rows))), first_rows=[local[r] for r in job.first_rows],
        offsets=[job.offsets[r] for r in rows] if job.offsets else [])
    names = list(outputs(stack, group))
    calls: list = []
    recorder = _Calls(stack, calls)

    def compute():
        workspace = workspace_type()
        with thread_count_untouched():  # the training thread's count stays as it is
            for group_rows, first in split_first(shadow.refresh_rows, shadow.first_rows):
                kind.refresh(recorder, shadow, group_rows, first, workspace)
        return {name: snapshot[name] for name in names}, calls

    start = time.perf_counter()
    future = refresher.submit(compute, device, list(snapshot.values()))
    job.refresh_seconds = time.perf_counter() - start
    stack.pending.append(Pending(job.step + delay_of(group), shadow.members, future))


def _on_cuda(tensor: Tensor) -> bool:
    return tensor.is_cuda


def _reported_tensors(calls: list) -> list[Tensor]:
    """The CUDA tensors the worker's reports carry (eigenvalues, failure flags: some
    kinds hand the flags over already on the host)."""
    return [value for _, args, kwargs in calls for value in (*args, *kwargs.values())
            if isinstance(value, Tensor) and _on_cuda(value)]


def _result(pending: Pending, device: torch.device) -> tuple[dict[str, Tensor], list]:
    (result, calls), done = pending.future.result()
    if done is not None:  # CUDA: the main stream waits for the side stream's work
        current = torch.cuda.current_stream(device)
        current.wait_event(done)
        # made on the side stream, read on the step's: not reused before the step read them
        for tensor in [*result.values(), *_reported_tensors(calls)]:
            tensor.record_stream(current)
    return result, calls


def apply_due(stacks: list, groups: list[dict], steps: list[int]) -> list:
    """Write the results due this step into the stacks' state (and make the reports the
    worker kept); the stacks whose state changed."""
    changed = []
    for stack in stacks:
        if not stack.pending:
            continue
        step = steps[stack.group_index]
        due = [p for p in stack.pending if p.due <= step]
        if not due:
            continue
        stack.pending = [p for p in stack.pending if p.due > step]
        group = stack.settings(groups)
        for pending in sorted(due, key=lambda p: p.due):
            result, calls = _result(pending, stack.device)
            index = torch.tensor(pending.positions, device=stack.device)
            kind_of(group).apply_delayed(stack.state, index, result)
            _replay(stack, calls)
        changed.append(stack)
    return changed


def store(stacks: list, groups: list[dict]) -> dict[int, dict[str, Tensor]]:
    """When a checkpoint is packed: every pending result (waited for), with the step it
    applies at written into the blocks' ``refresh_due_step``; returned as ``pending_``
    entries of every block of each delayed stack (``id(stack)`` → name → stacked tensor,
    zeros where a block has nothing pending), made now in host memory, whatever the
    device (the checkpoint's copy, not the GPU's), and dropped with the checkpoint."""
    entries: dict[int, dict[str, Tensor]] = {}
    for stack in stacks:
        if DUE not in stack.state:
            continue
        n = len(stack.members)
        made = entries[id(stack)] = {
            PENDING + name: torch.zeros((n, *shape), dtype=dtype)
            for name, (shape, dtype) in outputs(stack, stack.settings(groups)).items()}
        for pending in stack.pending:
            result, _ = _result(pending, stack.device)
            rows = torch.tensor(pending.positions)
            for name, value in result.items():
                target = made[PENDING + name]
                target.index_copy_(0, rows, value.to("cpu", target.dtype))
            stack.state[DUE].index_fill_(0, rows.to(stack.device), pending.due)
    return entries


def restore(stacks: list, groups: list[dict],
            loaded: dict[int, dict[int, dict[str, Tensor]]] | None = None) -> None:
    """After a load: the results a checkpoint saved as pending (due after its step) wait
    in the stacks again (one read of the due steps per stack, at the load). ``loaded``:
    the checkpoint's ``pending_`` entries (``id(stack)`` → position → name → tensor)."""
    loaded = loaded or {}
    for stack in stacks:
        stack.pending = []
        if DUE not in stack.state:
            continue
        group = stack.settings(groups)
        names = list(outputs(stack, group))
        by_due: dict[int, list[int]] = {}
        for position, due in enumerate(stack.state[DUE][:, 0].tolist()):
            if due > group["step"]:
                by_due.setdefault(int(due), []).append(position)
        rows = loaded.get(id(stack), {})
        for due, positions in sorted(by_due.items()):
            result = {name: torch.stack([rows[p][PENDING + name] for p in positions]).to(
                stack.device) for name in names}
            future: Future = Future()
            future.set_result(((result, []), None))
            stack.pending.append(Pending(due, positions, future))


__all__ = ["DUE", "PENDING", "Pending", "Refresher", "apply_due", "delay_of", "is_pending",
           "outputs", "restore", "state_shapes", "store", "submit"]
