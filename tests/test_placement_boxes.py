"""Every rank's box of a DTensor parameter from its placements (``placements.placement_box``),
on generated shapes, meshes and placements, without a process group: torch's own offsets
where torch's sharding and FSDP2's agree, FSDP2's cutting (``torch.chunk`` of each tensor-
parallel shard) for its uneven strided shards, and the boxes tiling the tensor.

The boxes are also checked against real local shards, with processes: FSDP2 over tensor
parallel in ``tests/test_generated_layouts.py`` (each model case compares every rank's box
with where its shard's values lie) and ``tests/test_parallel.py``.

Also ZeRO's flat ranges as boxes (``placements.flat_range_boxes``, moved here from
tests/test_generated_dp_layouts.py): on the fixed seed and one fresh seed a run, as there.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from hf_shampoo.distributors.placements import flat_range_boxes, placement_box
from tests import layout_cases as lc

pytestmark = pytest.mark.unit


def draw(rng: random.Random, strided: bool):
    order = rng.randint(1, 3)
    shape = tuple(rng.choice([1, 2, 3, 5, 8, 9, 16, 17]) for _ in range(order))
    mesh = tuple(rng.choice([1, 2, 3, 4]) for _ in range(rng.randint(1, 3)))
    placements = [Replicate() if rng.random() < 0.3 else Shard(rng.randrange(order))
                  for _ in mesh]
    if strided:  # FSDP2's strided shard of a dim that later mesh dims shard too
        for i, p in enumerate(placements):
            later = [mesh[j] for j in range(i + 1, len(mesh)) if placements[j] == p]
            if isinstance(p, Shard) and later:
                placements[i] = _StridedShard(p.dim, split_factor=math.prod(later))
                break
    return shape, mesh, placements


def boxes(shape, mesh, placements):
    return {c: placement_box(shape, mesh, c, placements)
            for c in itertools.product(*(range(n) for n in mesh))}


def volume(box) -> int:
    return 0 if box is None else math.prod(hi - lo for lo, hi in box)


@pytest.mark.parametrize("seed", range(6))
def test_boxes_are_torchs_offsets_for_shard_and_replicate(seed):
    rng = random.Random(seed)
    for _ in range(60):
        shape, mesh, placements = draw(rng, strided=False)
        for coordinate, box in boxes(shape, mesh, placements).items():
            local, offset = _compute_local_shape_and_global_offset(
                shape, mesh, list(coordinate), placements)
            expected = (None if math.prod(local) == 0 else
                        tuple((o, o + n) for o, n in zip(offset, local)))
            assert box == expected, (shape, mesh, placements, coordinate)


def nested_chunks(shape, mesh, coordinate, placements) -> torch.Tensor:
    """The indices a rank holds, cut by real ``torch.chunk`` calls: mesh dims in order,
    except that a strided dim chunks the shard the later dims left (FSDP2 over tensor
    parallel)."""
    held = torch.arange(math.prod(shape)).view(shape)
    strided = [i for i, p in enumerate(placements) if isinstance(p, _StridedShard)]
    order = [i for i in range(len(mesh)) if i not in strided] + strided
    for i in order:
        p = placements[i]
        if not isinstance(p, (Shard, _StridedShard)):
            continue
        pieces = torch.chunk(held, mesh[i], dim=p.dim)
        held = pieces[coordinate[i]] if coordinate[i] < len(pieces) else held.narrow(
            p.dim, 0, 0)
    return held


@pytest.mark.parametrize("seed", range(6))
def test_strided_boxes_are_fsdp2s_chunks_of_the_tensor_parallel_shard(seed):
    rng = random.Random(1000 + seed)
    for _ in range(60):
        shape, mesh, placements = draw(rng, strided=True)
        index = torch.arange(math.prod(shape)).view(shape)
        for coordinate, box in boxes(shape, mesh, placements).items():
            expected = nested_chunks(shape, mesh, coordinate, placements)
            if box is None:
                assert expected.numel() == 0, (shape, mesh, placements, coordinate)
            else:
                got = index[tuple(slice(lo, hi) for lo, hi in box)]
                assert torch.equal(got, expected), (shape, mesh, placements, coordinate)


def test_fsdp2_over_tensor_parallel_uneven_rows():
    """A vocabulary of 17 rows on tp 2 (9 and 8 rows) under FSDP2 over 4 ranks: 3, 3, 3, 0
    and 2, 2, 2, 2 rows (torch's offset helper puts rows 15 and 16 on tp rank 0's last
    data-parallel rank, which holds none)."""
    placements = [_StridedShard(0, split_factor=2), Shard(0)]
    got = [placement_box((17, 8), (4, 2), (dp, tp), placements)
           for tp in range(2) for dp in range(4)]
    rows = [None if b is None else b[0] for b in got]
    assert rows == [(0, 3), (3, 6), (6, 9), None, (9, 11), (11, 13), (13, 15), (15, 17)]


@pytest.mark.parametrize("seed", range(4))
def test_boxes_tile_the_tensor_once_per_replica(seed):
    rng = random.Random(2000 + seed)
    for _ in range(60):
        strided = rng.random() < 0.5
        shape, mesh, placements = draw(rng, strided)
        replicas = math.prod(n for n, p in zip(mesh, placements) if not p.is_shard()
                             and not isinstance(p, _StridedShard))
        found = boxes(shape, mesh, placements)
        assert sum(volume(b) for b in found.values()) == replicas * math.prod(shape)
        covered = torch.zeros(shape, dtype=torch.int64)
        for box in found.values():
            if box is not None:
                covered[tuple(slice(lo, hi) for lo, hi in box)] += 1
        assert bool((covered == replicas).all()), (shape, mesh, placements)


# ------------------------------------------------------------------ flat_range_boxes
def draw_range(rng: random.Random) -> tuple[tuple[int, ...], int, int]:
    order = rng.choice([0, 1, 2, 3, 4, 5])
    shape = tuple(rng.choice([1, 1, 2, 3, 4, 5, 7]) for _ in range(order))
    numel = math.prod(shape)
    lo = rng.randint(0, numel)
    return shape, lo, rng.randint(lo, numel)


@pytest.mark.parametrize("seed", lc.seeds())
def test_flat_range_boxes_tile_the_range_in_order(seed):
    """For drawn shapes (0-d to 5-d, size-1 dims) and ranges ``[lo, hi)``: the boxes are
    non-empty, each contiguous in row-major order, starting where the previous one ended
    (their offsets in the range count up from 0), and together exactly the range."""
    rng = random.Random(f"boxes-{seed}")
    for draw in range(lc.scaled(1500)):
        shape, lo, hi = draw_range(rng)
        where = f"seed {seed} draw {draw}: shape {shape}, range [{lo}, {hi})"
        positions = torch.arange(math.prod(shape)).view(shape)
        at = lo
        boxes = flat_range_boxes(shape, lo, hi)
        for box, offset in boxes:
            assert len(box) == len(shape), where
            assert all(0 <= a < b <= n for (a, b), n in zip(box, shape)), (where, box)
            assert offset == at - lo, (where, box, offset)
            flat = positions[tuple(slice(a, b) for a, b in box)].reshape(-1)
            assert flat.numel() > 0, (where, box)
            assert torch.equal(flat, torch.arange(at, at + flat.numel())), (where, box)
            at += flat.numel()
        assert at == hi, (where, boxes)
        # a partial leading row, whole rows, a partial trailing row, at each depth
        assert len(boxes) <= max(1, 2 * len(shape) - 1), (where, boxes)
