"""Which part of every parameter each rank holds, for any DTensor layout (docs/design.md §8).

FSDP2, HSDP, tensor parallelism (``parallelize_module``: ``Shard(0)`` colwise, ``Shard(1)``
rowwise, ``Replicate()``), their products on 2-D and 3-D meshes (``_StridedShard`` where
FSDP2 shards a dim that TP already shards), expert parallelism and Accelerate's flattened
``dp_shard_cp`` dims all leave each rank one *box* of the full parameter: a range per dim.
``holdings`` finds every rank's box of every parameter: from the parameter's own mesh when
that mesh spans the world, and with one ``all_gather_object`` when some parameter lives on
a sub-mesh (tensor parallel inside data parallel). The boxes are cut as FSDP2 and tensor
parallelism cut (``placement_box``: ``torch.chunk``'s pieces, a ``_StridedShard`` chunking
the shard the later mesh dims left), not by torch's offset helper, which places FSDP2's
uneven strided shards elsewhere than FSDP2 puts them. A rank whose local shard is not its
box makes every rank raise (one tiny ``all_reduce``), never some ranks only. ``HeldBy``
groups ranks holding the same box (replicas) and checks that the boxes tile the parameter.

``refuse_unsupported`` rejects what has no box (``Partial``, custom placements), FSDP1 flat
parameters and DeepSpeed ZeRO partitions, before any state exists. ``STAGES`` says what ranks
that hold different parameters (pipeline stages) do instead (docs/parallelism.md#limits).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

from .collectives import collective_device, problems_on_any_rank

#: ``[lo, hi)`` per dim of the full parameter
Box = tuple[tuple[int, int], ...]

SUPPORTED = (
    "DistributedShampoo supports plain parameters (one process, DDP) and DTensor parameters "
    "placed with Shard(d) (FSDP2's strided shards included) and Replicate() on any mesh: "
    "FSDP2, HSDP, tensor parallel (parallelize_module) and their products"
)

#: the way out for ranks that hold different parameters (pipeline stages), in errors
STAGES = (
    "DistributedShampoo shares blocks among the ranks of one group that hold the same "
    "parameters (data parallel, FSDP2, tensor parallel). For pipeline stages, build one "
    "optimizer per stage (model part) over the stage's own data-parallel group: "
    "process_group=<the stage's dp ProcessGroup or 1-D DeviceMesh> for plain or DDP "
    "parameters; DTensor parameters (fully_shard / parallelize_module on the stage's "
    "sub-mesh) need no argument, their meshes give the group. See "
    "docs/parallelism.md#pipeline-parallel."
)


def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DTensor


def is_dtensor(tensor: Tensor) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(tensor, cls)


def local_tensor(tensor: Tensor) -> Tensor:
    """A DTensor's local part; a plain tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def describe_param(index: int, param: Tensor,
                   names: Sequence[str] | Mapping[int, str] | None, shape: bool = False) -> str:
    """A parameter in an error: its name (``names`` by position or by ``param_index``),
    else its index; with its shape where it has no name, or where ``shape``."""
    if isinstance(names, Mapping):
        name = names.get(index)
    else:
        name = names[index] if names is not None and index < len(names) else None
    shown = f" (shape {tuple(param.shape)})"
    return f"{index}{shown}" if name is None else repr(name) + (shown if shape else "")


def placement_problem(placements: Sequence) -> str | None:
    """Why a DTensor placed so has no box per rank (None when it has one)."""
    from torch.distributed.tensor import Replicate, Shard

    try:  # FSDP2's shard of a dim that tensor parallelism already shards
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover - older torch
        _StridedShard = Shard
    for placement in placements:
        if isinstance(placement, (Shard, _StridedShard, Replicate)):
            continue
        if getattr(placement, "is_partial", lambda: False)():
            return (f"{placement} holds partial sums, not values (a gradient placement, "
                    "not a parameter's)")
        return f"{placement} is not a placement it can map to rows and columns"
    return None


