"""``DistributedShampoo.metrics()`` (hf_shampoo/health.py, docs/metrics.md): every value
checked against what it means, from the optimizer's state and ``describe_blocks()``; the
step records them without a single extra operator in a steady step; and on 2 gloo ranks
the dict is the same on both ranks and equals one process's (DDP, FSDP2 lossless), ranks
that hold the same blocks counting once (trainer groups of one rank, fsdp_mode="local" on
HSDP replicas), and a failure on one rank is counted on both."""

from __future__ import annotations

import collections
import math
import os
import statistics
import tempfile
import warnings

import pytest
import torch
import torch.multiprocessing as mp

from hf_shampoo import DistributedShampoo
from hf_shampoo.config import is_refresh_step
from hf_shampoo.health import StackHealth
from tests.helpers import join_gloo_world, leave_gloo_world

pytestmark = pytest.mark.unit

F64 = torch.float64
SHAPES = [(6, 4), (5, 3), (7,), (9, 8)]


def _params(shapes=SHAPES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=F64)) for s in shapes]


def _grads(params, step, seed=1):
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=F64)


def _train(params, opt, steps, first=1):
    for t in range(first, first + steps):
        _grads(params, t)
        opt.step()


def _make(params, **config):
    config = {"lr": 0.01, "factor_matrix_dtype": F64, "distributed": "none",
              "max_preconditioner_dim": 6, **config}
    return DistributedShampoo(params, **config)


def _state(opt, params, name):
    """``{(param_index, block): tensor}`` of one state name, from ``optimizer.state``."""
    out = {}
    for index, p in enumerate(params):
        for key, value in opt.state[p].items():
            block, _, rest = key.partition(".")
            if rest == name:
                out[index, int(block.removeprefix("block_"))] = value.clone()
    return out


def _m(opt):
    return opt.metrics()


def _regularized_condition(matrix, epsilon):
    values = torch.linalg.eigvalsh(matrix + epsilon * torch.eye(matrix.shape[-1], dtype=F64))
    smallest = values.min()
    if smallest < epsilon:
        values = (values - smallest) + epsilon
    return float(values.max() / values.min())


@pytest.mark.parametrize("kind", ["shampoo", "eigenvalue_corrected", "eigendecomposed_shampoo"])
def test_condition_numbers_are_the_factors_at_their_last_refresh(kind):
    """Largest and median of λ_max/λ_min of every factor's A + εI at its last refresh (A:
    the factor matrix, bias-corrected), from eigvalsh of the factors in optimizer.state;
    a step without a refresh changes the factors, not the numbers."""
    params = _params()
    config = {"preconditioner": kind, "precondition_frequency": 3, "epsilon": 1e-3,
              "betas": (0.9, 0.99)}
    opt = _make(params, **config)
    assert math.isnan(_m(opt)["optimizer/condition_max"])  # no refresh yet
    _train(params, opt, 6)  # refreshes at steps 3 and 6
    bias = 1 - 0.99**6
    conditions = []
    for j in (0, 1):
        for factor in _state(opt, params, f"factor_matrix_{j}").values():
            conditions.append(_regularized_condition(factor / bias, 1e-3))
    metrics = _m(opt)
    assert metrics["optimizer/condition_max"] == pytest.approx(max(conditions), rel=1e-9)
    assert metrics["optimizer/condition_median"] == pytest.approx(
        statistics.median(conditions), rel=1e-9)
    assert len(conditions) > 4 and max(conditions) > 1.5 * min(conditions)
    _train(params, opt, 1, first=7)  # no refresh at step 7
    assert _m(opt)["optimizer/condition_max"] == metrics["optimizer/condition_max"]


def test_kinds_without_eigenvalues_report_no_condition_number():
    """Coupled root iterations and spectral descent have no eigenvalues: no key."""
    params = _params([(6, 4)])
    opt = _make(params, root_inverse="coupled_newton", epsilon=1e-3)
    _train(params, opt, 2)
    assert "optimizer/condition_max" not in _m(opt)
    params = _params([(6, 4)])
    opt = _make(params, preconditioner="spectral_descent")
    _train(params, opt, 2)
    assert not any(key.startswith("optimizer/condition_") for key in _m(opt))


