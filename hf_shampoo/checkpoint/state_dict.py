"""The optimizer's ``state_dict()`` / ``load_state_dict()`` behind torch's API (docs/design.md §9).

``DistributedShampoo`` keeps torch's methods and delegates here: ``pack_state`` /
``unpack_state`` put a rank's stacks into ``layout``'s state dict and back with the
distributor's facts (rank, world, whether the state is sharded, the key prefix);
``Consolidation`` holds the full state gathered onto this rank until the state changes;
``save`` / ``load`` run torch's state-dict hooks around them and carry what other code
stored in ``optimizer.state``: keys under a parameter (timm's Lookahead slow weights) and
keys that are not parameters (hooks' flags), as torch's ``Optimizer`` does. Nothing here
imports the optimizer: it is handed the objects it works on.

Users register the hooks with torch's public methods (``register_state_dict_pre_hook`` /
``_post_hook``, ``register_load_state_dict_pre_hook`` / ``_post_hook``); since the
optimizer replaces ``state_dict`` / ``load_state_dict``, it runs them itself, reading the
dicts those methods fill (``_optimizer_state_dict_pre_hooks`` ...: torch offers no public
way to read them, and its own methods iterate the same dicts, prepended hooks first).
tests/test_torch_contracts.py checks that hooks registered publicly run as in torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .. import delayed_refresh
from . import layout as checkpoint
from .consolidate import gather_state


def pack_state(param_groups: list[dict], owned: list, distributor, blockings: dict
               ) -> dict[str, Any]:
    """The state dict of this rank's ``owned`` stacks, marked complete or not (with the
    refreshes pending under ``refresh_delay`` waited for and packed beside the state)."""
    pending = delayed_refresh.store(owned, param_groups)
    rank, world = distributor.global_rank_and_world()
    return checkpoint.pack(param_groups, owned, rank, world,
                           not distributor.is_sharded_state, distributor.state_key_prefix,
                           blockings.keys(), pending)


def unpack_state(state_dict: dict[str, Any], param_groups: list[dict], owned: list,
                 distributor, blockings: dict) -> None:
    """Load the blocks this rank owns from ``state_dict`` (``layout.unpack``: refused,
    before anything changes, when it does not fit); the refreshes it saved pending under
    ``refresh_delay`` wait in the stacks again."""
    rank, world = distributor.global_rank_and_world()
    pending = checkpoint.unpack(state_dict, param_groups, owned, rank, world,
                                distributor.state_key_prefix, blockings)
    delayed_refresh.restore(owned, param_groups, pending)


class Consolidation:
    """Every rank's blocks gathered onto this rank (``consolidate_state_dict``): what
    ``state_dict()`` returns there until the next step or load. ``gathered`` says, on every
    rank, that a consolidation happened since the last change."""

    def __init__(self) -> None:
        self.full: dict[str, Any] | None = None  # the full state, on a destination
        self.gathered = False

    def forget(self) -> None:
        """The state changed (a step, a load, a mode switch): the gathered copy no longer
        holds."""
        self.full, self.gathered = None, False

    def gather(self, local: dict[str, Any], to: int | Iterable[int] | None,
               group=None) -> None:
        """Gather every rank's ``local`` state onto ``to`` (a collective over ``group``,
        a ``RankGroup``; None: the world)."""
        self.full = gather_state(local, to, group)
        self.gathered = True

    def copy(self) -> dict[str, Any] | None:
        """A new dict of the gathered state each time (callers edit it in place), None
        where there is none."""
        c = self.full
        if c is None:
            return None
        return {"state": {i: dict(e) for i, e in c["state"].items()},
                "param_groups": [dict(g) for g in c["param_groups"]], "shard": c["shard"]}


def save(optimizer, make: Callable[[], dict[str, Any]], params: list) -> dict[str, Any]:
    """``make()``'s state dict with torch's pre- and post-hooks of ``optimizer`` around it
    and the entries other code stored in ``optimizer.state`` (``params``: the parameters
    in torch's numbering)."""
    for pre_hook in optimizer._optimizer_state_dict_pre_hooks.values():
        pre_hook(optimizer)
    state_dict = make()
    tools = optimizer.state.tool_entries()  # keys other code stored under a parameter
    if tools:  # under the numbers this state dict gives the parameters
        numbers = [n for group in state_dict["param_groups"] for n in group["params"]]
        number_of = dict(zip(map(id, params), numbers))
        for key, entries in tools.items():
            if key in number_of:
                state_dict["state"].setdefault(number_of[key], {}).update(entries)
    state_dict["state"].update(optimizer.state.foreign)  # keys that are not parameters
    for post_hook in optimizer._optimizer_state_dict_post_hooks.values():
        result = post_hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def load(optimizer, state_dict: Any, params: list,
         unpack: Callable[[Any, set[int]], None]) -> None:
    """Torch's load pre-hooks, then ``unpack(state, saved parameter positions)`` of the
    optimizer's own entries, then the other entries back into ``optimizer.state``, then
    the post-hooks."""
    for pre_hook in optimizer._optimizer_load_state_dict_pre_hooks.values():
        result = pre_hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    foreign = {}
    if isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict):
        # keys that name no saved parameter go back into optimizer.state, as in torch;
        # saved parameters may be named by index or by anything else (torch's
        # distributed state-dict helpers list fully qualified names)
        listed = set(saved_positions(state_dict))
        foreign = {k: v for k, v in state_dict["state"].items()
                   if isinstance(k, str) and k not in listed}
        if foreign:
            state_dict = {**state_dict, "state": {k: v for k, v in state_dict["state"].items()
                                                  if k not in foreign}}
    state_dict, tools = split_tool_entries(state_dict)
    unpack(state_dict, saved_param_indices(state_dict, len(params)))
    optimizer.state.foreign.update(foreign)
    if tools:  # keys other code stored under a parameter, by the saved groups' order
        position = saved_positions(state_dict)
        for saved_id, entries in tools.items():
            if position.get(saved_id, len(params)) < len(params):
                optimizer.state[params[position[saved_id]]].update(entries)
    for post_hook in optimizer._optimizer_load_state_dict_post_hooks.values():
        post_hook(optimizer)


