"""``optimizer.state``: torch's per-parameter view of the state, over the stacked storage.

torch's optimizers keep ``optimizer.state[p]``, a dict of tensors per parameter, and tools
walk it to inspect, offload or reset state. Here the state of same-shape blocks lives in
stacked tensors (``stack.py``), so ``StateView`` maps each parameter that has state on this
rank to an entry ``{"block_{b}.{name}": view}``: the same names as ``state_dict()``, each a
view of the block's row of the stacked tensor (reading it reads the state; writing into it
in place, or assigning a tensor to a key, which copies it in, changes the state). The view
is computed on access, so it is never stale. The state lives on the parameters' device and
follows them there at the next ``step()``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from torch import Tensor


class StateEntry(dict):
    """One parameter's state: assigning a tensor to a key copies it into the storage."""

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self:
            raise KeyError(f"optimizer.state entry has no key {key!r}; its keys: "
                           f"{', '.join(self)}")
        self[key].copy_(value)  # (dict's own __getitem__: the view)


class StateView(Mapping):
    """Parameter → ``StateEntry`` of its blocks that this rank holds (see the module)."""

    def __init__(self, optimizer: Any) -> None:
        self._optimizer = optimizer

    def _entries(self) -> dict[int, tuple[Tensor, StateEntry]]:
        layout = getattr(self._optimizer, "_layout", None)
        entries: dict[int, tuple[Tensor, StateEntry]] = {}
        if layout is None:
            return entries
        for stack in layout.owned:
            if not stack.state:
                continue
            for i, block in enumerate(stack.members):
                _, entry = entries.setdefault(id(block.param), (block.param, StateEntry()))
                for name, tensor in stack.state.items():
                    dict.__setitem__(entry, f"block_{block.block_index}.{name}", tensor[i])
        return entries

    def __getitem__(self, param: Tensor) -> StateEntry:
        """The parameter's entry; an empty one for a parameter without state here (as
        torch's ``defaultdict`` gives, without adding it)."""
        found = self._entries().get(id(param))
        return found[1] if found is not None else StateEntry()

    def __contains__(self, param: object) -> bool:
        return id(param) in self._entries()

    def __iter__(self) -> Iterator[Tensor]:
        return (param for param, _ in self._entries().values())

    def __len__(self) -> int:
        return len(self._entries())

    def __bool__(self) -> bool:
        # Never falsy: torch.distributed.checkpoint.state_dict takes an empty
        # ``optimizer.state`` for "never stepped" and runs a fake step with zero gradients
        # and lr=0, which here would decay the factor statistics and advance the step.
        return True

    def __repr__(self) -> str:
        return f"StateView({len(self)} parameters with state on this rank)"
