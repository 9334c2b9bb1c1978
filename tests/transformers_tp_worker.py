"""A tiny Llama on 4 gloo ranks, tensor parallel 2 x FSDP2 2, trained by hf_shampoo, for
tests/test_parallel_integrations.py.

Two ways to shard it, both transformers 5.x's own tensor-parallel plan:

- ``"distcfg"``: ``from_pretrained(path, distributed_config=DistributedConfig(tp_size=2,
  fsdp_size=2))``, which applies tensor parallelism and FSDP2 itself on a ``(pp, fsdp, tp)``
  mesh (colwise weights ``(_StridedShard(0, sf=2), Shard(0))``, rowwise ``(Shard(0),
  Shard(1))``, norms ``Shard(0)`` on the ``fsdp`` sub-mesh);
- ``"torch"``: a plain ``from_pretrained``, then ``apply_tensor_parallelism`` on
  ``mesh["tp"]`` with the model's resolved plan and ``fully_shard`` per decoder layer and
  on the root over ``mesh["dp_shard"]``.

Each data-parallel coordinate trains on its half of a fixed batch (the two ranks of a
tensor-parallel pair see the same rows); FSDP2 averages the halves' gradients, which is the
full batch's mean loss. ``run_world`` (the ``mp.spawn`` entry) writes what each rank ends
with; ``train_one_process`` is the reference the test compares it with.
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hf_shampoo import make_optimizer
from tests.helpers import join_gloo_world, leave_gloo_world

WORLD = 4
# float64, so that the reductions' different rounding (tensor-parallel partial sums, FSDP's
# average of the halves) stays far below the tolerance after Shampoo's inverse roots
DTYPE = torch.float64
STEPS = 3
SEQ = 16
ROWS = 8  # the full batch; each data-parallel coordinate takes ROWS // 2
# (preset, optimizer keywords); small blocks so that Shampoo's blocks cross shard edges;
# float64 factor matrices: with float32 ones the roots amplify the reductions' rounding
# (to 5e-6 absolute after 3 Trainer steps with the Trainer's epsilon 1e-12)
OPTIMIZERS = {
    "shampoo": ("transformer", dict(lr=1e-2, max_preconditioner_dim=32, precondition_frequency=1,
                                     weight_decay=0.01, factor_matrix_dtype=torch.float64)),
    "muon": ("muon", dict(lr=1e-2, weight_decay=0.01)),
}


def make_tiny(path: str) -> None:
    """The tiny Llama the test saves with ``save_pretrained`` (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, vocab_size=128,
                         max_position_embeddings=64, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 128, (ROWS, SEQ), generator=torch.Generator().manual_seed(step))


def full(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, DTensor):
        return tensor.full_tensor().detach().clone()
    return tensor.detach().clone()


def load(path: str, how: str):
    """The model sharded TP 2 x FSDP2 2, and this rank's data-parallel coordinate."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    if how == "distcfg":
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPE, distributed_config=DistributedConfig(tp_size=2, fsdp_size=2))
        return model, model._device_mesh["fsdp"].get_local_rank()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPE)
    tp_plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=2))
    apply_tensor_parallelism(model, mesh["tp"], tp_plan)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    return model, mesh["dp_shard"].get_local_rank()


def train(model, name: str, coordinate: int | None = None, **extra):
    """``STEPS`` steps on ``batch(step)`` (this coordinate's half, or all of it)."""
    preset, keywords = OPTIMIZERS[name]
    opt = make_optimizer(model, preset, **keywords, **extra)
    half = ROWS // 2
    rows = slice(None) if coordinate is None else slice(coordinate * half, (coordinate + 1) * half)
    losses = []
    for step in range(1, STEPS + 1):
        ids = batch(step)[rows]
        logits = model(input_ids=ids).logits  # transformers' loss would round to float32
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                 ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(full(loss)))
    return opt, losses


def state_numel(opt) -> int:
    return sum(t.numel() for entry in opt.local_state_dict()["state"].values()
               for t in entry.values())


def train_one_process(path: str, name: str) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPE)
    opt, losses = train(model, name, distributed="none")
    return {"params": {n: full(p) for n, p in model.named_parameters()},
            "state_numel": state_numel(opt), "losses": losses}


def run_world(rank: int, path: str, init_file: str, out_dir: str, hows: list[str]) -> None:
    join_gloo_world(rank, WORLD, init_file)
    results: dict = {}
    try:
        for how in hows:
            for name in OPTIMIZERS:
                model, coordinate = load(path, how)
                opt, losses = train(model, name, coordinate)
                results[f"{how}_{name}"] = {
                    "params": {n: full(p) for n, p in model.named_parameters()},
                    "placements": {n: str(tuple(p.placements)) for n, p in
                                   model.named_parameters() if isinstance(p, DTensor)},
                    "kind": type(opt._distributor).__name__,
                    "state_numel": state_numel(opt), "losses": losses}
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        results["error"] = traceback.format_exc()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_gloo_world()


