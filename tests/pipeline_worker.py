"""Pipeline-parallel ranks for tests/test_pipeline_parallel.py
(docs/parallelism.md#pipeline-parallel).

A small Llama-like model (token embedding, 4 decoder layers of RMSNorm, causal attention and
a SwiGLU MLP, a final norm and an output head) is split at layer boundaries as torchtitan
splits it: every rank builds the whole model from one seed and deletes what its stage does
not hold, so parameters keep their names. Stages run under ``torch.distributed.pipelining``
(``PipelineStage`` and ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B``)
on gloo, each data-parallel inside (DDP, or FSDP2, or FSDP2 over tensor parallel, from one
``init_device_mesh`` of ``("pp", "dp_shard", "tp")``), with one ``DistributedShampoo`` per
model part (or one over both parts of a rank).

What each rank records (``run_world`` writes ``rank{r}.json``):

- ``params``: its stage's parameters (full tensors, by name) after every step;
- ``replay``: whether they are bit-identical, after every step, to one process running
  the stage's optimizer (``distributed="none"``) on the stage's full gradients of that step
  (the optimizer's exactness whatever the forward's rounding: tensor parallel sums
  partial products in another order than one process);
- ``owned``: the state bytes of the blocks this rank owns, and of all blocks;
- ``resumed``: the parameters after the last step of a run resumed from a DCP checkpoint
  (``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` per model part, as
  torchtitan's checkpointer does) written mid-run, possibly by another layout.

The test compares the DDP and FSDP2 layouts' parameters with one process training the whole
model on the same micro-batches (``one_process``), bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hf_shampoo import DistributedShampoo
from tests.helpers import join_gloo_world

VOCAB, DIM, HIDDEN, LAYERS, HEAD_DIM, SEQ = 32, 16, 24, 4, 8, 6
MICRO = 2  # micro-batches per step (and per data-parallel replica)
ROWS = 2  # sequences per micro-batch

KINDS = {
    "shampoo": dict(grafting="adam", precondition_frequency=2, start_preconditioning_step=2,
                    max_preconditioner_dim=16),
    "soap": dict(preconditioner="eigenvalue_corrected", betas=(0.9, 0.99), epsilon=1e-8,
                 precondition_frequency=2, max_preconditioner_dim=16),
    "muon": None,  # the Muon recipe: make_optimizer(module, "muon")
}


def make(kind: str, module: nn.Module, named=None, **extra) -> DistributedShampoo:
    """``kind``'s optimizer over ``module`` (or the ``named`` parameters of several
    modules), with ``extra`` keywords (``process_group``, ``distributed``)."""
    if KINDS[kind] is None:
        from hf_shampoo import make_optimizer

        # vocab_size: a stage without the embedding table cannot guess it, and would
        # take its head for a hidden matrix (docs/parallelism.md#pipeline-parallel)
        return make_optimizer(module, "muon", lr=0.01, vocab_size=VOCAB, **extra)
    named = module.named_parameters() if named is None else named
    return DistributedShampoo(named, lr=0.01, **KINDS[kind], **extra)


class Layer(nn.Module):
    """A Llama decoder layer: RMSNorm, causal attention, RMSNorm, SwiGLU MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)
        self.ffn_norm = nn.RMSNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attention_norm(x)
        q, k, v = (w(h).view(b, t, -1, HEAD_DIM).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Model(nn.Module):
    """Embedding, layers (a ``ModuleDict``: a stage deletes the others, names stay), norm,
    output head; a part without embedding takes hidden states, without head returns them."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Layer() for i in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def whole_model() -> Model:
    torch.manual_seed(0)
    return Model()


def part(first: int, last: int) -> Model:
    """Layers ``[first, last)`` of the whole model, with the embedding on the first part
    and norm and head on the last (torchtitan's split: the rest deleted)."""
    model = whole_model()
    for i in list(model.layers):
        if not first <= int(i) < last:
            del model.layers[i]
    if first > 0:
        model.tok_embeddings = None
    if last < LAYERS:
        model.norm = None
        model.output = None
    return model


def part_like(module: Model) -> Model:
    """A plain (unplaced) model part with the layers, embedding and head ``module`` has."""
    keys = [int(i) for i in module.layers]
    return part(min(keys), max(keys) + 1)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


def batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``MICRO * ROWS`` sequences (tokens, targets) data-parallel ``replica`` trains on
    at ``step``."""
    gen = torch.Generator().manual_seed(1000 * step + replica)
    tokens = torch.randint(0, VOCAB, (MICRO * ROWS, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def one_process(kind: str, steps: int, replicas_at, reduce_each=False, first_step: int = 1,
                start=None) -> dict[str, list[float]]:
    """The reference: the whole model in one process, ``distributed="none"``; at each step
    every replica's micro-batches run forward and backward in turn (gradients accumulate),
    the replicas' sums are averaged as data parallelism averages them, and divided by the
    number of micro-batches as the schedule scales them. ``replicas_at(step)`` is the
    data-parallel size at that step. ``reduce_each``: the replicas' gradients are averaged
    after every micro-batch's backward, each replica accumulating onto that average, as DDP
    does under torch's GPipe schedule (its reducer was prepared by a forward that ran with
    gradient sync); else once, after the last (FSDP2); a callable of the step says which.
    ``start(model, optimizer)`` loads a checkpoint before ``first_step``."""
    model = whole_model()
    opt = make(kind, model, distributed="none")
    if start is not None:
        start(model, opt)
    params = dict(model.named_parameters())

    def average(grads: list[dict]) -> dict:
        out = {}
        for name in params:
            total = grads[0][name]
            for other in grads[1:]:
                total = total + other[name]
            out[name] = total / len(grads) if len(grads) > 1 else total
        return out

    for step in range(first_step, steps + 1):
        replicas = replicas_at(step)
        tokens_targets = [batch(step, r) for r in range(replicas)]
        held = [None] * replicas  # each replica's accumulated gradient
        for m in range(MICRO):
            rows = slice(m * ROWS, (m + 1) * ROWS)
            for r, (tokens, targets) in enumerate(tokens_targets):
                for name, p in params.items():
                    p.grad = None if held[r] is None else held[r][name].clone()
                loss_fn(model(tokens[rows]), targets[rows]).backward()
                held[r] = {n: p.grad.clone() for n, p in params.items()}
            each = reduce_each(step) if callable(reduce_each) else reduce_each
            if each and replicas > 1:
                held = [average(held)] * replicas
        final = held[0] if each and replicas > 1 else average(held)
        for name, p in params.items():
            p.grad = final[name].div_(MICRO)
        opt.step()
    return {n: p.detach().flatten().tolist() for n, p in params.items()}


# ------------------------------------------------------------------ one rank's run
def full(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient as one full tensor (a collective for DTensors)."""
    if hasattr(tensor, "full_tensor"):
        return tensor.full_tensor().detach().clone()
    return tensor.detach().clone()


def build(layout: dict, rank: int):
    """This rank's model parts (wrapped as the layout says), the pipeline schedule, and
    what a step needs: ``(parts, modules, schedule, stages, mesh)``; ``modules`` are the
    unwrapped parts (named parameters, DCP)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    dims, names = layout["mesh"], layout["names"]
    mesh = init_device_mesh("cpu", dims, mesh_dim_names=names)
    pp = mesh["pp"].get_local_rank()
    pp_size = dims[0]
    per_rank = 2 if layout["schedule"] == "interleaved" else 1
    num_stages = pp_size * per_rank
    span = LAYERS // num_stages
    stage_ids = [pp + k * pp_size for k in range(per_rank)]
    modules, wrapped, stages = [], [], []
    for stage_id in stage_ids:
        module = part(stage_id * span, (stage_id + 1) * span)
        modules.append(module)
        wrapped.append(place(module, layout, mesh))
    for stage_id, module in zip(stage_ids, wrapped):
        stages.append(PipelineStage(module, stage_id, num_stages, torch.device("cpu"),
                                    group=mesh["pp"].get_group()))
    schedule = layout["schedule"]
    if schedule == "interleaved":
        sched = ScheduleInterleaved1F1B(stages, n_microbatches=MICRO,
                                        loss_fn=loss_fn)
    else:
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        sched = cls(stages[0], n_microbatches=MICRO, loss_fn=loss_fn)
    return modules, wrapped, sched, stage_ids, num_stages, mesh


def place(module: Model, layout: dict, mesh):
    """DDP over the stage's dp group, or FSDP2 on its dp_shard sub-mesh (after tensor
    parallel on its tp sub-mesh)."""
    kind = layout["dp"]
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        # find_unused_parameters: DDP then never rebuilds its buckets, which it would do
        # from the order of every micro-batch's backward together (a reducer error)
        return DDP(module, process_group=mesh["dp"].get_group(), find_unused_parameters=True)
    from torch.distributed.fsdp import fully_shard

    if "tp" in layout["names"]:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        plan = {}
        for i in module.layers:
            for w in ("wq", "wk", "wv", "w1", "w3"):
                plan[f"layers.{i}.{w}"] = ColwiseParallel()
            for w in ("wo", "w2"):
                plan[f"layers.{i}.{w}"] = RowwiseParallel()
        if module.output is not None:
            plan["output"] = ColwiseParallel(output_layouts=Replicate())
        parallelize_module(module, mesh["tp"], plan)
    for layer in module.layers.values():
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(module, mesh=mesh["dp_shard"])
    return module


def optimizers(modules, layout: dict, kind: str, mesh) -> list[DistributedShampoo]:
    """One optimizer per model part, or one over both (``layout["one_optimizer"]``); DDP
    stages name their dp group, DTensor ones need none."""
    extra = {}
    if layout["dp"] == "ddp":
        extra["process_group"] = mesh["dp"]
    if layout.get("one_optimizer"):
        named = [(n, p) for m in modules for n, p in m.named_parameters()]
        return [make(kind, None, named, **extra)]
    return [make(kind, m, **extra) for m in modules]


def replica_of(layout: dict, mesh) -> int:
    dp = "dp" if layout["dp"] == "ddp" else "dp_shard"
    return mesh[dp].get_local_rank()


def train_step(step: int, sched, stage_ids, num_stages, replica: int,
               no_sync: list | None = None) -> None:
    """One schedule step on ``batch(step, replica)``; ``no_sync``: DDP parts whose
    ``no_sync()`` the whole step runs in (the stage still reduces at each part's last
    backward, where it prepares the reducer itself)."""
    tokens, targets = batch(step, replica)
    first, last = 0 in stage_ids, num_stages - 1 in stage_ids
    kwargs = {}
    if last:
        kwargs["target"] = targets
        kwargs["losses"] = []
    with contextlib.ExitStack() as stack:
        for module in no_sync or ():
            stack.enter_context(module.no_sync())
        if first:
            sched.step(tokens, **kwargs)
        else:
            sched.step(**kwargs)


def run(layout: dict, kind: str, rank: int, steps: int, save_at: int | None,
        checkpoint: str | None, resume_from: str | None, no_sync: bool = False,
        warm_up: bool = False) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    modules, wrapped, sched, stage_ids, num_stages, mesh = build(layout, rank)
    opts = optimizers(modules, layout, kind, mesh)
    replica = replica_of(layout, mesh)
    parts_of = [[m] for m in modules] if len(opts) == len(modules) else [modules]
    options = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict() -> dict:
        out = {}
        for k, module in enumerate(modules):
            out[f"model{k}"] = get_model_state_dict(module)
        for k, (opt, parts) in enumerate(zip(opts, parts_of)):
            out[f"optim{k}"] = get_optimizer_state_dict(parts if len(parts) > 1 else parts[0],
                                                        opt, options=options)
        return out

    first_step = 1
    quiet = wrapped if no_sync else None
    if resume_from is not None:
        if warm_up:  # a fresh DDP module's first iteration, gradients dropped
            train_step(save_at + 1, sched, stage_ids, num_stages, replica, quiet)
            for module in modules:
                module.zero_grad(set_to_none=True)
        state = state_dict()
        dcp.load(state, checkpoint_id=resume_from)
        for k, module in enumerate(modules):
            set_model_state_dict(module, state[f"model{k}"])
        for k, (opt, parts) in enumerate(zip(opts, parts_of)):
            set_optimizer_state_dict(parts if len(parts) > 1 else parts[0], opt,
                                     state[f"optim{k}"], options=options)
        first_step = save_at + 1
    named = [(n, p) for m in modules for n, p in m.named_parameters()]
    references = []  # (one-process optimizer, its parameters by name, the parts)
    if resume_from is None:
        for parts in parts_of:
            copies = [part_like(m) for m in parts]
            for m, copy in zip(parts, copies):
                values = {n: full(p) for n, p in m.named_parameters()}
                with torch.no_grad():
                    for n, p in copy.named_parameters():
                        p.copy_(values[n])
            named_copy = [(n, p) for c in copies for n, p in c.named_parameters()]
            ref = make(kind, copies[0], named_copy if len(copies) > 1 else None,
                       distributed="none")
            references.append((ref, named_copy, parts))
    result: dict = {"replay": [], "stage_ids": stage_ids}
    for step in range(first_step, steps + 1):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        train_step(step, sched, stage_ids, num_stages, replica, quiet)
        if os.environ.get("PP_DEBUG") and step == first_step:
            result["grads"] = {n: full(p.grad).flatten().tolist() for n, p in named}
        for ref, plain, parts in references:
            grads = {n: full(p.grad) for m in parts for n, p in m.named_parameters()}
            for n, p in plain:
                p.grad = grads[n]
            ref.step()
        for opt in opts:
            opt.step()
        if references:
            now = {n: full(p) for n, p in named}
            result["replay"].append(all(torch.equal(now[n], p.detach())
                                        for ref, plain, _ in references for n, p in plain))
        if save_at == step and checkpoint is not None:
            dcp.save(state_dict(), checkpoint_id=checkpoint)
    result["params"] = {n: full(p).flatten().tolist() for n, p in named}
    # every rank of a stage asks together (a collective over the stage's group)
    result["metrics"] = [opt.metrics() for opt in opts]
    rows = [row for opt in opts for row in opt.describe_blocks()]
    result["owned"] = [sum(r["state_bytes"] for r in rows if r["owned"]),
                       sum(r["state_bytes"] for r in rows)]
    result["groups"] = [list(opt.distributor.group.ranks) if opt.distributor.group is not None
                        else [dist.get_rank()] for opt in opts]
    result["distributors"] = [type(opt.distributor).__name__ for opt in opts]
    return result


def load_consolidated(kind: str, path: str):
    """A ``start`` for ``one_process``: the model and the optimizer state of every stage,
    from a pipeline checkpoint consolidated into one file (``consolidate_checkpoint``)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    def start(model: Model, opt) -> None:
        state = torch.load(path, weights_only=False)
        model.load_state_dict(state["model0"])
        set_optimizer_state_dict(model, opt, state["optim0"],
                                 options=StateDictOptions(flatten_optimizer_state_dict=True))

    return start


