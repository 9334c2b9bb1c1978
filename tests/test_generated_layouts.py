"""Bit-identical to one process for every DTensor layout: drawn cases, not picked ones
(docs/parallelism.md, docs/sharded.md).

Each case (tests/layout_cases.py, run by tests/generated_layout_worker.py) draws a mesh of
2, 4 or 8 gloo ranks (1-D to 3-D, size-1 dims, a flattened dim, sub-meshes), parameters of
1 to 4 dims placed by ``distribute_tensor`` with any mix of ``Shard(d)`` (the same dim on
several mesh dims, uneven and empty shards), ``_StridedShard`` and ``Replicate()``, plain
tensors beside them, or a small model placed by ``parallelize_module`` (colwise / rowwise
Linear with and without bias, embeddings sharded either way, sequence-parallel norms,
expert-parallel fused experts) and ``fully_shard`` / HSDP, or (4 and 8 ranks) two pipeline
stages on a ``("pp", ...)`` mesh, each with parameters of its own on drawn sub-meshes of
its half and one optimizer (compared stage by stage); a kind with random block size,
cadence, start step and decay; steps where some parameters get no gradient. Every case
must end with every parameter ``torch.equal`` to one process on every rank, the ranks'
state adding up to one process's, and, where the case saves through
``torch.distributed.checkpoint`` mid-run and resumes under a second drawn layout, the same.

CI runs the fixed seed (``HF_SHAMPOO_LAYOUT_SEED``, default 0) and one fresh seed a run;
``make fuzz`` runs many more. A failure prints the seed, the case and the command that
reruns it.
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp

from tests import layout_cases as lc
from tests.generated_layout_worker import run_world
from tests.helpers import one_thread_per_process
from tests.layout_cases import base_seed

pytestmark = pytest.mark.distributed

SEEDS = lc.seeds()
#: world size → (synthetic cases, model cases) per seed, before ``HF_SHAMPOO_LAYOUT_CASES``
BUDGET = {2: (6, 2), 4: (5, 2), 8: (2, 1)}


def deadline(world: int, cases: list[dict]) -> float:
    """Seconds one world's spawn may take before its unfinished cases fail (a hung case
    fails instead of hanging the test): generous, about a second a case per rank pair on 2
    cores, scaled with the cases (``make fuzz`` runs many more than CI)."""
    return 300 + 10 * len(cases) * max(1, world // 2)



def case_seed(seed: int, world: int, index: int) -> int:
    return seed * 1_000_003 + world * 1_000 + index


def cases_for(world: int) -> list[dict]:
    synthetic, models = BUDGET[world]
    out = []
    for seed in SEEDS:
        count = lc.scaled(synthetic)
        out += [lc.draw_dtensor_case(case_seed(seed, world, i), world) | {"base_seed": seed}
                for i in range(count)]
        out += [lc.draw_dtensor_case(case_seed(seed, world, count + i), world, modules=True)
                | {"base_seed": seed} for i in range(lc.scaled(models))]
    return out


def regressions() -> list[dict]:
    """Cases that were wrong once, kept as they were reported (4 ranks): a 2-block model
    with biased colwise / rowwise Linear layers, LayerNorms and a colwise head on a
    ``(dp_shard 2, tp 2)`` mesh under Shampoo (vectors with Kronecker factors), 4-bit
    Shampoo and SOAP, resumed through DCP at step 5; a ``(17,)`` vector sharded twice on
    dim 0 under 4-bit Shampoo; a ``(24, 2)`` matrix placed ``(_StridedShard(0, sf=2),
    Shard(0))`` under SOAP with blocks of 8; 4-bit SOAP's staggered QR refreshes."""
    split = {"tp": 2, "dp_replicate": 1, "dp_shard": 2, "shard_blocks": False}
    layers = [("mlp", 32, True, False), ("norm", "layer", False)] * 2 + [("head", 8, True)]
    start = dict(max_preconditioner_dim=32, start_preconditioning_step=3,
                 precondition_frequency=3, lr=0.01)
    out = []
    for index, kind in enumerate(("shampoo", "shampoo_4bit", "soap")):
        config = {**lc.KINDS[kind], "kind": kind, **start}
        out.append({"seed": 90_000 + index, "world": 4, "kind": kind, "steps": 8,
                    "model": {**split, "width": 16, "layers": layers},
                    "count": lc.model_param_count(layers), "resume_at": 5,
                    "resume_split": split, "no_grad": {}, "config": config})
    mesh = {"shape": (2, 2), "names": ("dp_shard", "tp"), "flatten": None}
    vector = {**lc.KINDS["shampoo_4bit"], "kind": "shampoo_4bit", "lr": 0.01,
              "max_preconditioner_dim": 32, "precondition_frequency": 2}
    soap = {**lc.KINDS["soap"], "kind": "soap", "lr": 0.01, "max_preconditioner_dim": 8,
            "precondition_frequency": 2, "start_preconditioning_step": 2}
    for index, (shape, where, config) in enumerate((
            ((17,), [("S", 0), ("S", 0)], vector),
            ((24, 2), [("SS", 0, 2), ("S", 0)], soap))):
        out.append({"seed": 90_010 + index, "world": 4, "kind": config["kind"], "steps": 5,
                    "names": ["p0"], "shapes": [shape],
                    "layout": {"mesh": mesh, "where": [(("dp_shard", "tp"), where)]},
                    "no_grad": {}, "config": config})
    # 4-bit SOAP refreshing by QR with staggered schedules: a (70,) vector's 9 blocks, 4
    # owners; an owner's stack held no first decomposition where one process's did
    staggered = {**lc.KINDS["soap_4bit"], "kind": "soap_4bit", "lr": 0.03,
                 "max_preconditioner_dim": 8, "precondition_frequency": 3}
    out.append({"seed": 90_020, "world": 4, "kind": "soap_4bit", "steps": 5, "names": ["p0"],
                "shapes": [(70,)], "layout": {"mesh": mesh, "where": [None]}, "no_grad": {},
                "config": staggered})
    out += issue53_layouts(mesh)
    # pipeline stages resumed under a second mesh built like the first: torch handed back
    # either mesh as a sub-mesh's root, so the stage was not found (its roots compared by
    # identity) and stage 0 checked its layout over the world (a gloo abort); seed
    # 1982479580's case 11 of world 4 in the long search
    stage = lambda where, resume: {"where": where, "resume_where": resume, "no_grad": {}}  # noqa: E731
    dp = ("dp_replicate",)
    out.append({
        "seed": 1982485527442751, "world": 4, "kind": "shampoo_rmsprop_nesterov", "steps": 6,
        "pipeline": {
            "mesh": {"shape": (2, 2), "names": ("pp", "dp_replicate"), "flatten": None},
            "stages": [
                {"names": ["s0.p0", "s0.p1", "s0.p2", "s0.p3"],
                 "shapes": [(48,), (7,), (8, 4, 3, 3), (8, 16)],
                 **stage([(dp, [("R",)]), None, (dp, [("S", 3)]), (dp, [("R",)])],
                         [(dp, [("S", 0)]), None, None, (dp, [("R",)])])},
                {"names": ["s1.p0", "s1.p1"], "shapes": [(8, 33), (7,)],
                 **stage([(dp, [("S", 1)]), (dp, [("R",)])], [(dp, [("S", 0)]), None])}],
            "resume_mesh": {"shape": (2, 2), "names": ("pp", "dp_replicate"), "flatten": None}},
        "resume_at": 5,
        "config": {**lc.KINDS["shampoo_rmsprop_nesterov"], "kind": "shampoo_rmsprop_nesterov",
                   "lr": 0.01, "max_preconditioner_dim": 32, "precondition_frequency": 1,
                   "start_preconditioning_step": 1, "weight_decay": 0.05,
                   "weight_decay_type": "decoupled"},
        "stacking": {"min_stacks": 1, "stack_elements": 1 << 24, "batch_variant": False}})
    out += one_rank_stage()
    return [case | {"base_seed": "regression"} for case in out]