# ---------------------------------------------------------------------------- the Trainer
TRAINER_ROWS = 32
TRAINER_STEPS = 3
# float64 factor matrices as in the loop (see OPTIMIZERS)
OPTIM_ARGS = ("max_preconditioner_dim=32,precondition_frequency=1,weight_decay=0.01,"
              "factor_matrix_dtype=float64")


def allow_parallelism_config_on_cpu() -> None:
    """The one thing that stops the Trainer here, bypassed for the test: transformers'
    Trainer gives a model loaded with ``DistributedConfig(tp_size>1)`` a
    ``ParallelismConfig(tp_size, dp_shard_size)`` (transformers/trainer.py:777-790), and
    Accelerate 1.15 refuses it for anything but a GPU-type backend
    (accelerate/parallelism_config.py:395, from accelerator.py:477: "ParallelismConfig is
    only compatible DistributedType.FSDP (version 2) or DistributedType.Multi{Device} or
    DistributedType.DEEPSPEED, but got DistributedType.MULTI_CPU"). Only that check sees a
    GPU type; everything after it (the data loader split over the data-parallel ranks only,
    the model left as loaded, the optimizer, gradient clipping) is the Trainer's own code."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    original = ParallelismConfig._validate_accelerator
    if getattr(original, "_hf_shampoo_test", False):
        return

    def validate(self, accelerator):
        state = accelerator.state
        seen = state.distributed_type
        state.distributed_type = DistributedType.MULTI_GPU
        try:
            return original(self, accelerator)
        finally:
            state.distributed_type = seen

    validate._hf_shampoo_test = True
    ParallelismConfig._validate_accelerator = validate


def trainer_data() -> list[dict]:
    ids = torch.randint(0, 128, (TRAINER_ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def run_trainer(model, optim: str, output_dir: str, batch_size: int):
    """``TRAINER_STEPS`` steps of the Trainer with ``optim`` by name; the trainer."""
    from transformers import Trainer, TrainingArguments

    import hf_shampoo  # noqa: F401 - registers optim="distributed_shampoo" / "distributed_muon"

    args = TrainingArguments(
        output_dir=output_dir, optim=optim, optim_args=OPTIM_ARGS, use_cpu=True, report_to=[],
        max_steps=TRAINER_STEPS, logging_steps=1, per_device_train_batch_size=batch_size,
        learning_rate=1e-2, disable_tqdm=True, seed=7, save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=trainer_data())
    trainer.train()
    return trainer


def trainer_result(trainer) -> dict:
    from hf_shampoo.integrations.accelerate import find_shampoo

    shampoo = find_shampoo(trainer.optimizer)
    return {"params": {n: full(p) for n, p in trainer.model.named_parameters()},
            "losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
            "kind": type(shampoo._distributor).__name__, "state_numel": state_numel(shampoo),
            "dtensors": sum(isinstance(p, DTensor) for p in trainer.model.parameters())}


def trainer_one_process(path: str, optim: str, output_dir: str) -> dict:
    """The same training in one process: one rank's batch is both data-parallel ranks'."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPE)
    return trainer_result(run_trainer(model, optim, output_dir, batch_size=4))


def trainer_main(path: str, out_dir: str, optims: list[str]) -> None:
    """Under ``torch.distributed.run --nproc_per_node 4``: each optimizer name trains a
    fresh TP 2 x FSDP2 2 model through the Trainer; every rank writes its result."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    torch.set_num_threads(1)
    allow_parallelism_config_on_cpu()
    rank = int(os.environ["RANK"])
    results: dict = {}
    try:
        for optim in optims:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=DTYPE, distributed_config=DistributedConfig(tp_size=2, fsdp_size=2))
            trainer = run_trainer(model, optim, os.path.join(out_dir, optim), batch_size=2)
            results[optim] = {**trainer_result(trainer),
                              "distributed_type": str(trainer.accelerator.distributed_type)}
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        results["error"] = traceback.format_exc()
    torch.save(results, os.path.join(out_dir, f"trainer_rank{rank}.pt"))
    if dist.is_initialized():
        leave_gloo_world()



# ---------------------------------------------------------------------------- Accelerate resume
ACC_STEPS, ACC_SAVE_AT = 4, 2


def accelerate_tp(state_dict_type: str):
    """``Accelerator(cpu=True, parallelism_config=ParallelismConfig(dp_shard_size=2,
    tp_size=2), fsdp_plugin=<FSDP2, state_dict_type>)`` made to checkpoint as FSDP2 does.

    Two test-only steps, both for the CPU: ``allow_parallelism_config_on_cpu`` (above), and
    ``as_fsdp()``, which sets the state's type to FSDP with the plugin just before
    ``save_state`` / ``load_state``, so that they take Accelerate's FSDP2 checkpoint code
    (``save_fsdp_model`` / ``save_fsdp_optimizer``: ``get_model_state_dict`` /
    ``get_optimizer_state_dict`` and DCP or rank 0's ``torch.save``). On a CPU Accelerate
    makes a multi-process state ``MULTI_CPU`` and drops the plugin (FSDP is set for GPU-type
    backends only, accelerate/state.py:986-1016), and every later ``AcceleratorState()``
    (``from_pretrained``, the ``AcceleratedOptimizer`` that ``prepare`` builds) resets the
    type to ``MULTI_CPU`` again. ``prepare`` therefore runs as ``MULTI_CPU`` with tensor
    parallelism, as under the Trainer: the model is kept as loaded (already TP x FSDP2
    sharded), the optimizer wrapped in ``AcceleratedOptimizer``.

    Without ``as_fsdp()`` (``MULTI_CPU``) ``save_state`` cannot save this model:
    ``RuntimeError: Attempted to access the data pointer on an invalid python storage.``
    (accelerate/utils/modeling.py:216, ``id_tensor_storage`` of a DTensor, from
    ``clean_state_dict_for_safetensors``), and with ``safe_serialization=False`` rank 0's
    ``torch.save`` writes its own DTensor shards only, which ``load_state`` loads on every
    rank without an error: wrong parameters (0.12 off after 2 steps)."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    allow_parallelism_config_on_cpu()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=state_dict_type,
                                            cpu_ram_efficient_loading=False)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin,
                              parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))

    def as_fsdp():
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin

    accelerator.as_fsdp = as_fsdp
    return accelerator