#: the layouts: mesh dims and names, data parallelism inside the stages, schedule
LAYOUTS = {
    "ddp_gpipe": dict(mesh=(2, 2), names=("pp", "dp"), dp="ddp", schedule="gpipe"),
    "fsdp_1f1b": dict(mesh=(2, 2), names=("pp", "dp_shard"), dp="fsdp", schedule="1f1b"),
    "fsdp_tp_1f1b": dict(mesh=(2, 2, 2), names=("pp", "dp_shard", "tp"), dp="fsdp",
                         schedule="1f1b"),
    "fsdp_interleaved": dict(mesh=(2, 2), names=("pp", "dp_shard"), dp="fsdp",
                             schedule="interleaved", one_optimizer=True),
    "fsdp_1f1b_dp1": dict(mesh=(2, 1), names=("pp", "dp_shard"), dp="fsdp", schedule="1f1b"),
    "ddp_gpipe_dp1": dict(mesh=(2, 1), names=("pp", "dp"), dp="ddp", schedule="gpipe"),
    "ddp_interleaved": dict(mesh=(2, 2), names=("pp", "dp"), dp="ddp",
                            schedule="interleaved"),
}


def run_world(rank: int, world: int, init_file: str, out_dir: str, cases: list[dict]) -> None:
    """Every case of this world (``{"name", "layout", "kind", "steps", "save_at",
    "checkpoint", "resume_from", "no_sync", "warm_up"}``; ``no_sync``: every schedule step
    inside the DDP parts' ``no_sync()``; ``warm_up``: one schedule step, gradients dropped,
    before a checkpoint is loaded) in turn; ``rank{r}.json`` maps names to results (or
    ``{"error": traceback}``)."""
    torch.set_num_threads(1)
    join_gloo_world(rank, world, init_file)
    results = {}
    for case in cases:
        try:
            results[case["name"]] = run(LAYOUTS[case["layout"]], case["kind"], rank,
                                        case["steps"], case.get("save_at"),
                                        case.get("checkpoint"), case.get("resume_from"),
                                        case.get("no_sync", False), case.get("warm_up", False))
        except Exception:  # recorded: the test shows it
            results[case["name"]] = {"error": traceback.format_exc()}
            break
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