def one_rank_stage() -> list[dict]:
    """Seed 365081319's case 28 of world 8 in the long search, in two cases: a mesh with a
    one-rank ``"dp_shard"``, then a pipeline stage whose parameters all live on such a
    sub-mesh. Torch's sharding caches compare meshes by value, so the stage's DTensor came
    back on the earlier mesh's sub-mesh, whose root has no ``"pp"`` dim: stage 0 spread its
    blocks over the world while stage 1 used its stage (a hang). Each case now starts from
    empty caches, as a fresh process does (``fresh_dtensor_caches`` in the worker); a
    process that keeps several meshes passes ``process_group=`` (docs/parallelism.md)."""
    soap = {**lc.KINDS["soap"], "kind": "soap", "lr": 0.03, "max_preconditioner_dim": 16,
            "precondition_frequency": 3, "start_preconditioning_step": 3}
    one = {"min_stacks": 1, "stack_elements": 1 << 24, "batch_variant": False}
    first = {"seed": 90_050, "world": 4, "kind": "soap", "steps": 4, "names": ["p0"],
             "shapes": [(32,)], "no_grad": {}, "config": soap, "stacking": one,
             "layout": {"mesh": {"shape": (4, 1), "names": ("dp_replicate", "dp_shard"),
                                 "flatten": None},
                        "where": [(("dp_shard",), [("S", 0)])]}}
    staged = {"seed": 90_051, "world": 4, "kind": "soap", "steps": 5, "config": soap,
              "stacking": one,
              "pipeline": {
                  "mesh": {"shape": (2, 1, 2), "names": ("pp", "dp_shard", "tp"),
                           "flatten": None},
                  "stages": [
                      {"names": ["s0.p0"], "shapes": [(32,)], "no_grad": {},
                       "where": [(("dp_shard",), [("S", 0)])]},
                      {"names": ["s1.p0", "s1.p1"], "shapes": [(32,), (8, 6)], "no_grad": {},
                       "where": [(("dp_shard", "tp"), [("S", 0), ("R",)]), None]}]}}
    return [first, staged]