def _acc_prepared(accelerator, path: str, name: str):
    model, coordinate = load(path, "distcfg")
    preset, keywords = OPTIMIZERS[name]
    model, opt = accelerator.prepare(model, make_optimizer(model, preset, **keywords))
    return model, opt, coordinate


def _acc_train(accelerator, model, opt, coordinate: int, first: int, last: int) -> None:
    half = ROWS // 2
    for step in range(first, last + 1):
        ids = batch(step)[coordinate * half:(coordinate + 1) * half]
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                 ids[:, 1:].flatten())
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _acc_params(model) -> dict:
    return {n: full(p) for n, p in model.named_parameters()}


def accelerate_resume(path: str, out_dir: str, name: str, state_dict_type: str,
                      saver: str) -> dict:
    """Train ``ACC_SAVE_AT`` steps, save (``saver``: ``"accelerate"``'s own ``save_state``
    or ``"hf_shampoo"``'s, which consolidates first), train to ``ACC_STEPS``; then a fresh
    model, optimizer and Accelerator load the directory and train the same steps."""
    from hf_shampoo.integrations import accelerate as hf_accelerate

    ckpt = os.path.join(out_dir, f"acc_{name}_{state_dict_type}_{saver}")
    accelerator = accelerate_tp(state_dict_type)
    model, opt, coordinate = _acc_prepared(accelerator, path, name)
    distributed_type = str(accelerator.distributed_type)
    _acc_train(accelerator, model, opt, coordinate, 1, ACC_SAVE_AT)
    accelerator.as_fsdp()
    if saver == "hf_shampoo":
        hf_accelerate.save_state(accelerator, ckpt)
    else:
        accelerator.save_state(ckpt)
    saved = _acc_params(model)
    _acc_train(accelerator, model, opt, coordinate, ACC_SAVE_AT + 1, ACC_STEPS)
    uninterrupted = _acc_params(model)
    shampoo = hf_accelerate.find_shampoo(opt)
    kind = type(shampoo._distributor).__name__
    steps = [g["step"] for g in shampoo.param_groups]
    accelerator.free_memory()

    accelerator = accelerate_tp(state_dict_type)
    model, opt, coordinate = _acc_prepared(accelerator, path, name)
    accelerator.as_fsdp()
    accelerator.load_state(ckpt)
    loaded = _acc_params(model)
    loaded_steps = [g["step"] for g in hf_accelerate.find_shampoo(opt).param_groups]
    _acc_train(accelerator, model, opt, coordinate, ACC_SAVE_AT + 1, ACC_STEPS)
    resumed = _acc_params(model)
    return {"saved": saved, "loaded": loaded, "uninterrupted": uninterrupted,
            "resumed": resumed, "steps": steps, "loaded_steps": loaded_steps, "kind": kind,
            "distributed_type": distributed_type, "files": sorted(os.listdir(ckpt))}


def accelerate_main(path: str, out_dir: str, cases: list[str]) -> None:
    """Under ``torch.distributed.run --nproc_per_node 4``: each ``name:state_dict_type:saver``
    case as ``accelerate_resume``; every rank writes its results (a case's failure is
    recorded as its traceback, and the next case runs)."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    results: dict = {}
    for case in cases:
        try:
            results[case] = accelerate_resume(path, out_dir, *case.split(":"))
        except BaseException:  # noqa: BLE001 - DCP raises BaseException subclasses
            results[case] = {"error": traceback.format_exc()}
    torch.save(results, os.path.join(out_dir, f"accelerate_rank{rank}.pt"))
    if dist.is_initialized():
        leave_gloo_world()

if __name__ == "__main__":
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if sys.argv[1] == "accelerate":
        accelerate_main(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        trainer_main(sys.argv[1], sys.argv[2], sys.argv[3:])