def refuse_unsupported(
    params: Sequence[Tensor], sharded_ok: bool = True, names: Sequence[str] | None = None
) -> None:
    """Raise ``ValueError`` for parameters no distributor here handles; with
    ``sharded_ok=False`` also for DTensors (``distributed="none"`` / ``"ddp"``)."""
    for index, param in enumerate(params):
        where = describe_param(index, param, names)
        if getattr(param, "_is_flat_param", False) or getattr(param, "_fsdp_flattened", False):
            raise ValueError(
                f"DistributedShampoo: parameter {where} is an FSDP1 FlatParameter. "
                f"{SUPPORTED}. Shard the model with torch.distributed.fsdp.fully_shard "
                "(FSDP2; Accelerate: fsdp_version: 2; Trainer: fsdp_config={'fsdp_version': 2})"
            )
        if any(hasattr(param, a) for a in ("ds_id", "ds_numel", "ds_tensor")):
            raise ValueError(
                f"DistributedShampoo: parameter {where} is partitioned by DeepSpeed ZeRO "
                "stage 3, which gathers parameters only inside forward and backward: "
                f"no rank can hold a whole block. {SUPPORTED}, and DeepSpeed ZeRO stage 1 "
                "or 2 (optimizer state and gradients sharded) or 0. Set "
                "zero_optimization.stage to 1 or 2, or shard the parameters with FSDP2 "
                "(fully_shard; Accelerate: fsdp_version: 2; Trainer: "
                "fsdp_config={'fsdp_version': 2})"
            )
        if not is_dtensor(param):
            continue
        if not sharded_ok:
            raise ValueError(
                f"DistributedShampoo: parameter {where} is a DTensor (FSDP2 or tensor "
                "parallel), which distributed='none' and 'ddp' do not handle; use "
                "distributed='auto' or 'fsdp'"
            )
        problem = placement_problem(param.placements)
        if problem is not None:
            raise ValueError(
                f"DistributedShampoo: parameter {where} is a DTensor placed "
                f"{tuple(param.placements)} on a {param.device_mesh.ndim}-D mesh: {problem}. "
                f"{SUPPORTED}"
            )


def mesh_boxes(param: Tensor) -> dict[int, Box | None]:
    """Global rank → its box of a DTensor parameter, for every rank of the parameter's
    mesh (None for a rank whose shard is empty), from the placements alone
    (``placement_boxes``)."""
    mesh = param.device_mesh
    ranks = mesh.mesh
    sizes = tuple(ranks.shape)
    out: dict[int, Box | None] = {}
    for coordinate in itertools.product(*(range(n) for n in sizes)):
        out[int(ranks[coordinate])] = placement_box(tuple(param.shape), sizes, coordinate,
                                                    tuple(param.placements))
    return out


def application_order(placements: Sequence) -> list[int]:
    """The order in which the mesh dims cut the tensor: mesh order, except that a
    ``_StridedShard(d, split_factor)`` cuts after the later mesh dims that shard ``d``.
    That is what FSDP2 does to a tensor-parallel parameter: it chunks each rank's
    tensor-parallel shard (the later ``Shard(d)``), and names that ``_StridedShard`` on
    the earlier, data-parallel dim."""
    order: list[int] = []
    deferred: dict[int, list[int]] = {}  # tensor dim → strided mesh dims waiting
    for i, placement in enumerate(placements):
        dim = getattr(placement, "dim", None)
        if _is_strided(placement):
            deferred.setdefault(dim, []).append(i)
            continue
        order.append(i)
        later = [j for j in range(i + 1, len(placements))
                 if getattr(placements[j], "dim", None) == dim
                 and _shards(placements[j]) and not _is_strided(placements[j])]
        if dim is not None and _shards(placement) and not later:
            order += reversed(deferred.pop(dim, []))
    for waiting in deferred.values():  # a strided shard with no later shard: plain
        order += waiting
    return order


def _is_strided(placement) -> bool:
    return type(placement).__name__ == "_StridedShard"


