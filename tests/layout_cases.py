"""Generated cases for the layout tests (tests/test_generated_layouts.py and
tests/test_generated_dp_layouts.py): seeded, reproducible draws of optimizer settings, parameter
shapes, steps without gradients, and (for the DTensor tests) meshes and placements.

Everything here is pure Python over ``random.Random(seed)``: a case is a plain dict that prints
as the code that rebuilds it, so that a failure names its seed and its case. No process group
is needed to draw; the workers build the meshes and tensors from the dicts.

Seeds: ``HF_SHAMPOO_LAYOUT_SEED`` (default 0) is the fixed base seed CI always runs; each test
also draws ``HF_SHAMPOO_LAYOUT_FRESH`` (default 1) fresh seeds from the clock, printed with the
case on failure, so every CI run looks at new cases too. ``HF_SHAMPOO_LAYOUT_CASES`` scales the
number of cases (``make fuzz`` raises it and the number of fresh seeds).
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from hf_shampoo import stacking
from tests.batch_variant import BatchVariantProducts

#: the kinds and options that claim exactness under every distributor, with the keywords
#: each needs; ``draw_config`` adds the shared random ones (block size, cadence, decay)
KINDS: dict[str, dict[str, Any]] = {
    "shampoo": dict(grafting="adam"),
    "shampoo_rmsprop_nesterov": dict(grafting="rmsprop", momentum=0.9, nesterov=True),
    "shampoo_adagrad_beta3": dict(grafting="adagrad", beta3=0.95),
    "soap": dict(preconditioner="eigenvalue_corrected", betas=(0.9, 0.99), epsilon=1e-8),
    "soap_qr": dict(preconditioner="eigenvalue_corrected", betas=(0.9, 0.99), epsilon=1e-8,
                    eigendecomposition="qr", eigenbasis_tolerance=0.05),
    "kl_shampoo": dict(preconditioner="kl_shampoo", grafting="adam"),
    "eigendecomposed_shampoo": dict(preconditioner="eigendecomposed_shampoo", grafting="adam",
                                    epsilon=1e-6, eigenbasis_tolerance=0.1),
    "eigendecomposed_kl_qr": dict(preconditioner="eigendecomposed_kl_shampoo", grafting="adam",
                                  epsilon=1e-6, eigendecomposition="qr", qr_max_iterations=2,
                                  eigenbasis_tolerance=0.05),
    "muon": dict(preconditioner="spectral_descent", betas=(0.95, 1.0), beta3=0.9025,
                 use_bias_correction=False, spectral_lr_adjustment="match_rms_adamw",
                 vectors=dict(preconditioner="diagonal", grafting="adam")),
    "sign_descent": dict(preconditioner="sign_descent", sign_scale="l1", momentum=0.5),
    "diagonal": dict(preconditioner="diagonal", grafting="adam"),
    "diagonal_long_side": dict(grafting="adam", diagonal_aspect=2.0),
    "shampoo_4bit": dict(grafting="adam", quantization="4bit", statistics_frequency=1),
    "soap_4bit": dict(preconditioner="eigenvalue_corrected", betas=(0.9, 0.99), epsilon=1e-8,
                      eigendecomposition="qr", quantization="4bit", statistics_frequency=1,
                      refresh_schedule="staggered"),
    "gpa": dict(grafting="adam", iterate_averaging="gpa"),
    "schedule_free_soap": dict(preconditioner="eigenvalue_corrected", betas=(0.9, 0.99),
                               epsilon=1e-8, iterate_averaging="schedule_free"),
    "riemannian_lora": dict(preconditioner="riemannian_lora", grafting="adam",
                            vectors=dict(preconditioner="diagonal", grafting="adam")),
    "staggered_higher_order": dict(grafting="adam", refresh_schedule="staggered",
                                   epsilon=1e-6, root_inverse="coupled_higher_order",
                                   root_rel_epsilon=1e-3),
    "compiled": dict(grafting="adam", momentum=0.5, compile={"backend": "aot_eager"}),
    "sketchy": dict(preconditioner="sketchy", grafting="adam", sketch_rank=3,
                    sketch_threshold=4),
    "sketchy_4bit": dict(preconditioner="sketchy", grafting="adam", sketch_rank=3,
                         sketch_threshold=4, quantization="4bit", epsilon=1e-7),
    # sketches sampled every precondition_frequency steps of each block's own schedule
    "sketchy_sampled": dict(preconditioner="sketchy", grafting="adam", sketch_rank=3,
                            sketch_threshold=4, refresh_schedule="staggered"),
}
#: kinds drawn rarely (each costs seconds per rank: a compile)
RARE = {"compiled": 0.1}


def base_seed() -> int:
    return int(os.environ.get("HF_SHAMPOO_LAYOUT_SEED", "0"))


def seeds() -> list[int]:
    """The fixed base seed, then ``HF_SHAMPOO_LAYOUT_FRESH`` seeds from the clock; or
    exactly ``HF_SHAMPOO_LAYOUT_SEEDS`` (comma-separated: a whole earlier run again, its
    cases in the same processes in the same order, for a failure that needs the cases
    before it)."""
    listed = os.environ.get("HF_SHAMPOO_LAYOUT_SEEDS")
    if listed:
        return [int(seed) for seed in listed.split(",")]
    fresh = int(os.environ.get("HF_SHAMPOO_LAYOUT_FRESH", "1"))
    clock = random.Random(time.time_ns())
    return [base_seed()] + [clock.randrange(1, 2**31) for _ in range(fresh)]


def scaled(count: int) -> int:
    """``count`` cases times ``HF_SHAMPOO_LAYOUT_CASES`` / 1 (``make fuzz`` raises it)."""
    return max(1, round(count * float(os.environ.get("HF_SHAMPOO_LAYOUT_CASES", "1"))))


def draw_kind(rng: random.Random, exclude: tuple[str, ...] = ()) -> str:
    names = [k for k in KINDS if k not in exclude]
    while True:
        name = rng.choice(names)
        if rng.random() < RARE.get(name, 1.0):
            return name


def draw_config(rng: random.Random, kind: str | None = None,
                exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """One optimizer configuration: a kind with its keywords, random block size, cadence,
    start step and decay, and the steps after which ``eval()`` is called (iterate
    averaging). ``kind`` and the random keywords are in the dict (``"kind"``)."""
    kind = kind or draw_kind(rng, exclude)
    config: dict[str, Any] = dict(KINDS[kind])
    config["kind"] = kind
    config["lr"] = rng.choice([0.01, 0.03])
    config["max_preconditioner_dim"] = rng.choice([4, 8, 16, 32, 64])
    if kind not in ("muon", "sign_descent", "diagonal"):
        frequency = config["precondition_frequency"] = rng.choice([1, 2, 3])
        config["start_preconditioning_step"] = rng.choice([frequency, frequency + 1])
        if config.get("refresh_schedule") == "staggered" or kind.startswith("shampoo_4bit"):
            config.pop("start_preconditioning_step")  # staggered: its own start per block
        if kind == "sketchy_sampled":
            config["statistics_frequency"] = frequency
    if rng.random() < 0.5:
        config["weight_decay"] = rng.choice([0.01, 0.05])
        types = ["decoupled", "l2", "corrected"]
        if kind in ("muon", "riemannian_lora") or "iterate_averaging" in config:
            types = ["decoupled"]
        config["weight_decay_type"] = rng.choice(types)
    if "iterate_averaging" in config:
        config["eval_after"] = tuple(sorted(rng.sample(range(2, 7), 2)))
    draw_refresh_delay(config)
    return config


def draw_refresh_delay(config: dict[str, Any]) -> None:
    """Half the configs whose kind refreshes (without 4-bit state) get a ``refresh_delay``
    from 1 to its largest valid value, drawn from a generator seeded by the config itself so
    that the other draws of a seed stay as they were."""
    from hf_shampoo.preconditioners import KINDS as REGISTERED

    kind = REGISTERED[config.get("preconditioner", "shampoo")]
    frequency = config.get("precondition_frequency")
    if not kind.refreshes or frequency is None or config.get("quantization") == "4bit":
        return
    rng = random.Random(repr(sorted(config.items())))
    if rng.random() < 0.5:
        start = config.get("start_preconditioning_step") or frequency
        gap = frequency - start % frequency if start % frequency else frequency
        config["refresh_delay"] = rng.randint(1, gap)


def optimizer_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """The keywords for ``DistributedShampoo`` (without the generator's own entries)."""
    return {k: v for k, v in config.items() if k not in ("kind", "eval_after", "vectors")}


SIZES = [1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 24, 33, 40]


def draw_shape(rng: random.Random, max_numel: int = 1536) -> tuple[int, ...]:
    """1-D to 4-D, sizes that rarely divide a mesh, size-1 dims, conv kernels; vectors up
    to 70 long (one-column products round differently from 31 on)."""
    order = rng.choices([1, 2, 3, 4], weights=[3, 4, 1, 2])[0]
    if order == 1:
        return (rng.choice([1, 3, 7, 16, 17, 32, 33, 48, 70]),)
    if order == 4 and rng.random() < 0.7:  # a conv kernel
        return (rng.choice([4, 6, 8, 12, 16]), rng.choice([1, 3, 4, 8]), *(rng.choice([(1, 1),
                                                                                 (3, 3)])))
    while True:
        shape = tuple(rng.choice(SIZES) for _ in range(order))
        if math.prod(shape) <= max_numel:
            return shape


def draw_calls(case: dict[str, Any]) -> dict[str, Any]:
    """How a case's stacks are cut (``stacking``'s two numbers: one stack per kind, two,
    or eight, and stacks of at most 64 or 512 elements or the default) and whether its
    products round by call (``tests/batch_variant.py``), drawn from the case's own text so
    that adding this draw changed no other draw of a seed."""
    rng = random.Random("calls:" + repr(case))
    return {"min_stacks": rng.choice([1, 2, stacking.MIN_STACKS]),
            "stack_elements": rng.choice([64, 512, stacking.STACK_ELEMENTS]),
            "batch_variant": rng.random() < 0.5}


def draw_fused(case: dict[str, Any]) -> None:
    """``stacking="fused"`` (one stack per kind, the keyword) in a quarter of the cases,
    from a generator of its own so that no other draw changes."""
    if random.Random("fused:" + repr(case)).random() < 0.25:
        case["config"]["stacking"] = "fused"


@contextmanager
def drawn_calls(case: dict[str, Any]) -> Iterator[None]:
    """Run a case, its one-process reference and its resumes under its ``stacking``: the
    stacking rule it drew, and products that round by call where it drew them."""
    calls = case.get("stacking")
    if calls is None:
        yield
        return
    saved = stacking.MIN_STACKS, stacking.STACK_ELEMENTS
    stacking.MIN_STACKS, stacking.STACK_ELEMENTS = calls["min_stacks"], calls["stack_elements"]
    try:
        with BatchVariantProducts() if calls["batch_variant"] else nullcontext():
            yield
    finally:
        stacking.MIN_STACKS, stacking.STACK_ELEMENTS = saved


def draw_no_grad(rng: random.Random, count: int, steps: int) -> dict[int, tuple[int, ...]]:
    """Parameters that get no gradient at some steps (never at the first)."""
    out = {}
    for index in range(count):
        if rng.random() < 0.25:
            out[index] = tuple(sorted(rng.sample(range(2, steps + 1), rng.choice([1, 2]))))
    return out


def lora_pair(rng: random.Random, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
    """peft's names and shapes of one LoRA adapter: ``lora_A`` ``(r, in)``, ``lora_B``
    ``(out, r)``."""
    r = rng.choice([2, 3, 4])
    return [(f"{prefix}.lora_A.default.weight", (r, rng.choice([8, 12, 17]))),
            (f"{prefix}.lora_B.default.weight", (rng.choice([8, 16, 33]), r))]


def full_params(shapes, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, device="cpu") for s in shapes]


def full_grads(shapes, seed: int, step: int, no_grad: dict[int, tuple[int, ...]]
               ) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed * 1009 + step)
    grads = [torch.randn(s, generator=g, device="cpu") for s in shapes]
    return [None if step in no_grad.get(i, ()) else grad for i, grad in enumerate(grads)]