def issue53_layouts(mesh: dict) -> list[dict]:
    """Four layouts an AMD EPYC's BLAS found not bit-identical to one process (each rank
    stacked only its own blocks, one process all of a kind, and that BLAS rounded a block by
    its batch): two ``(17,)`` vectors placed ``[Replicate(), Shard(0)]`` and ``[Shard(0),
    Shard(0)]`` under Shampoo with ``epsilon=1e-10`` (3.2e-2 apart: the rank-deficient root
    amplifies one ulp); 4-bit Shampoo on a ``(2, 32, 5, 3)``, KL-Shampoo on a ``(5, 6, 24,
    32)``, Shampoo on a ``(32, 12, 12, 5)`` placed ``[_StridedShard(3, sf=2), Shard(3)]``
    (2.4e-7). Here under products that round by call, with one stack per kind at the
    least: the calls one process makes, which a rank now makes too."""
    worst = {"min_stacks": 1, "stack_elements": 1 << 62, "batch_variant": True}
    on = ("dp_shard", "tp")
    tiny = {**lc.KINDS["shampoo"], "kind": "shampoo", "lr": 0.01, "epsilon": 1e-10,
            "max_preconditioner_dim": 32, "precondition_frequency": 2,
            "start_preconditioning_step": 2}
    blocks = {"lr": 0.01, "max_preconditioner_dim": 8, "precondition_frequency": 2}
    cases = [
        ([(17,), (17,)], [(on, [("R",), ("S", 0)]), (on, [("S", 0), ("S", 0)])], tiny),
        ([(2, 32, 5, 3), (8, 8)], [(on, [("S", 1), ("S", 3)]), None],
         {**lc.KINDS["shampoo_4bit"], "kind": "shampoo_4bit", **blocks}),
        ([(5, 6, 24, 32)], [(on, [("S", 2), ("S", 3)])],
         {**lc.KINDS["kl_shampoo"], "kind": "kl_shampoo", **blocks,
          "start_preconditioning_step": 2}),
        ([(32, 12, 12, 5), (12, 5)], [(on, [("SS", 3, 2), ("S", 3)]), (on, [("S", 0), ("R",)])],
         {**lc.KINDS["shampoo"], "kind": "shampoo", **blocks, "start_preconditioning_step": 2}),
    ]
    return [{"seed": 90_040 + index, "world": 4, "kind": config["kind"], "steps": 5,
             "names": [f"p{i}" for i in range(len(shapes))], "shapes": shapes,
             "layout": {"mesh": mesh, "where": where}, "no_grad": {}, "config": config,
             "stacking": worst}
            for index, (shapes, where, config) in enumerate(cases)]