def _shards(placement) -> bool:
    """Whether the placement cuts a dim (``_StridedShard`` is no ``is_shard()`` in torch)."""
    return _is_strided(placement) or placement.is_shard()


def placement_box(shape: Sequence[int], mesh_sizes: Sequence[int], coordinate: Sequence[int],
                  placements: Sequence) -> Box | None:
    """The box of the rank at ``coordinate`` of a mesh of ``mesh_sizes`` (None: empty):
    each sharding mesh dim, in ``application_order``, cuts the range it is given into
    ``torch.chunk``'s pieces (ceil-sized, trailing ones short or empty), as FSDP2 and
    ``parallelize_module`` cut; ``Replicate()`` cuts nothing."""
    ranges = [(0, int(n)) for n in shape]
    for i in application_order(placements):
        placement = placements[i]
        if not _shards(placement):
            continue
        dim = placement.dim
        lo, hi = ranges[dim]
        chunk = -(-(hi - lo) // mesh_sizes[i]) if hi > lo else 0
        start = min(lo + coordinate[i] * chunk, hi)
        ranges[dim] = (start, min(start + chunk, hi))
    if any(hi <= lo for lo, hi in ranges) and ranges:
        return None
    return tuple(ranges)


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def _ranks(world: int | Sequence[int]) -> tuple[int, ...]:
    """A group's global ranks in its order (an ``int``: the world of that size)."""
    return tuple(range(world)) if isinstance(world, int) else tuple(world)


def spans_group(param: Tensor, world: int | Sequence[int]) -> bool:
    """Whether the DTensor ``param``'s mesh spans the group (``world``: its size, the
    world's, or its global ranks): as many ranks as the world, or the group's very
    ranks."""
    ranks = param.device_mesh.mesh
    if isinstance(world, int):
        return ranks.numel() == world
    return set(ranks.flatten().tolist()) == set(world)


def on_sub_mesh(param: Tensor, world: int | Sequence[int]) -> bool:
    """Whether ``param`` is a DTensor on a mesh smaller than the group (``world``: its size,
    the world's, or its global ranks): ``holdings`` then needs every rank's view of it (a
    collective)."""
    return is_dtensor(param) and not spans_group(param, world)


def holdings(params: dict[int, Tensor], world: int | Sequence[int],
             names: dict[int, str] | None = None, group=None
             ) -> dict[int, list[Box | None]]:
    """``param_index`` → every rank's box, by position in the group (``world``: the world's
    size, or the group's global ranks in its order; ``group``: its process group, None for
    the world); None: it holds nothing. A plain parameter is held whole by every rank.
    Parameters on a mesh smaller than the group (a sub-mesh, ``on_sub_mesh``) need every
    rank's view: one ``all_gather_object`` over the group, which every rank reaches because
    layouts are built by every rank alike (the optimizer has checked that the ranks hold
    the same parameters on the same meshes first: ``agreement.py``), so that every rank
    raises alike."""
    ranks = _ranks(world)
    size = len(ranks)
    out: dict[int, list[Box | None]] = {}
    partial: dict[int, dict[int, Box | None]] = {}
    problems: list[str] = []
    computed: dict[int, dict[int, Box | None]] = {}
    for index, param in params.items():
        if is_dtensor(param):
            computed[index] = mesh_boxes(param)
            problem = _local_problem(index, param, computed[index], names)
            if problem is not None:
                problems.append(problem)
    _agree_on_problems(problems, params, size, group)
    for index, param in params.items():
        if not is_dtensor(param):
            out[index] = [full_box(param.shape)] * size
            continue
        boxes = computed[index]
        if not on_sub_mesh(param, ranks):
            out[index] = [boxes[r] for r in ranks]
        else:
            partial[index] = boxes
    if partial:
        everyone: list = [None] * size
        dist.all_gather_object(everyone, partial, group=group)
        for index in partial:
            merged: dict[int, Box | None] = {}
            for seen in everyone:
                merged.update(seen.get(index, {}))
            missing = [r for r in ranks if r not in merged]
            if missing:
                where = describe_param(index, params[index], names)
                raise ValueError(
                    f"DistributedShampoo: parameter {where} is held by no mesh on ranks "
                    f"{missing} (its mesh has ranks "
                    f"{params[index].device_mesh.mesh.flatten().tolist()}); every rank of "
                    f"the group its blocks are spread over ({_group_text(ranks)}) must hold a "
                    f"part of every parameter. {STAGES}")
            out[index] = [merged[r] for r in ranks]
    return out


def _group_text(ranks: Sequence[int]) -> str:
    world = dist.get_world_size() if dist.is_initialized() else len(ranks)
    return "the world" if tuple(ranks) == tuple(range(world)) else f"ranks {list(ranks)}"


def _local_problem(index: int, param: Tensor, boxes: dict[int, Box | None],
                   names: dict[int, str] | None) -> str | None:
    """Why this rank's box is not the shape of its local tensor (None when it is): the
    placement would mean something the box arithmetic does not know."""
    if not dist.is_initialized():
        return None
    mine = boxes.get(dist.get_rank())
    local = tuple(param.to_local().shape)
    expected = tuple(hi - lo for lo, hi in mine) if mine is not None else None
    if mine is None and math.prod(local) == 0:
        return None
    if expected != local:
        return (f"parameter {describe_param(index, param, names)} placed "
                f"{tuple(param.placements)}: rank {dist.get_rank()}'s local shard is {local}, "
                f"but the placements give it {expected}")
    return None


def _agree_on_problems(problems: list[str], params: dict[int, Tensor], world: int,
                       group=None) -> None:
    """Raise on every rank when any rank found its shard elsewhere than its placements
    say: one tiny ``all_reduce`` (every rank reaches it, at layout time), then the ranks'
    reasons (``collectives.problems_on_any_rank``), so that no rank goes on into a
    collective the others left."""
    if world > 1:
        device = collective_device((local_tensor(p) for p in params.values()), group)
        problems = problems_on_any_rank(problems, device, group)
    if problems:
        raise ValueError(f"DistributedShampoo: {problems[0]}"
                         + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                         + f". {SUPPORTED}")


@dataclass(frozen=True)
class HeldBy:
    """One parameter's boxes grouped: ``boxes[k]`` is held by every rank of ``ranks[k]``
    (replicas), at flat element ``offsets[k]`` of their local buffer (0 where the local
    tensor is the box itself, as under FSDP2 and tensor parallelism; a position in a flat
    partition under DeepSpeed ZeRO); the boxes are disjoint and cover the parameter.

    ``per_rank[r]`` is rank ``r``'s box, None, or a list of ``(box, offset)``."""

    shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    ranks: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...] = ()

    @classmethod
    def of(cls, shape: Sequence[int], per_rank: Sequence, name: str) -> HeldBy:
        groups: dict[Box, list[int]] = {}
        offsets: dict[Box, int] = {}
        for rank, held in enumerate(per_rank):
            if held is None:
                continue
            pieces = held if isinstance(held, list) else [(held, 0)]
            for box, offset in pieces:
                groups.setdefault(box, []).append(rank)
                if offsets.setdefault(box, offset) != offset:
                    raise ValueError(
                        f"DistributedShampoo: parameter {name}: replicas of {box} hold it at "
                        "different places of their local buffers")
        boxes = sorted(groups)
        for a, b in itertools.combinations(boxes, 2):
            if all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a, b)):
                raise ValueError(
                    f"DistributedShampoo: parameter {name}: ranks {groups[a]} and {groups[b]} "
                    f"hold overlapping parts {a} and {b}. {SUPPORTED}")
        volume = sum(math.prod(hi - lo for lo, hi in box) for box in boxes)
        numel = math.prod(int(n) for n in shape)
        if volume != numel:
            raise ValueError(
                f"DistributedShampoo: parameter {name} (shape {tuple(shape)}): the ranks' "
                f"shards hold {volume} of its {numel} elements. {SUPPORTED}")
        return cls(tuple(int(n) for n in shape), tuple(boxes),
                   tuple(tuple(groups[b]) for b in boxes), tuple(offsets[b] for b in boxes))

    @property
    def replicated(self) -> bool:
        return len(self.boxes) == 1