def param_groups(params, names: list[str], config: dict[str, Any]) -> list[dict]:
    """The groups for ``config``: one group of ``(name, parameter)`` pairs, or with
    ``vectors`` (the Muon recipe) matrices in one group and vectors in another."""
    named = list(zip(names, params))
    vectors = config.get("vectors")
    if vectors is None:
        return [{"params": named}]
    groups = [{"params": [(n, p) for n, p in named if p.dim() >= 2]},
              {"params": [(n, p) for n, p in named if p.dim() < 2], **vectors}]
    return [g for g in groups if g["params"]]


def describe(case: dict[str, Any]) -> str:
    """The case as text (seed, layout, settings): what a failure prints."""
    return "\n".join(f"  {k}: {v!r}" for k, v in case.items())


# ----------------------------------------------------------------- DTensor layouts
#: mesh dim names drawn from (as torch's and Accelerate's meshes name them)
DIM_NAMES = ("dp_replicate", "dp_shard", "cp", "tp")


def draw_mesh(rng: random.Random, world: int) -> dict[str, Any]:
    """A 1-D, 2-D or 3-D mesh over ``world`` ranks (size-1 dims included), maybe with two
    adjacent dims flattened into one (Accelerate's ``dp_shard_cp``)."""
    ndim = rng.choice([1, 2, 2, 3])
    sizes = [1] * ndim
    remaining = world
    while remaining > 1:  # factors of 2 to random dims
        sizes[rng.randrange(ndim)] *= 2
        remaining //= 2
    names = tuple(sorted(rng.sample(DIM_NAMES, ndim), key=DIM_NAMES.index))
    flatten = None
    if ndim >= 2 and rng.random() < 0.3:
        start = rng.randrange(ndim - 1)
        flatten = names[start:start + 2]
    return {"shape": tuple(sizes), "names": names, "flatten": flatten}


