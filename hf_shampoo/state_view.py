"""``optimizer.state``: torch's per-parameter view of the state, over the stacked storage.

torch's optimizers keep ``optimizer.state[p]``, a dict of tensors per parameter, and tools
walk it to inspect, offload or reset state. Here the state of same-shape blocks lives in
stacked tensors (``stack.py``), so ``StateView`` maps each parameter that has state on this
rank to an entry ``{"block_{b}.{name}": view}``: the same names as ``state_dict()``, each a
view of the block's row of the stacked tensor (reading it reads the state; writing into it
in place, or assigning a tensor to a key, which copies it in, changes the state). Other
keys that tools store under a parameter (timm's Lookahead's slow weights) are kept, and
saved in that parameter's ``state_dict()["state"][i]`` entry and restored by
``load_state_dict``, as torch does; keys that are not parameters (hooks' flags) are saved
in ``state_dict()["state"]`` and restored too. The
map from parameters to their views is built once and kept until the layout or a stack's
set of state tensors changes (``stack.StateDict.changes``), so ``optimizer.state[p]`` costs
O(1) per access and is never stale. The state lives on the parameters' device and follows
them at the next ``step()``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, MutableMapping
from typing import Any

from torch import Tensor

from .stack import StateDict


class StateEntry(dict):
    """One parameter's state. Assigning a tensor to one of the optimizer's keys copies it
    into the storage; any other key (a tool's own, e.g. timm's Lookahead slow weights) is
    kept by the view, as torch's ``optimizer.state`` keeps it, and saved with the
    parameter's entry of ``state_dict()``."""

    def __init__(self, stacked: dict[str, Tensor], extra: dict[str, Any]) -> None:
        super().__init__(stacked)
        super().update(extra)
        self._stacked, self._extra = stacked.keys(), extra

    def __setitem__(self, key: str, value: Any) -> None:
        if key in self._stacked:
            dict.__getitem__(self, key).copy_(value)
            return
        self._extra[key] = value
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        if key in self._stacked:
            raise KeyError(f"{key!r} is the optimizer's own state; it cannot be deleted")
        del self._extra[key]
        super().__delitem__(key)

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value


class StateView(MutableMapping):
    """Parameter → ``StateEntry``: the state of its blocks that this rank holds (see the
    module), and what other code stored under the parameter."""

    def __init__(self, optimizer: Any) -> None:
        self._optimizer = optimizer
        self._extra: dict[int, tuple[Tensor, dict[str, Any]]] = {}
        # keys that are not parameters (torch's optimizer.state takes any key: hooks store
        # flags there); state_dict() saves them in "state" and load_state_dict() restores them
        self.foreign: dict[Any, Any] = {}
        # the map of views and what it was built from: (layout, its owned stacks, the
        # count of state changes); ``rebuilds`` counts the builds
        self._map: dict[int, tuple[Tensor, dict[str, Tensor]]] = {}
        self._only: dict[int, list[str]] | None = None  # keys only checkpoints hold
        self._built_from: tuple | None = None
        self.rebuilds = 0

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(key, Tensor):
            raise TypeError("optimizer.state[param] is a view of the optimizer's state: "
                            "assign to its entries (optimizer.state[param][key] = tensor)")
        self.foreign[key] = value

    def __delitem__(self, key: Any) -> None:
        del self.foreign[key]

    def _checkpoint_only(self) -> dict[int, list[str]]:
        """``id(param)`` → its keys only checkpoints hold, built with the map of views."""
        self._stacked()
        if self._only is None:
            self._only = self._optimizer._checkpoint_only_keys()
        return self._only

    def _stacked(self) -> dict[int, tuple[Tensor, dict[str, Tensor]]]:
        """``id(param)`` → (param, its blocks' views): rebuilt only when the layout, its
        owned stacks or the tensors some stack holds changed since the last build."""
        layout = self._optimizer._layout
        source = (layout, None if layout is None else layout.owned, StateDict.changes)
        built = self._built_from
        if built is None or any(a is not b for a, b in zip(source[:2], built[:2])) \
                or source[2] != built[2]:
            self._map, self._built_from = self._build(layout), source
            self._only = None
            self.rebuilds += 1
        return self._map

    @staticmethod
    def _build(layout) -> dict[int, tuple[Tensor, dict[str, Tensor]]]:
        entries: dict[int, tuple[Tensor, dict[str, Tensor]]] = {}
        if layout is None:
            return entries
        for stack in layout.owned:
            if not stack.state:
                continue
            for i, block in enumerate(stack.members):
                _, entry = entries.setdefault(id(block.param), (block.param, {}))
                for name, tensor in stack.state.items():
                    entry[f"block_{block.block_index}.{name}"] = tensor[i]
        return entries

    def tool_entries(self) -> dict[int, dict[str, Any]]:
        """``id(param)`` → the keys other code stored under that parameter (non-empty)."""
        return {key: dict(extra) for key, (_, extra) in self._extra.items() if extra}

    def _params(self) -> dict[int, Tensor]:
        params = {key: param for key, (param, _) in self._stacked().items()}
        params.update((key, param) for key, (param, extra) in self._extra.items() if extra)
        return params

    def __getitem__(self, param: Tensor) -> StateEntry:
        """The parameter's entry; for a parameter without state here an empty one, which
        keeps what is stored in it (as torch's ``defaultdict``). Any other key: what was
        stored under it."""
        if not isinstance(param, Tensor):
            return self.foreign[param]
        found = self._stacked().get(id(param))
        _, extra = self._extra.setdefault(id(param), (param, {}))
        if _asked_by_torch_unflatten():
            # torch's set_optimizer_state_dict(..., flatten_optimizer_state_dict=True) takes
            # the names of each parameter's state from this entry: lay the state out first
            # (as state_dict() does), else it would load nothing, silently; and list the
            # entries only checkpoints hold (refresh_delay's pending results), else torch
            # would leave them out of what it loads
            if found is None:
                self._optimizer._materialize_owned_state()
                found = self._stacked().get(id(param))
            views = found[1] if found is not None else {}
            names = dict.fromkeys(self._checkpoint_only().get(id(param), []))
            return StateEntry({**views, **names}, extra)
        return StateEntry(found[1] if found is not None else {}, extra)

    def __contains__(self, param: object) -> bool:
        if not isinstance(param, Tensor):
            return param in self.foreign
        if id(param) in self._stacked():
            return True
        found = self._extra.get(id(param))
        return found is not None and bool(found[1])

    def __iter__(self) -> Iterator[Any]:
        return iter([*self._params().values(), *self.foreign])

    def __len__(self) -> int:
        return len(self._params()) + len(self.foreign)

    def __bool__(self) -> bool:
        # Never falsy: torch.distributed.checkpoint.state_dict takes an empty
        # ``optimizer.state`` for "never stepped" and runs a fake step with zero gradients
        # and lr=0, which here would decay the factor statistics and advance the step.
        return True

    def __repr__(self) -> str:
        return f"StateView({len(self)} parameters with state on this rank)"


def _asked_by_torch_unflatten() -> bool:
    """Whether the code asking for ``optimizer.state[param]`` is torch's
    ``_unflatten_optim_state_dict`` (``torch.distributed.checkpoint.state_dict``), which
    rebuilds each parameter's state from the names this entry lists."""
    module = sys.modules.get("torch.distributed.checkpoint.state_dict")
    code = getattr(getattr(module, "_unflatten_optim_state_dict", None), "__code__", None)
    return code is not None and sys._getframe(2).f_code is code