def flat_range_boxes(shape: Sequence[int], lo: int, hi: int) -> list[tuple[Box, int]]:
    """Elements ``[lo, hi)`` of a tensor of ``shape`` in row-major order, as boxes that are
    each contiguous in that order, with each box's first element's position in the range
    (a partial leading row, whole rows, a partial trailing row, recursively)."""
    shape = tuple(int(n) for n in shape)
    if not shape:
        return [((), 0)] if lo < hi else []
    out: list[tuple[Box, int]] = []

    def split(dims: tuple[int, ...], start: int, stop: int, prefix: Box, base: int) -> None:
        if start >= stop:
            return
        inner = math.prod(dims[1:])
        first, last = start // inner, (stop - 1) // inner
        if len(dims) == 1:
            out.append(((*prefix, (start, stop)), base))
            return
        if first == last or start % inner:  # a partial first row
            end = min(stop, (first + 1) * inner)
            split(dims[1:], start - first * inner, end - first * inner,
                  (*prefix, (first, first + 1)), base)
            split(dims, end, stop, prefix, base + end - start)
            return
        whole = stop // inner  # rows [first, whole) are whole
        out.append(((*prefix, (first, whole), *((0, n) for n in dims[1:])), base))
        split(dims, whole * inner, stop, prefix, base + (whole * inner - start))

    split(shape, lo, hi, (), 0)
    return out