def sub_meshes(mesh: dict[str, Any]) -> list[tuple[str, ...]]:
    """The dims a parameter may live on: the whole mesh, any ordered subset of its dims,
    the flattened dim (alone or with the others)."""
    names = mesh["names"]
    out = [names]
    for size in range(1, len(names)):
        out += [tuple(names[i] for i in range(len(names)) if mask >> i & 1)
                for mask in range(1, 2 ** len(names)) if bin(mask).count("1") == size]
    if mesh["flatten"] is not None:
        flat = "_".join(mesh["flatten"])
        rest = tuple(n for n in names if n not in mesh["flatten"])
        out += [(flat,), *[(flat, n) if names.index(n) > names.index(mesh["flatten"][0])
                           else (n, flat) for n in rest]]
    return out


def dim_size(mesh: dict[str, Any], name: str) -> int:
    if name in mesh["names"]:
        return mesh["shape"][mesh["names"].index(name)]
    return math.prod(dim_size(mesh, n) for n in mesh["flatten"])


def draw_placements(rng: random.Random, mesh: dict[str, Any], dims: tuple[str, ...],
                    shape: tuple[int, ...]) -> list[tuple]:
    """Placements on the sub-mesh ``dims`` of a tensor of ``shape``: ``("R",)``, ``("S",
    d)`` (the same tensor dim may be sharded on several mesh dims), and ``("SS", d,
    split_factor)``, FSDP2's strided shard of a dim that later mesh dims shard too (the
    split factor is their product). Strided shards are drawn only where they divide the
    dim evenly: ``distribute_tensor`` and ``full_tensor`` disagree on uneven ones in torch
    (FSDP2's own uneven strided shards come from the model cases)."""
    placements: list[tuple] = [("R",) if rng.random() < 0.3 else
                               ("S", rng.randrange(len(shape))) for _ in dims]
    for i, placement in enumerate(placements):
        if placement[0] != "S" or rng.random() < 0.5:
            continue
        later = [dim_size(mesh, dims[j]) for j in range(i + 1, len(dims))
                 if placements[j] == placement]
        every = math.prod(dim_size(mesh, dims[j]) for j in range(len(dims))
                          if placements[j][1:2] == placement[1:2])
        if later and shape[placement[1]] % every == 0:
            placements[i] = ("SS", placement[1], math.prod(later))
    return placements