def regressions8() -> list[dict]:
    """8 ranks: FSDP2 (4) over tensor parallel (2) leaves uneven strided shards (a
    vocabulary of 17 rows: 9 and 8 per tensor-parallel rank, chunked 3, 3, 3, 0 and 2, 2,
    2, 2), which torch's own offset arithmetic places elsewhere than FSDP2 does."""
    split = {"tp": 2, "dp_replicate": 1, "dp_shard": 4, "shard_blocks": False}
    layers = [("embedding", 17, "rowwise"), ("mlp", 33, True, False), ("head", 17, True)]
    config = {**lc.KINDS["shampoo"], "kind": "shampoo", "lr": 0.01,
              "max_preconditioner_dim": 16, "precondition_frequency": 2,
              "start_preconditioning_step": 2}
    return [{"seed": 90_030, "world": 8, "kind": "shampoo", "steps": 4,
             "model": {**split, "width": 8, "layers": layers},
             "count": lc.model_param_count(layers), "resume_at": 2,
             "resume_split": {**split, "tp": 4, "dp_shard": 2}, "no_grad": {},
             "config": config, "base_seed": "regression"}]


CASES = {world: cases_for(world) for world in BUDGET}
CASES[4] += regressions()
CASES[8] += regressions8()


def spawn(world: int, cases: list[dict]) -> list[list[dict]]:
    """Every rank's results, case by case (a rank that stopped early has fewer)."""
    root = tempfile.mkdtemp(prefix=f"hf_shampoo_layouts{world}_")
    with one_thread_per_process():
        context = mp.spawn(run_world, args=(world, os.path.join(root, "init"), root, cases),
                           nprocs=world, join=False)
        until = time.monotonic() + deadline(world, cases)
        while True:
            try:
                if context.join(timeout=5):
                    break
            except Exception:  # noqa: BLE001 - a rank died: its results say how far it got
                break
            if time.monotonic() > until:
                break
        for process in context.processes:
            if process.is_alive():
                process.kill()
    out = []
    for rank in range(world):
        path = os.path.join(root, f"rank{rank}.pt")
        out.append(torch.load(path, weights_only=False) if os.path.exists(path) else [])
    return out


@pytest.fixture(scope="module")
def results():
    return {}


def world_results(results, world):
    if world not in results:
        results[world] = spawn(world, CASES[world])
    return results[world]


def case_type(case: dict) -> str:
    return "model" if "model" in case else "pipeline" if "pipeline" in case else "tensors"


PARAMS = [pytest.param(world, index, id=f"world{world}-{case['kind']}-"
                       f"{case_type(case)}-seed{case['base_seed']}-"
                       f"{index}")
          for world, cases in CASES.items() for index, case in enumerate(cases)]


@pytest.mark.parametrize("world,index", PARAMS)
def test_drawn_layout_is_bit_identical_to_one_process(results, world, index):
    case = CASES[world][index]
    ranks = world_results(results, world)
    seed = case["base_seed"] if case["base_seed"] != "regression" else base_seed()
    cases = os.environ.get("HF_SHAMPOO_LAYOUT_CASES", "1")
    rerun = (f"HF_SHAMPOO_LAYOUT_SEED={seed} HF_SHAMPOO_LAYOUT_FRESH=0 "
             f"HF_SHAMPOO_LAYOUT_CASES={cases} "
             f"python -m pytest tests/test_generated_layouts.py -k 'world{world}-' "
             "(this seed's cases alone); the whole run again, every case before it in the "
             f"same processes: HF_SHAMPOO_LAYOUT_SEEDS={','.join(map(str, SEEDS))} "
             f"HF_SHAMPOO_LAYOUT_CASES={cases}")
    about = f"case {index} of world {world}:\n{lc.describe(case)}\nrerun: {rerun}"
    got = [r[index] if index < len(r) else None for r in ranks]
    errors = [(rank, g["error"]) for rank, g in enumerate(got) if g is not None and "error" in g]
    assert not errors, f"{about}\nrank {errors[0][0]} raised:\n{errors[0][1]}"
    assert all(g is not None for g in got), (
        f"{about}\nranks {[r for r, g in enumerate(got) if g is None]} did not finish it "
        "(an earlier case failed, or a collective timed out)")
    if any("invalid" in g for g in got):
        pytest.skip(f"{got[0].get('invalid')}")
    for rank, g in enumerate(got):
        assert not g["diffs"], f"{about}\nrank {rank}: not bit-identical: {g['diffs']}"
    stages = sorted({g.get("stage", 0) for g in got})  # pipeline cases: per stage
    for stage in stages:
        mine = [g for g in got if g.get("stage", 0) == stage]
        assert sum(g["state"] for g in mine) == mine[0]["reference_state"], (
            f"{about}\nstate per rank {[g['state'] for g in mine]} of stage {stage} does not "
            f"add up to one process's {mine[0]['reference_state']}")
