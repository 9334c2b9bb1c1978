"""DeepSpeed scenarios for tests/test_deepspeed.py, one per torchrun launch:

    python -m torch.distributed.run --standalone --nproc_per_node N \\
        tests/deepspeed_worker.py SCENARIO OUT_DIR

Every rank writes ``OUT_DIR/SCENARIO_rank{r}.pt`` (a dict the test reads). The launcher
sets ``DS_ACCELERATOR=cpu`` (DeepSpeed's CPU accelerator, gloo) and one thread per rank.
"""

from __future__ import annotations

import copy
import os
import sys
import traceback
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hf_shampoo import make_optimizer  # noqa: E402

STEPS = 6
SHAMPOO = dict(lr=1e-2, max_preconditioner_dim=32, precondition_frequency=1,
               start_preconditioning_step=1, weight_decay=0.01)
MUON = dict(lr=1e-2, weight_decay=0.01)
PRESETS = {"transformer": SHAMPOO, "muon": MUON}


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128,
                                      n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


def batches(world: int, micro: int = 4):
    """``[step][rank]`` micro-batches of token ids, the same on every rank."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (STEPS, world, micro, 16), generator=g)


def ds_config(stage: int, bf16: bool = False, grad_accum: str | None = None,
              accumulation: int = 1, fp16: bool = False) -> dict:
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accumulation,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "gradient_clipping": 0.0, "bf16": {"enabled": bf16}}
    if fp16:
        config["fp16"] = {"enabled": True}
    if grad_accum:
        config["data_types"] = {"grad_accum_dtype": grad_accum}
    return config


def engine_for(stage: int, preset: str = "transformer", model_state=None, **config):
    import deepspeed

    model = gpt2()
    if model_state is not None:
        model.load_state_dict(model_state)
    opt = make_optimizer(model, preset, **PRESETS[preset])
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt,
                                           config=ds_config(stage, **config))
    return engine, opt


def train(engine, ids, steps: range) -> list[float]:
    rank = dist.get_rank()
    losses = []
    for step in steps:
        x = ids[step, rank]
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def params_of(module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def local_state(opt) -> dict[str, int]:
    """``{"param.block.name": numel}`` of the state this rank holds."""
    with opt._own_view():
        state = opt.local_state_dict()["state"]
    return {f"{i}.{k}": t.numel() for i, entry in state.items() for k, t in entry.items()}


# ---------------------------------------------------------------------------- scenarios
def fp32(out: dict) -> None:
    """ZeRO 1 and 2 against a manual DDP reference and one process, Shampoo and Muon."""
    world = dist.get_world_size()
    ids = batches(world)
    for stage in (1, 2):
        for preset in PRESETS:
            engine, opt = engine_for(stage, preset)
            ref = gpt2()
            ref_opt = make_optimizer(ref, preset, distributed="ddp", **PRESETS[preset])
            one = copy.deepcopy(ref)
            one_opt = make_optimizer(one, preset, distributed="none", **PRESETS[preset])
            train(engine, ids, range(STEPS))
            for step in range(STEPS):
                ref_opt.zero_grad()
                x = ids[step, dist.get_rank()]
                ref(input_ids=x, labels=x).loss.backward()
                for p in ref.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
                for p, q in zip(one.parameters(), ref.parameters()):
                    p.grad = q.grad.clone()
                ref_opt.step()
                one_opt.step()
            out[f"z{stage}_{preset}"] = {
                "distributor": type(opt._distributor).__name__,
                "equal_ddp": [torch.equal(a, b.detach()) for a, b in
                              zip(engine.module.parameters(), ref.parameters())],
                "equal_one": [torch.equal(a, b.detach()) for a, b in
                              zip(engine.module.parameters(), one.parameters())],
                "state": local_state(opt),
                "state_one": local_state(one_opt),
                "step": opt._groups[0]["step"],
            }


def bf16(out: dict) -> None:
    """bf16 ZeRO 0, 1, 2 and ZeRO 1 with fp32 gradient accumulation (BF16_Optimizer)."""
    ids = batches(dist.get_world_size())
    for name, stage, grad_accum in (("z0", 0, None), ("z1", 1, None), ("z2", 2, None),
                                    ("z1_gacc32", 1, "fp32")):
        engine, opt = engine_for(stage, bf16=True, grad_accum=grad_accum)
        losses = train(engine, ids, range(STEPS))
        out[name] = {"params": params_of(engine.module), "losses": losses,
                     "step": opt._groups[0]["step"], "distributor": type(opt._distributor).__name__,
                     "wrapper": type(engine.optimizer).__name__}


def checkpoint(out: dict) -> None:
    """fp32 ZeRO 2 Shampoo: save at step 3 (DeepSpeed's engine checkpoint and hf_shampoo's
    sharded one), resume in a fresh engine, compare with the uninterrupted run."""
    from hf_shampoo.checkpoint import save_sharded

    root = out.pop("dir")
    ids = batches(dist.get_world_size())
    engine, opt = engine_for(2)
    train(engine, ids, range(3))
    engine.save_checkpoint(os.path.join(root, "ds"), tag="step3")
    save_sharded(opt, os.path.join(root, "hf"))
    if dist.get_rank() == 0:
        torch.save(engine.module.state_dict(), os.path.join(root, "model3.pt"))
    out["losses_a"] = train(engine, ids, range(3, STEPS))
    out["uninterrupted"] = params_of(engine.module)
    dist.barrier()
    engine, opt = engine_for(2)
    engine.load_checkpoint(os.path.join(root, "ds"), tag="step3")
    out["loaded_step"] = opt._groups[0]["step"]
    out["losses_b"] = train(engine, ids, range(3, STEPS))
    out["resumed"] = params_of(engine.module)
    out["distributor"] = type(opt._distributor).__name__


def resume_one(out: dict) -> None:
    """One rank resumes the 2-rank checkpoint: DeepSpeed's engine checkpoint, and
    hf_shampoo's sharded one with the model saved at step 3; the two ranks' micro-batches
    of a step are accumulated (gradient_accumulation_steps=2, a power-of-two mean)."""
    from hf_shampoo.checkpoint import load_sharded

    root = out.pop("dir")
    two = batches(2)
    ids = two.reshape(STEPS * 2, 1, 4, 16)  # step s, rank r -> micro-batch 2s + r
    try:
        engine, _ = engine_for(2, accumulation=2)
        engine.load_checkpoint(os.path.join(root, "ds"), tag="step3")
        out["ds_load"] = "loaded"
    except Exception as error:
        out["ds_load"] = f"{type(error).__name__}: {error}"
    engine, opt = engine_for(2, model_state=torch.load(os.path.join(root, "model3.pt")),
                             accumulation=2)
    load_sharded(opt, os.path.join(root, "hf"))
    out["loaded_step"] = opt._groups[0]["step"]
    out["losses_b"] = train(engine, ids, range(6, STEPS * 2))
    out["resumed"] = params_of(engine.module)


def zero3(out: dict) -> None:
    """ZeRO 3: deepspeed.initialize succeeds (the optimizer was built on the real
    parameters), the first step refuses the partitions."""
    ids = batches(dist.get_world_size())
    engine, _ = engine_for(3)
    try:
        train(engine, ids, range(1))
        out["message"] = "trained"
    except ValueError as error:
        out["message"] = str(error)


def stage_group(out: dict) -> None:
    """ZeRO 2 with an optimizer built over a group of its own (a pipeline stage's,
    ``process_group=``): refused at the first step, before anything changes."""
    import deepspeed

    ids = batches(dist.get_world_size())
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    model = gpt2()
    opt = make_optimizer(model, "transformer", **PRESETS["transformer"],
                         process_group=groups[dist.get_rank()])
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(2))
    try:
        train(engine, ids, range(1))
        out["message"] = "trained"
    except ValueError as error:
        out["message"] = str(error)


def fp16_zero0(out: dict) -> None:
    """fp16 under ZeRO 0 (``FP16_UnfusedOptimizer``), DeepSpeed's refusal of fp16 on a CPU
    lifted as a user on CPU would (its ``is_fp16_supported``): ``deepspeed.initialize``
    raises at the wrapper's construction step, before any state or parameter changes.
    fp16 under ZeRO 1, the way out, builds and steps 2 times; its parameters move as fp32
    ZeRO 1's do, up to fp16's rounding (``zero1_vs_fp32``: the relative distance of the
    two moves, 3.5e-2 measured; gradients 65,536x too small move fp32 ZeRO 1 by 0.67)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True
    ids = batches(dist.get_world_size())
    model = gpt2()
    before = [p.detach().half() for p in model.parameters()]
    opt = make_optimizer(model, "transformer", **PRESETS["transformer"])
    try:
        deepspeed.initialize(model=model, optimizer=opt, config=ds_config(0, fp16=True))
        out["message"] = "initialized"
    except ValueError as error:
        out["message"] = str(error)
    out["unchanged"] = all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    out["state"] = sum(len(s) for s in opt.state.values())
    out["step"] = opt._groups[0]["step"]
    moved = {}
    for name, fp16 in (("fp16", True), ("fp32", False)):
        engine, opt = engine_for(1, fp16=fp16)
        start = [p.detach().float().clone() for p in engine.module.parameters()]
        train(engine, ids, range(2))
        moved[name] = torch.cat([(p.detach().float() - s).flatten()
                                 for p, s in zip(engine.module.parameters(), start)])
        out[f"zero1_{name}"] = (type(engine.optimizer).__name__, opt._groups[0]["step"])
    out["zero1_vs_fp32"] = ((moved["fp16"] - moved["fp32"]).norm()
                            / moved["fp32"].norm()).item()


SCENARIOS = {"fp32": fp32, "bf16": bf16, "checkpoint": checkpoint, "resume_one": resume_one,
             "zero3": zero3, "stage_group": stage_group, "fp16_zero0": fp16_zero0}


def main() -> None:
    import deepspeed

    name, out_dir = sys.argv[1], sys.argv[2]
    deepspeed.init_distributed(dist_backend="gloo")
    out: dict = {"dir": out_dir}
    try:
        SCENARIOS[name](out)
    except Exception:
        out["error"] = traceback.format_exc()
    out.pop("dir", None)
    torch.save(out, os.path.join(out_dir, f"{name}_rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/helpers.py's leave_gloo_world: no abort in gloo's exit


if __name__ == "__main__":
    main()