def draw_dtensor_case(seed: int, world: int, modules: bool = False) -> dict[str, Any]:
    """One DTensor case: a mesh, 2 to 6 parameters each a plain tensor or a DTensor on a
    drawn sub-mesh with drawn placements (or, with ``modules``, a small model placed by
    ``parallelize_module`` and ``fully_shard``), a configuration, steps without
    gradients, and for some cases a DCP save at step ``resume_at`` resumed under a second
    drawn layout of the same parameters."""
    rng = random.Random(seed)
    # peft's adapter pairs are drawn as synthetic parameters (the model has none)
    config = draw_config(rng, exclude=("riemannian_lora",) if modules else ())
    steps = rng.choice([4, 5, 6])
    case: dict[str, Any] = {"seed": seed, "world": world, "kind": config["kind"],
                            "steps": steps}
    if modules:
        case.update(draw_model(rng, world))
        shapes = None
        if rng.random() < 0.4:  # resumed under another tp x dp split of the same model
            case["resume_at"] = rng.randint(2, steps - 1)
            case["resume_split"] = draw_split(rng, world)
    elif world >= 4 and random.Random(seed * 31 + 7).random() < PIPELINE_SHARE:
        # (a separate draw: the other cases of a seed stay what they were)
        case.update(draw_pipeline(rng, world, steps, config["kind"]))
        case["config"] = config
        case["stacking"] = draw_calls(case)
        draw_fused(case)
        return case
    else:
        shapes = [draw_shape(rng) for _ in range(rng.randint(2, 5))]
        names = [f"p{i}" for i in range(len(shapes))]
        if config["kind"] == "riemannian_lora":
            for name, shape in lora_pair(rng, "block"):
                names.append(name)
                shapes.append(shape)
        extra = random.Random(f"companions:{seed}")  # (a separate draw, as above)
        several = draw_companions(extra, shapes, names)
        case["names"], case["shapes"] = names, shapes
        case["layout"] = draw_layout(rng, world, shapes)
        if several is not None:
            shard_several_dims(extra, case["layout"], several, shapes[several])
        if rng.random() < 0.4:
            case["resume_at"] = rng.randint(2, steps - 1)
            case["resume_layout"] = draw_layout(rng, world, shapes)
    count = len(case["shapes"]) if shapes is not None else case["count"]
    case["no_grad"] = draw_no_grad(rng, count, steps)
    case["config"] = config
    case["stacking"] = draw_calls(case)
    draw_fused(case)
    return case