def test_fallbacks_count_failed_decompositions_since_the_last_call(monkeypatch):
    """A forced eigh failure keeps the previous root (and warns, as before); metrics()
    counts one fallback per factor and refresh, and starts again from 0 once read."""
    params = _params([(6, 4)])
    opt = _make(params, precondition_frequency=1, epsilon=1e-3)
    _train(params, opt, 1)
    assert _m(opt)["optimizer/fallbacks"] == 0

    def broken(*args, **kwargs):
        raise torch.linalg.LinAlgError("forced")

    monkeypatch.setattr(torch.linalg, "eigh", broken)
    with pytest.warns(UserWarning, match="keeping the previous preconditioner"):
        _train(params, opt, 2, first=2)
    assert _m(opt)["optimizer/fallbacks"] == 2 * 2  # two factors, two refreshes
    assert _m(opt)["optimizer/fallbacks"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(params, opt, 1, first=4)
    assert _m(opt)["optimizer/fallbacks"] == 2


@pytest.mark.parametrize("schedule", ["all", "staggered"])
def test_refresh_blocks_are_the_blocks_of_the_last_refresh(schedule):
    """refresh_blocks: the blocks whose schedule (describe_blocks' refresh_offset) refreshed
    them at the last refresh step; all of them with "all", a share with "staggered"."""
    params = _params()
    opt = _make(params, precondition_frequency=4, refresh_schedule=schedule, epsilon=1e-3,
                grafting="adam")
    blocks = opt.describe_blocks()
    group = opt.param_groups[0]
    counts = {}
    for t in range(1, 11):
        _train(params, opt, 1, first=t)
        due = sum(is_refresh_step(group, t, b["refresh_offset"]) for b in blocks)
        if due:
            counts[t] = due
        metrics = _m(opt)
        last = max(counts, default=None)
        assert metrics["optimizer/refresh_blocks"] == (counts[last] if last else 0)
        assert (metrics["optimizer/refresh_seconds"] > 0) == (last is not None)
    if schedule == "all":
        assert set(counts.values()) == {len(blocks)}
    else:
        assert len(counts) > 3 and max(counts.values()) < len(blocks)


@pytest.mark.parametrize("kind,shifted", [("shampoo", False),
                                          ("eigendecomposed_shampoo", True),
                                          ("eigenvalue_corrected", True)])
def test_basis_recomputed_fraction_is_the_criterion(kind, shifted):
    """With eigenbasis_tolerance τ > 0: the share of factors whose kept basis Q fails
    ‖B - diag B‖ <= τ‖B‖ (B = QᵀAQ; A + εI for the kinds that check that) at the last
    refresh, computed here from the state before and after that refresh."""
    def run(tolerance):
        params = _params()
        opt = _make(params, preconditioner=kind, precondition_frequency=3, epsilon=1e-3,
                    eigenbasis_tolerance=tolerance)
        _train(params, opt, 5)
        kept = {j: _state(opt, params, f"eigenvectors_{j}") for j in (0, 1)}
        _train(params, opt, 1, first=6)  # the second refresh
        return opt, params, kept

    def ratios(opt, params, kept):
        out = []
        for j in (0, 1):
            factors = _state(opt, params, f"factor_matrix_{j}")
            for key, q in kept[j].items():
                a = factors[key] + (1e-3 * torch.eye(q.shape[-1], dtype=F64) if shifted else 0)
                b = q.mT @ a @ q
                off = b - torch.diag_embed(torch.diagonal(b))
                out.append(float(torch.linalg.matrix_norm(off) / torch.linalg.matrix_norm(b)))
        return sorted(out)

    probe = ratios(*run(1e-12))
    middle = len(probe) // 2
    assert probe[middle] > 1.01 * probe[middle - 1]
    tolerance = (probe[middle - 1] + probe[middle]) / 2
    # the bases kept at the first refresh depend on τ where it checks (against the
    # identity): the ratios of this run's own bases decide
    opt, params, kept = run(tolerance)
    found = ratios(opt, params, kept)
    assert all(abs(r - tolerance) > 0.005 * tolerance for r in found)
    expected = sum(r > tolerance for r in found) / len(found)
    assert 0 < expected < 1
    assert _m(opt)["optimizer/basis_recomputed_fraction"] == pytest.approx(expected)
    assert "optimizer/basis_recomputed_fraction" not in _m(_make(_params(), preconditioner=kind))


def test_graft_ratio_is_the_grafted_over_the_preconditioned_norm():
    """graft_ratio/shampoo = sqrt(Σ‖graft(G)‖² / Σ‖P‖²) over the blocks of the last step:
    Adam's direction from the grafting state, P = I₀ G I₁ from the inverse roots."""
    params = _params([(6, 4), (5, 3)])
    opt = _make(params, grafting="adam", betas=(0.0, 0.99), precondition_frequency=2,
                epsilon=1e-3)
    _train(params, opt, 1)
    assert math.isnan(_m(opt)["optimizer/graft_ratio/shampoo"])  # Adam alone before step 2
    _train(params, opt, 2, first=2)
    group = opt.param_groups[0]
    roots = [_state(opt, params, f"inverse_root_{j}") for j in (0, 1)]
    adam = _state(opt, params, "grafting_state")
    graft = preconditioned = 0.0
    for index, p in enumerate(params):
        key = (index, 0)
        bias = 1 - group["grafting_beta2"] ** 3
        grafted = p.grad / ((adam[key] / bias).sqrt() + group["grafting_epsilon"])
        direction = roots[0][key] @ p.grad @ roots[1][key]
        graft += float(grafted.square().sum())
        preconditioned += float(direction.square().sum())
    assert _m(opt)["optimizer/graft_ratio/shampoo"] == pytest.approx(
        math.sqrt(graft / preconditioned), rel=1e-9)
    plain = _make(_params([(6, 4)]))  # no grafting: no ratio
    assert not any("graft_ratio" in key for key in _m(plain))


def test_steps_preconditioning_and_state_bytes():
    params = _params()
    opt = _make(params, grafting="adam", precondition_frequency=3, epsilon=1e-3)
    before = _m(opt)
    assert before["optimizer/steps"] == 0 and before["optimizer/preconditioning"] == 0
    assert before["optimizer/state_bytes"] == 0
    _train(params, opt, 2)
    assert _m(opt)["optimizer/preconditioning"] == 0  # starts at step 3
    _train(params, opt, 1, first=3)
    after = _m(opt)
    assert after.keys() == before.keys()
    assert all(isinstance(v, float) for v in after.values())
    assert after["optimizer/steps"] == 3 and after["optimizer/preconditioning"] == 1
    described = sum(row["state_bytes"] for row in opt.describe_blocks())
    held = sum(t.numel() * t.element_size() for p in params for t in opt.state[p].values())
    assert after["optimizer/state_bytes"] == described == held
    assert after["optimizer/state_bytes_max_rank"] == after["optimizer/state_bytes"]


def test_staggered_start_counts_the_blocks_past_their_start():
    params = _params()
    opt = _make(params, grafting="adam", precondition_frequency=4, epsilon=1e-3,
                refresh_schedule="staggered")
    blocks = opt.describe_blocks()
    assert len({b["refresh_offset"] for b in blocks}) == 4
    for t in range(1, 9):
        _train(params, opt, 1, first=t)
        started = sum(t - b["refresh_offset"] >= 4 for b in blocks)
        assert _m(opt)["optimizer/preconditioning"] == started / len(blocks)


# ------------------------------------------------------------ no pass over the step's data
def _numel(shape) -> int:
    """Elements of an operator input as the profiler records it (a list of tensors: the
    largest)."""
    if shape and isinstance(shape[0], list):
        return max((_numel(s) for s in shape), default=0)
    return math.prod(shape) if shape else 0


def _operators(opt, params, step):
    """The aten operators of one step, with the elements of their largest input."""
    from torch.profiler import profile

    _grads(params, step)
    with profile(record_shapes=True) as prof:
        opt.step()
    return collections.Counter(
        (e.name, repr(e.input_shapes), max((_numel(s) for s in e.input_shapes), default=0))
        for e in prof.events() if e.name.startswith("aten::"))


def test_recording_adds_no_operator_to_a_steady_step_and_none_over_gradients(monkeypatch):
    """The step's operators with and without the records: the same in a steady step; at a
    refresh step the extra ones work on eigenvalues, none on a gradient block's size."""
    shapes = [(6, 4), (5, 3)]

    def runs(record):
        if not record:
            monkeypatch.setattr(StackHealth, "record_condition", lambda *a, **k: None)
            monkeypatch.setattr(StackHealth, "record_recomputed", lambda *a, **k: None)
        params = _params(shapes)
        opt = _make(params, grafting="adam", precondition_frequency=3, epsilon=1e-3,
                    eigenbasis_tolerance=0.1)
        _train(params, opt, 3)
        ops = [_operators(opt, params, 4), _operators(opt, params, 5),
               _operators(opt, params, 6)]  # steady, steady, refresh
        monkeypatch.undo()
        return ops

    with_records, without = runs(True), runs(False)
    assert with_records[0] == without[0] and with_records[1] == without[1]
    extra = with_records[2] - without[2]
    assert extra  # the condition numbers are computed, from the eigenvalues
    smallest = min(math.prod(s) for s in shapes)
    assert all(numel < smallest for (_, _, numel) in extra), extra


# ----------------------------------------------------------------------- 2 gloo ranks
CONFIG = {"grafting": "adam", "precondition_frequency": 3, "epsilon": 1e-3,
          "eigenbasis_tolerance": 0.05, "betas": (0.9, 0.99)}


def _sharded(mesh, placements, **config):
    """``_params`` as DTensors on ``mesh``, trained 6 steps with ``_grads``'s gradients."""
    from torch.distributed.tensor import distribute_tensor

    params = [torch.nn.Parameter(distribute_tensor(p.detach(), mesh, placements))
              for p in _params()]
    opt = _make(params, distributed="auto", **CONFIG, **config)
    plain = _params()
    for t in range(1, 7):
        _grads(plain, t)
        for p, q in zip(params, plain):
            p.grad = distribute_tensor(q.grad, mesh, placements)
        opt.step()
    held = sum(t.numel() * t.element_size() for p in params for t in opt.state[p].values())
    return opt.metrics(), held, type(opt.distributor).__name__


def _ddp_worker(rank, world, init_file, out_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    join_gloo_world(rank, world, init_file)
    layouts = {}
    # trainer groups of one rank: each rank holds every block, counted once
    params = _params()
    opt = _make(params, distributed="ddp", num_trainers_per_group=1, **CONFIG)
    _train(params, opt, 6)
    layouts["trainer_groups"] = opt.metrics()
    # FSDP2, lossless: the blocks spread over both ranks
    layouts["fsdp"] = _sharded(init_device_mesh("cpu", (2,)), [Shard(0)])
    # fsdp_mode="local" on an HSDP mesh of 2 replicas of one shard: the same blocks twice
    layouts["local_replicas"] = _sharded(
        init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard")),
        [Replicate(), Shard(0)], fsdp_mode="local")
    params = _params()
    opt = _make(params, distributed="ddp", **CONFIG)
    _train(params, opt, 6)
    first = opt.metrics()
    original = torch.linalg.eigh

    def broken(*args, **kwargs):  # rank 1's decompositions fail, rank 0's do not
        raise torch.linalg.LinAlgError("forced")

    if rank == 1:
        torch.linalg.eigh = broken
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(params, opt, 3, first=7)  # a refresh at step 9
    torch.linalg.eigh = original
    second = opt.metrics()
    # the failures the stacks' own bookkeeping counts (one failed refresh: count 1)
    failed = sum(c for stack in opt._layout.owned for counts in stack.failures.values()
                 for c in counts)
    torch.save({"first": first, "second": second, "failed": failed, "layouts": layouts,
                "distributor": type(opt.distributor).__name__},
               os.path.join(out_dir, f"{rank}.pt"))
    leave_gloo_world()


def _same(a, b):
    return a == b or (math.isnan(a) and math.isnan(b))


@pytest.mark.distributed
def test_two_ranks_agree_and_equal_one_process():
    torch.set_num_threads(1)
    params = _params()
    opt = _make(params, **CONFIG)
    _train(params, opt, 6)
    single = opt.metrics()
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_ddp_worker, args=(2, os.path.join(out_dir, "init"), out_dir), nprocs=2)
        ranks = [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(2)]
    assert ranks[0]["distributor"] == "DataParallelDistributor"
    for name in ("first", "second"):
        assert ranks[0][name].keys() == ranks[1][name].keys() == single.keys()
        assert all(_same(ranks[0][name][k], ranks[1][name][k]) for k in single), name
    first = ranks[0]["first"]
    for key in ("steps", "preconditioning", "refresh_blocks", "fallbacks", "condition_max",
                "condition_median", "basis_recomputed_fraction", "state_bytes"):
        assert _same(first[f"optimizer/{key}"], single[f"optimizer/{key}"]), key
    assert first["optimizer/graft_ratio/shampoo"] == pytest.approx(
        single["optimizer/graft_ratio/shampoo"], rel=1e-12)
    assert 0 < first["optimizer/state_bytes_max_rank"] < first["optimizer/state_bytes"]
    exact = ("steps", "preconditioning", "refresh_blocks", "fallbacks", "condition_max",
             "condition_median", "basis_recomputed_fraction", "state_bytes")
    replicated = ranks[0]["layouts"]["trainer_groups"]
    assert all(_same(replicated[f"optimizer/{k}"], single[f"optimizer/{k}"]) for k in exact)
    assert replicated["optimizer/state_bytes_max_rank"] == single["optimizer/state_bytes"]
    fsdp = [r["layouts"]["fsdp"] for r in ranks]
    assert fsdp[0][2] == "ShardedDistributor" and fsdp[0][0] == fsdp[1][0]
    assert fsdp[0][0]["optimizer/state_bytes"] == fsdp[0][1] + fsdp[1][1]
    for key in exact:  # lossless: every block as one process computes it
        assert _same(fsdp[0][0][f"optimizer/{key}"], single[f"optimizer/{key}"]), key
    local = [r["layouts"]["local_replicas"] for r in ranks]
    assert local[0][2] == "LocalShardDistributor" and local[0][0] == local[1][0]
    assert local[0][1] == local[1][1] == local[0][0]["optimizer/state_bytes"]
    # the failures of rank 1's blocks (its stacks' failure counts), counted on both ranks
    assert ranks[0]["failed"] == 0 and ranks[1]["failed"] > 0
    assert ranks[0]["second"]["optimizer/fallbacks"] == ranks[1]["failed"]