def split_tool_entries(state_dict: Any) -> tuple[Any, dict[Any, dict[str, Any]]]:
    """``state_dict`` without the entries that other code stored under a parameter (keys
    that are not this optimizer's ``block_{b}.{name}``), and those entries by saved id."""
    try:
        state = state_dict["state"]
        tools = {pid: {k: v for k, v in entry.items() if not checkpoint.is_state_key(k)}
                 for pid, entry in state.items() if isinstance(entry, dict)}
    except (KeyError, TypeError, AttributeError):
        return state_dict, {}
    tools = {pid: entries for pid, entries in tools.items() if entries}
    if not tools:
        return state_dict, {}
    kept = {pid: ({k: v for k, v in entry.items() if k not in tools[pid]} if pid in tools
                  else entry) for pid, entry in state.items()}
    return {**state_dict, "state": {pid: e for pid, e in kept.items() if e}}, tools


def saved_positions(state_dict: Any) -> dict[Any, int]:
    """Each id the saved groups list for their parameters → its first position over all
    groups (torch's numbering); empty for a malformed state, which ``unpack`` refuses."""
    try:
        ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    except (KeyError, TypeError):
        return {}
    position: dict[Any, int] = {}
    for i, pid in enumerate(ids):
        position.setdefault(pid, i)
    return position


def saved_param_indices(state_dict: Any, count: int) -> set[int]:
    """The positions (torch's numbering over all groups) of the parameters that have state
    in ``state_dict``; nothing for a malformed one, which ``unpack`` then refuses."""
    position = saved_positions(state_dict)
    try:
        return {position[k] for k in state_dict["state"] if k in position
                and position[k] < count}
    except (KeyError, TypeError):
        return set()