def draw_companions(rng: random.Random, shapes: list, names: list) -> int | None:
    """Parameters whose stacks once differed between layouts (tests/batch_variant.py): in
    half the cases one more of a drawn parameter's shape, which draws its own placement, and
    in half a 3-D or 4-D one, whose index is returned for ``shard_several_dims``."""
    if rng.random() < 0.5:
        shapes.append(rng.choice(shapes))
        names.append(f"p{len(names)}")
    if rng.random() >= 0.5:
        return None
    order = rng.choice([3, 4])
    while True:
        shape = tuple(rng.choice([2, 3, 4, 5, 6, 8, 12]) for _ in range(order))
        if math.prod(shape) <= 1536:
            break
    shapes.append(shape)
    names.append(f"p{len(names)}")
    return len(shapes) - 1


def shard_several_dims(rng: random.Random, layout: dict[str, Any], index: int,
                       shape: tuple[int, ...]) -> None:
    """Place parameter ``index`` on a sub-mesh of two or more dims, each sharding another of
    its dims (where the mesh has such a sub-mesh; else as drawn)."""
    options = [dims for dims in sub_meshes(layout["mesh"]) if len(dims) >= 2]
    if not options:
        return
    dims = rng.choice(options)
    tensor_dims = rng.sample(range(len(shape)), min(len(dims), len(shape)))
    placements = [("S", d) for d in tensor_dims] + [("R",)] * (len(dims) - len(tensor_dims))
    layout["where"][index] = (dims, placements)


def draw_layout(rng: random.Random, world: int, shapes) -> dict[str, Any]:
    mesh = draw_mesh(rng, world)
    return {"mesh": mesh, "where": draw_where(rng, mesh, shapes)}


