"""Each rank's blocks bit for bit as one process's, on the test device, in one process: the
data-parallel owners' rule with only one simulated rank's stacks computed (the others' are
skipped, as another rank would compute them), under the library at hand and under products
that round by call (``tests/batch_variant.py``). Stacks are cut by a rule of the blocks
alone (docs/design.md §4), so a rank computes its blocks in the calls one process makes; on
CUDA, where batched products round by batch, this is the one-GPU check of that
(``HF_SHAMPOO_TEST_DEVICE=cuda``, run by ``benchmarks/gpu_session.sh``)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from hf_shampoo import DistributedShampoo, stacking
from hf_shampoo.distributors import SingleProcessDistributor
from hf_shampoo.distributors.ddp import DataParallelDistributor
from tests.batch_variant import BatchVariantProducts
from tests.helpers import TEST_DEVICE

pytestmark = [pytest.mark.unit, pytest.mark.device]

KINDS = {
    "shampoo": dict(grafting="adam", epsilon=1e-8),
    "soap": dict(preconditioner="eigenvalue_corrected", betas=(0.9, 0.99), epsilon=1e-8),
    "kl_shampoo": dict(preconditioner="kl_shampoo", grafting="adam", epsilon=1e-8),
    "muon": dict(preconditioner="spectral_descent", betas=(0.95, 1.0)),
    "staggered_4bit": dict(grafting="adam", quantization="4bit", refresh_schedule="staggered",
                           epsilon=1e-8),
}
#: a small model's shapes: same-shape matrices (several stacks of a kind), a conv kernel
SHAPES = [(24, 16)] * 6 + [(16, 24)] * 3 + [(8, 4, 3, 3)] * 2 + [(40, 16)]


class OneRank(SingleProcessDistributor):
    """Rank ``rank`` of ``world`` under the data-parallel owners: only its stacks computed."""

    assignment_cost = "memory"

    def __init__(self, world: int, rank: int) -> None:
        super().__init__()
        self.world_size, self.rank = world, rank

    def assign(self, blocks, block_shapes, costs=None, slots=None, units=None):
        return DataParallelDistributor.assign(self, blocks, block_shapes, costs, slots, units)


def _run(kind: str, distributor=None):
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(TEST_DEVICE))
              for s in SHAPES]
    grads = [[torch.randn(s, generator=gen).to(TEST_DEVICE) for s in SHAPES]
             for _ in range(6)]
    opt = DistributedShampoo(params, lr=0.01, max_preconditioner_dim=16,
                             precondition_frequency=2, start_preconditioning_step=2,
                             distributed="none", **KINDS[kind])
    if distributor is not None:
        opt.distributor = distributor
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params], opt.describe_blocks()


def _stacks(rows: list[dict]) -> set[frozenset]:
    """The layout's stacks as sets of (parameter, block)."""
    out: dict[int, set] = {}
    for row in rows:
        out.setdefault(row["stack"], set()).add((row["param_index"], row["block"]))
    return {frozenset(members) for members in out.values()}


def _block(param: torch.Tensor, row: dict) -> torch.Tensor:
    merged = param.reshape(row["merged_shape"])
    return merged[tuple(slice(o, o + n) for o, n in zip(row["offset"], row["shape"]))]


@pytest.mark.parametrize("batch_variant", [False, True], ids=["library", "batch_variant"])
@pytest.mark.parametrize("world", [3])
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_rank_computes_its_blocks_as_one_process(monkeypatch, kind, world,
                                                       batch_variant):
    monkeypatch.setattr(stacking, "MIN_STACKS", 2)  # stacks of several blocks
    with BatchVariantProducts() if batch_variant else nullcontext():
        expected, rows = _run(kind)
        seen = 0
        for rank in range(world):
            got, mine = _run(kind, OneRank(world, rank))
            assert _stacks(mine) == _stacks(rows)  # the same stacks, only owned otherwise
            for row in mine:
                if row["rank"] != rank:
                    continue
                seen += 1
                index = row["param_index"]
                assert torch.equal(_block(got[index], row), _block(expected[index], row)), (
                    f"rank {rank} of {world}: {row['name']} block {row['block']}")
    assert seen == len(rows)  # every block was some rank's
