"""Which ranks a distributor spreads its blocks over: the world, or a group of its own
(``process_group=``, pipeline stages; docs/parallelism.md#pipeline-parallel).

``RankGroup`` is the ranks of one process group in the group's order (its ``rank`` is this
process's position there) and that process group (``Distributor.process_group``; the
``collectives`` run over it).
``resolve`` turns the constructor's ``process_group`` (a ``ProcessGroup`` or a 1-D
``DeviceMesh``) and the parameters into one,
refusing, with the ranks named, a group that does not contain this rank and DTensor
parameters whose mesh is not within it. Without a group, DTensor parameters on a stage's
sub-mesh of a root mesh with a ``"pp"`` dim (torchtitan's ``(pp, dp_shard, tp)``) are
spread over the stage's ranks, through the group of the root's slice over its other dims
(a multi-dim one flattened, as torchtitan flattens its meshes); other DTensor layouts over
the world, as before (along a mesh dim no parameter lives on, ranks hold replicas of the
same parameters, which share the blocks). No group is ever made by some ranks only: torch
names the groups every rank creates by a counter that such a group advances on its
members alone, so the next group the world creates would hang.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import Tensor

from .placements import describe_param, is_dtensor

__all__ = ["RankGroup", "group_over", "ranks_of", "resolve"]

#: groups this process created over a set of ranks (``group_over``), by those ranks
_CREATED: dict[tuple[int, ...], Any] = {}


@dataclass(frozen=True)
class RankGroup:
    """The ranks a distributor's collectives run over, in the group's order, and its
    process group (None: the default group, the world)."""

    ranks: tuple[int, ...]
    process_group: Any = None

    @classmethod
    def world(cls) -> RankGroup:
        """Every rank of the default group (one process where none is initialised)."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls((0,))
        return cls(tuple(range(dist.get_world_size())))

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's position in the group."""
        if not (dist.is_available() and dist.is_initialized()):
            return 0
        return self.ranks.index(dist.get_rank())

    @property
    def is_world(self) -> bool:
        return self.process_group is None

    def describe(self) -> str:
        """The group in messages and ``describe()``: "the world (4 ranks)" or its ranks."""
        if self.is_world:
            return f"the world ({self.size} rank{'s' if self.size != 1 else ''})"
        return f"ranks {list(self.ranks)}"


def group_over(ranks: Iterable[int]) -> RankGroup:
    """The group over exactly ``ranks`` (global ranks) that this process already knows: the
    world's, a ``process_group`` an optimizer was given, or one ``resolve`` found (a copy
    of an optimizer, ``pickle`` / ``copy.deepcopy``, finds its group again here). No group
    is created: a group made by some ranks only would shift torch's numbering of the
    groups created later by every rank, which then hang (``new_group``'s names)."""
    ranks = tuple(sorted(set(int(r) for r in ranks)))
    world = RankGroup.world()
    if ranks == tuple(sorted(world.ranks)):
        return world
    group = _CREATED.get(ranks)
    if group is None:
        raise ValueError(
            f"DistributedShampoo: no process group over ranks {list(ranks)} is known in this "
            "process (an optimizer copied from another process?); build the optimizer "
            "again with process_group=")
    return RankGroup(tuple(dist.get_process_group_ranks(group)), group)


def _known(group: Any) -> RankGroup:
    """``group`` (a process group of this process) as a ``RankGroup``, remembered."""
    ranks = tuple(dist.get_process_group_ranks(group))
    _CREATED.setdefault(tuple(sorted(ranks)), group)
    return RankGroup(ranks, group)


def _from_argument(process_group: Any) -> RankGroup:
    """The constructor's ``process_group``: a ``ProcessGroup`` or a 1-D ``DeviceMesh``."""
    from torch.distributed.device_mesh import DeviceMesh

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "DistributedShampoo: process_group needs torch.distributed initialised "
            "(torch.distributed.init_process_group, torchrun or accelerate launch)")
    me = dist.get_rank()
    if isinstance(process_group, DeviceMesh):
        if process_group.ndim != 1:
            raise ValueError(
                f"DistributedShampoo: process_group is a {process_group.ndim}-D DeviceMesh "
                f"(dims {process_group.mesh_dim_names}); it takes a ProcessGroup or a 1-D "
                "DeviceMesh (e.g. world_mesh['dp'], or a flattened mesh: "
                "world_mesh['dp_shard', 'tp']._flatten()). DTensor parameters need no "
                "process_group: their meshes give the group")
        ranks = tuple(int(r) for r in process_group.mesh.flatten().tolist())
        if me not in ranks:
            raise ValueError(
                f"DistributedShampoo: process_group (a DeviceMesh of ranks {list(ranks)}) "
                f"does not contain this rank ({me}); give each rank the group it trains in")
        group = process_group.get_group()
    elif process_group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"DistributedShampoo: process_group does not contain this rank ({me}) "
            "(torch.distributed.new_group returned GroupMember.NON_GROUP_MEMBER here); "
            "give each rank the group it trains in")
    elif isinstance(process_group, dist.ProcessGroup):
        group = process_group
        ranks = tuple(dist.get_process_group_ranks(group))
        if me not in ranks:
            raise ValueError(
                f"DistributedShampoo: process_group (ranks {list(ranks)}) does not contain "
                f"this rank ({me}); give each rank the group it trains in")
    else:
        raise TypeError(
            "DistributedShampoo: process_group must be a torch.distributed ProcessGroup, a "
            f"1-D DeviceMesh or None (the world); got {type(process_group).__name__}")
    if ranks == RankGroup.world().ranks:
        return RankGroup(ranks, None if group is dist.group.WORLD else group)
    return _known(group)


