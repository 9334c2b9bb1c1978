"""Accelerate's FSDP2 code path on gloo, for tests/test_sharded_integrations.py.

On a CPU Accelerate falls back to DDP when FSDP is requested (it enables FSDP for GPU
backends only), so the worker switches the Accelerator's state to FSDP with an FSDP2
plugin by hand and then uses only public calls: ``prepare`` (which shards the model and
swaps the optimizer's parameters for DTensors), ``accumulate``, ``backward``,
``clip_grad_norm_``, ``save_state`` and ``load_state``. A run saved at step 2 and resumed
must continue exactly like the run that never stopped.
"""

from __future__ import annotations

import os
import traceback

import torch

from hf_shampoo import DistributedShampoo
from hf_shampoo.integrations.accelerate import register_checkpoint_hook
from tests.helpers import join_gloo_world, leave_gloo_world

CONFIG = dict(lr=0.05, grafting="adam", precondition_frequency=2, epsilon=1e-3,
              max_preconditioner_dim=8, weight_decay=0.01)
STEPS, SAVE_AT, ACCUMULATE = 4, 2, 2


def _accelerator(state_dict_type: str, bf16: bool):
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import MixedPrecisionPolicy

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if bf16 else None
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, state_dict_type=state_dict_type, mixed_precision_policy=policy,
        cpu_ram_efficient_loading=False)

    def as_fsdp():  # Accelerate resets a CPU state to MULTI_CPU: set it before each use
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin

    as_fsdp()
    accelerator.as_fsdp = as_fsdp
    return accelerator


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def _batches(rank: int):
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(STEPS * ACCUMULATE):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        out.append((x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]))
    return out


def _train(accelerator, model, opt, batches, first: int, last: int, save_dir=None):
    for step in range(first, last + 1):
        for x, y in batches[(step - 1) * ACCUMULATE: step * ACCUMULATE]:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
        if save_dir is not None and step == SAVE_AT:
            accelerator.as_fsdp()
            accelerator.save_state(save_dir, safe_serialization=False)
            accelerator.saved_params = _full(model)


def _full(model) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def scenario(rank: int, out_dir: str, state_dict_type: str, bf16: bool) -> dict:
    batches = _batches(rank)
    save_dir = os.path.join(out_dir, f"ckpt_{state_dict_type}_{bf16}")
    accelerator = _accelerator(state_dict_type, bf16)
    model = _model()
    opt = DistributedShampoo(model.parameters(), **CONFIG)
    model, opt = accelerator.prepare(model, opt)
    register_checkpoint_hook(accelerator, opt)
    _train(accelerator, model, opt, batches, 1, STEPS, save_dir)
    saved_params = accelerator.saved_params
    uninterrupted = _full(model)
    kind = type(opt.optimizer._distributor).__name__
    dtypes = sorted({str(p.dtype) for p in model.parameters()})

    accelerator = _accelerator(state_dict_type, bf16)
    model = _model()
    opt = DistributedShampoo(model.parameters(), **CONFIG)
    model, opt = accelerator.prepare(model, opt)
    accelerator.as_fsdp()
    accelerator.load_state(save_dir)
    loaded_params = _full(model)
    inner = opt.optimizer
    loaded_steps = [g["step"] for g in inner.param_groups]
    _train(accelerator, model, opt, batches, SAVE_AT + 1, STEPS)
    return {"uninterrupted": uninterrupted, "resumed": _full(model), "kind": kind,
            "param_dtypes": dtypes, "saved": saved_params, "loaded": loaded_params,
            "loaded_steps": loaded_steps}


def run_world(rank: int, world: int, init_file: str, out_dir: str):
    join_gloo_world(rank, world, init_file)
    results: dict = {}
    try:
        for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
            results[kind] = scenario(rank, out_dir, kind, bf16=kind == "SHARDED_STATE_DICT")
    except BaseException:  # noqa: BLE001 - DCP raises BaseException subclasses
        results["error"] = traceback.format_exc()
        print(results["error"], flush=True)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_gloo_world()