def draw_where(rng: random.Random, mesh: dict[str, Any], shapes,
               first_placed: bool = False) -> list:
    """Each tensor plain (None) or on a drawn sub-mesh with drawn placements; with
    ``first_placed`` the first one a DTensor (a pipeline stage's mesh is found from its
    DTensors)."""
    options = sub_meshes(mesh)
    where = []
    for shape in shapes:
        if rng.random() < 0.15 and not (first_placed and not where):
            where.append(None)  # a plain tensor beside the DTensors
            continue
        dims = rng.choice(options)
        where.append((dims, draw_placements(rng, mesh, dims, shape)))
    return where


#: the share of synthetic cases of 4 and 8 ranks drawn as pipeline stages
PIPELINE_SHARE = 0.3


def draw_pipeline(rng: random.Random, world: int, steps: int, kind: str) -> dict[str, Any]:
    """Two pipeline stages on a ``("pp", ...)`` mesh: the inner mesh drawn over half the
    ranks, each stage its own parameters (names ``s{stage}.p{i}``, shapes, placements on
    inner sub-meshes, steps without gradients), one optimizer per stage without a group
    (the ``"pp"`` dim marks the stages); for some, a DCP save at ``resume_at`` resumed
    under a second drawn inner mesh."""
    def with_pp(inner: dict[str, Any]) -> dict[str, Any]:
        return {"shape": (2, *inner["shape"]), "names": ("pp", *inner["names"]),
                "flatten": inner["flatten"]}

    inner = draw_mesh(rng, world // 2)
    resume_inner = draw_mesh(rng, world // 2) if rng.random() < 0.4 else None
    stages = []
    for stage in range(2):
        shapes = [draw_shape(rng) for _ in range(rng.randint(1, 4))]
        names = [f"s{stage}.p{i}" for i in range(len(shapes))]
        if kind == "riemannian_lora":
            for name, shape in lora_pair(rng, f"s{stage}.block"):
                names.append(name)
                shapes.append(shape)
        entry = {"names": names, "shapes": shapes,
                 "where": draw_where(rng, inner, shapes, first_placed=True),
                 "no_grad": draw_no_grad(rng, len(shapes), steps)}
        if resume_inner is not None:
            entry["resume_where"] = draw_where(rng, resume_inner, shapes, first_placed=True)
        stages.append(entry)
    out: dict[str, Any] = {"pipeline": {"mesh": with_pp(inner), "stages": stages}}
    if resume_inner is not None:
        out["resume_at"] = rng.randint(2, steps - 1)
        out["pipeline"]["resume_mesh"] = with_pp(resume_inner)
    return out


def draw_model(rng: random.Random, world: int) -> dict[str, Any]:
    """A small model's description: blocks of embeddings (sharded by vocabulary or by
    features), colwise / rowwise Linear layers with or without bias, norms (maybe
    sequence parallel), a fused experts' weight (expert parallel on the ``tp`` ranks);
    ``tp`` and data-parallel sizes, ``fully_shard`` or HSDP over the data-parallel dims."""
    split = draw_split(rng, world)
    width = rng.choice([8, 12, 16])
    hidden = rng.choice([8, 16, 24, 33])
    layers = []
    if rng.random() < 0.6:
        layers.append(("embedding", rng.choice([17, 32, 40]), rng.choice(["colwise",
                                                                           "rowwise"])))
    for _ in range(rng.randint(1, 2)):
        layers.append(("mlp", hidden, rng.random() < 0.7, rng.random() < 0.5))
        if rng.random() < 0.5:
            layers.append(("norm", rng.choice(["layer", "rms"]), rng.random() < 0.5))
    if rng.random() < 0.4:
        layers.append(("experts", rng.choice([2, 4]), hidden))
    layers.append(("head", rng.choice([8, 17]), rng.random() < 0.5))
    return {"model": {**split, "width": width, "layers": layers},
            "count": model_param_count(layers)}


def draw_split(rng: random.Random, world: int) -> dict[str, Any]:
    """Tensor-parallel and data-parallel sizes of ``world`` ranks (HSDP replicas or not),
    and whether each block is ``fully_shard``ed on its own first."""
    tp = rng.choice([d for d in (1, 2, 4) if world % d == 0])
    dp = world // tp
    replicate = rng.choice([d for d in (1, 2) if dp % d == 0]) if dp > 1 else 1
    return {"tp": tp, "dp_replicate": replicate, "dp_shard": dp // replicate,
            "shard_blocks": rng.random() < 0.5}


def model_param_count(layers) -> int:
    count = 0
    for layer in layers:
        if layer[0] == "embedding" or layer[0] == "experts":
            count += 1
        elif layer[0] == "mlp":
            count += 4 if layer[2] else 2
        elif layer[0] == "norm":
            count += 2 if layer[1] == "layer" else 1
        elif layer[0] == "head":
            count += 2 if layer[2] else 1
    return count


# ---------------------------------------------------------------- data-parallel layouts
# (tests/test_generated_dp_layouts.py: DDP and DeepSpeed ZeRO 1/2's flat partitions)

#: kinds DeepSpeed ZeRO 1/2 refuses, as documented (zero.py, docs/deepspeed.md): iterate
#: averaging moves parameters in train() / eval(), outside DeepSpeed's step
ZERO_REFUSED = ("gpa", "schedule_free_soap")


def long_search() -> bool:
    """``HF_SHAMPOO_LAYOUT_CASES`` above 1 (``make fuzz``, the long search): larger worlds."""
    return float(os.environ.get("HF_SHAMPOO_LAYOUT_CASES", "1")) > 1


def dp_worlds() -> tuple[int, ...]:
    """The world sizes the data-parallel cases draw from: 2 and 4, and 8 in the long search."""
    return (2, 4, 8) if long_search() else (2, 4)


def trainers_size(trainers: int, world: int) -> int:
    """The ranks in one trainers-group for ``num_trainers_per_group=trainers``."""
    return world if trainers == -1 else trainers


def trainers_choices(world: int) -> list[int]:
    """``num_trainers_per_group`` values valid for ``world``: -1, 1, 2 and ``world``."""
    return sorted({t for t in (-1, 1, 2, world) if world % trainers_size(t, world) == 0})


def draw_params(rng: random.Random, config: dict[str, Any], low: int = 2, high: int = 6
                ) -> tuple[list[tuple[int, ...]], list[str]]:
    """``low``..``high`` parameters of drawn shapes with names (``riemannian_lora``: plus
    one or two peft ``lora_A`` / ``lora_B`` pairs)."""
    count = rng.randint(low, high)
    shapes = [draw_shape(rng) for _ in range(count)]
    names = [f"layers.{i}.{'weight' if len(s) > 1 else 'bias'}" for i, s in enumerate(shapes)]
    if config["kind"] == "riemannian_lora":
        for j in range(rng.choice([1, 2])):
            for name, shape in lora_pair(rng, f"layers.{j}.attn.q_proj"):
                names.append(name)
                shapes.append(shape)
    return shapes, names


def group_members(shapes, config: dict[str, Any]) -> list[list[int]]:
    """The parameter indices of each of ``param_groups``' groups (same order)."""
    if config.get("vectors") is None:
        return [list(range(len(shapes)))]
    groups = [[i for i, s in enumerate(shapes) if len(s) >= 2],
              [i for i, s in enumerate(shapes) if len(s) < 2]]
    return [g for g in groups if g]


def draw_checkpoint(rng: random.Random, world: int, trainers: int, steps: int,
                    worlds: tuple[int, ...]) -> dict[str, Any]:
    """Save after step ``at`` (``sharded``: ``save_sharded``; ``consolidated``:
    ``consolidate_state_dict(to=0)`` and rank 0's ``state_dict()``), resumed on another
    layout: the same world with another ``num_trainers_per_group``, one process, or a
    larger world (run by that world's spawn)."""
    size = trainers_size(trainers, world)
    targets: list[tuple[int, int]] = [(1, -1)]
    others = [t for t in trainers_choices(world) if trainers_size(t, world) != size]
    targets += [(world, t) for t in others]
    targets += [(w, t) for w in worlds if w > world for t in trainers_choices(w)]
    resume_world, resume_trainers = rng.choice(targets)
    return dict(at=rng.randint(1, steps - 1), how=rng.choice(["sharded", "consolidated"]),
                resume_world=resume_world, resume_trainers=resume_trainers)


def draw_ddp_case(rng: random.Random, worlds: tuple[int, ...],
                  checkpoint_rate: float = 0.35) -> dict[str, Any]:
    """One DDP case: a world, ``num_trainers_per_group``, ``distributed`` ("ddp" or "auto"
    with plain tensors), a config of any kind, parameters, steps without gradient, and
    sometimes a checkpoint resumed on another layout."""
    world = rng.choice(worlds)
    trainers = rng.choice(trainers_choices(world))
    config = draw_config(rng)
    shapes, names = draw_params(rng, config)
    steps = rng.randint(4, 7)
    case: dict[str, Any] = dict(
        world=world, trainers=trainers, distributed=rng.choice(["ddp", "auto"]),
        kind=config["kind"], config=config, shapes=shapes, names=names, steps=steps,
        no_grad=draw_no_grad(rng, len(shapes), steps), data_seed=rng.randrange(2**31),
        checkpoint=None)
    if rng.random() < checkpoint_rate:
        case["checkpoint"] = draw_checkpoint(rng, world, trainers, steps, worlds)
    case["stacking"] = draw_calls(case)
    draw_fused(case)
    return case


def draw_flat(rng: random.Random, numels: list[int], world: int) -> dict[str, Any]:
    """A ZeRO flat buffer of one group's parameters and its partition over ``world``
    ranks: ``order`` (positions in the group, as laid out), a ``gaps`` of padding before
    each, ``length`` (with trailing padding) and ``bounds`` (``world + 1`` offsets; rank
    ``r`` holds ``[bounds[r], bounds[r + 1])``). Cuts fall anywhere (inside rows and
    parameters), on parameter boundaries, at the ends or on each other (empty
    partitions); or, as DeepSpeed itself, equal partitions of the padded buffer."""
    order = list(range(len(numels)))
    if rng.random() < 0.5:
        rng.shuffle(order)
    gaps = [rng.choice([0, 0, 0, 1, 3]) for _ in order]
    starts, at = [], 0
    for position, gap in zip(order, gaps):
        at += gap
        starts.append(at)
        at += numels[position]
    ends = [s + numels[p] for s, p in zip(starts, order)]
    length = at + rng.choice([0, 0, 1, 5])
    if rng.random() < 0.2:  # DeepSpeed's own: equal parts of a buffer padded to the world
        length += -length % world
        bounds = [r * length // world for r in range(world + 1)]
    else:
        cuts: list[int] = []
        for _ in range(world - 1):
            how = rng.random()
            if how < 0.5 or not cuts and how < 0.6:
                cuts.append(rng.randint(0, length))
            elif how < 0.75:
                cuts.append(rng.choice(starts + ends))
            elif how < 0.9 and cuts:
                cuts.append(rng.choice(cuts))  # an empty partition
            else:
                cuts.append(rng.choice([0, length]))
        bounds = [0, *sorted(cuts), length]
    return dict(order=order, gaps=gaps, length=length, bounds=bounds)


def draw_zero_case(rng: random.Random, worlds: tuple[int, ...]) -> dict[str, Any]:
    """One DeepSpeed ZeRO 1/2 case without DeepSpeed: a world, a config (not the kinds
    ZeRO refuses), parameters, each group's flat buffer cut at drawn boundaries
    (``draw_flat``), and whether ``step()`` is shown one group at a time
    (``DeepSpeedZeroOptimizer``) or all groups at once (``BF16_Optimizer``). Steps
    "without gradient" give zeros: DeepSpeed's gradient partitions hold zeros there."""
    world = rng.choice(worlds)
    config = draw_config(rng, exclude=ZERO_REFUSED)
    shapes, names = draw_params(rng, config)
    steps = rng.randint(4, 7)
    numels = [math.prod(s) for s in shapes]
    flats = [draw_flat(rng, [numels[i] for i in members], world)
             for members in group_members(shapes, config)]
    case = dict(world=world, kind=config["kind"], config=config, shapes=shapes, names=names,
                steps=steps, no_grad=draw_no_grad(rng, len(shapes), steps),
                data_seed=rng.randrange(2**31), flats=flats,
                calls=rng.choice(["per_group", "all_groups"]))
    case["stacking"] = draw_calls(case)
    draw_fused(case)
    return case