def merged_box(box: Box, shape: Sequence[int], merged: Sequence[int]) -> Box | None:
    """``box`` (in the parameter's dims) as a box of its merged view (docs/design.md §1),
    or None when it is not one there (a merged dim whose inner dims are cut)."""
    groups = merge_groups(shape, merged)
    out = []
    for dims in groups:
        # contiguous in the flattened group: singletons, then one range, then full dims
        k = next((i for i, d in enumerate(dims) if box[d][1] - box[d][0] != 1), len(dims))
        if any(box[d] != (0, shape[d]) for d in dims[k + 1:]):
            return None
        lo = hi = 0
        for position, d in enumerate(dims):
            stride = math.prod(shape[e] for e in dims[position + 1:])
            lo += box[d][0] * stride
            hi += (box[d][1] - 1) * stride
        out.append((lo, hi + 1))
    return tuple(out)


def merge_groups(shape: Sequence[int], merged: Sequence[int]) -> list[list[int]]:
    """Which of the parameter's dims make up each merged dim (size-1 dims join the
    group they sit in or the last one)."""
    if math.prod(int(n) for n in shape) != math.prod(merged):
        raise ValueError(f"shape {tuple(shape)} does not merge into {tuple(merged)}")
    groups: list[list[int]] = [[] for _ in merged]
    j, product = 0, 1
    for d, n in enumerate(shape):
        if j >= len(merged):
            groups[-1].append(d)
            continue
        groups[j].append(d)
        product *= int(n)
        if product == merged[j]:
            j, product = j + 1, 1
    return groups


def chunk_boxes(shape: Sequence[int], num_shards: int, dim: int = 0) -> list[Box | None]:
    """The boxes of ``Shard(dim)`` over ``num_shards`` ranks (``torch.chunk``'s sizes, as
    FSDP2 and tensor parallelism cut), for planning without a process group."""
    shape = tuple(int(n) for n in shape)
    if not shape:
        return [()] + [None] * (num_shards - 1)
    size = shape[dim]
    chunk = -(-size // num_shards)
    out: list[Box | None] = []
    for s in range(num_shards):
        lo, hi = min(s * chunk, size), min((s + 1) * chunk, size)
        if lo >= hi:
            out.append(None)
            continue
        out.append(tuple((lo, hi) if d == dim else (0, n) for d, n in enumerate(shape)))
    return out