def ranks_of(process_group: Any) -> tuple[int, ...]:
    """The global ranks of a ``process_group`` argument (checked as ``resolve`` checks)."""
    return _from_argument(process_group).ranks


#: the root mesh dim that marks pipeline stages (torchtitan's and torch's name)
PIPELINE_DIM = "pp"


def _pipeline_stage(meshes: list[tuple[int, Tensor]]) -> RankGroup | None:
    """This rank's pipeline stage, where the DTensor parameters all live on sub-meshes of
    one root mesh that has a ``"pp"`` dim (of more than one rank) none of them lives on:
    the root's slice over its other dims, through its own group (a multi-dim slice
    flattened, as torchtitan flattens its meshes; torch then creates the flattened groups
    of every slice of the root, so every rank builds its stage's optimizer at the same
    point, as training scripts do). None otherwise (the world: along a dim no parameter
    lives on, ranks hold replicas of the same parameters, unless it is the ``"pp"`` dim)."""
    # Roots by value, not identity: two meshes built alike (a resume's mesh beside the
    # first one) are one layout. And torch caches sub-meshes by value across roots, so a
    # sub-mesh may come back as another mesh's child (a size-1 "dp_shard" of rank 0 is
    # any mesh's): the stage is that of the roots with a "pp" dim within whose stage at
    # this rank every sub-mesh lies (by ranks), provided they agree on it; the group is
    # found once per stage (its ranks), so that every rank of the world flattens (a
    # collective) at the same layout, whichever root it was handed.
    roots = {_mesh_key(root): root
             for root in (p.device_mesh._get_root_mesh() for _, p in meshes)}
    fitting = []  # (this rank's stage, root) of the roots every sub-mesh lies within
    for k, r in roots.items():
        if PIPELINE_DIM in k[2] and k[0][k[2].index(PIPELINE_DIM)] > 1:
            stage = _stage_ranks(r)
            if stage and all(_inside(p.device_mesh, stage) for _, p in meshes):
                fitting.append((stage, r))
    if len({stage for stage, _ in fitting}) != 1:
        return None
    key, root = fitting[0]
    if key in _STAGES:  # found before: the same group, whichever mesh torch handed back
        return _STAGES[key]
    dims = tuple(root.mesh_dim_names or ())
    other = tuple(d for d in dims if d != PIPELINE_DIM)
    if not other:
        return None
    stage = root[other] if len(other) > 1 else root[other[0]]
    group = stage._flatten().get_group() if len(other) > 1 else stage.get_group()
    _STAGES[key] = found = _known(group)
    return found


def _mesh_key(mesh) -> tuple:
    """A mesh by value: its shape, ranks and dim names."""
    return (tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()),
            tuple(mesh.mesh_dim_names or ()))


def _stage_ranks(root) -> tuple[int, ...]:
    """This rank's stage of ``root`` (a mesh with a ``"pp"`` dim): the ranks of its slice
    at this rank's ``"pp"`` index, sorted; empty where this rank is not in ``root``."""
    dims = tuple(root.mesh_dim_names or ())
    where = (root.mesh == dist.get_rank()).nonzero()
    if where.numel() == 0:
        return ()
    pp = dims.index(PIPELINE_DIM)
    return tuple(sorted(root.mesh.select(pp, int(where[0][pp])).flatten().tolist()))


def _inside(sub, stage: tuple[int, ...]) -> bool:
    """Whether ``sub`` lies within ``stage`` (a root's ``_stage_ranks``): not along
    ``"pp"``, its ranks among the stage's (its dims may be the root's or flattened ones)."""
    if PIPELINE_DIM in (sub.mesh_dim_names or ()):
        return False
    return set(sub.mesh.flatten().tolist()) <= set(stage)


#: this rank's pipeline stage groups by their ranks, once found: every rank finds its stage
#: at the same layouts, so every rank looks its own up alike; flattening another mesh whose
#: stage is the same would create groups on the ranks handed that mesh only (a hang)
_STAGES: dict[tuple, RankGroup] = {}


def mesh_ranks(param: Tensor) -> tuple[int, ...]:
    return tuple(int(r) for r in param.device_mesh.mesh.flatten().tolist())


def resolve(process_group: Any, params: Sequence[Tensor],
            names: Sequence[str] | None = None) -> RankGroup:
    """The group blocks are spread over: ``process_group``'s ranks where given; else, for
    DTensor parameters on sub-meshes of a root mesh with a ``"pp"`` dim none of them lives
    on (torchtitan's ``("pp", "dp_shard", "tp")``), this rank's pipeline stage (the root's
    slice over its other dims: ``_pipeline_stage``); else the world. Refuses a group
    without this rank, and DTensor parameters whose mesh reaches outside the given
    group."""
    meshes = [(i, p) for i, p in enumerate(params) if is_dtensor(p)]
    if process_group is None:
        if not meshes or not (dist.is_available() and dist.is_initialized()):
            return RankGroup.world()
        stage = _pipeline_stage(meshes)
        return RankGroup.world() if stage is None else stage
    group = _from_argument(process_group)
    inside = set(group.ranks)
    for index, param in meshes:
        outside = sorted(set(mesh_ranks(param)) - inside)
        if outside:
            where = describe_param(index, param, names, shape=True)
            raise ValueError(
                f"DistributedShampoo: parameter {where} lives on "
                f"a mesh of ranks {list(mesh_ranks(param))}, which reaches ranks {outside} "
                f"outside process_group ({group.describe()}); the group must hold every "
                "rank of its parameters' meshes (or leave process_group out: DTensor "
                "parameters are spread over their meshes' ranks)")
    return group
