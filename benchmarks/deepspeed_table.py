"""hf_shampoo under DeepSpeed ZeRO 0-3: which distributor each optimizer gets, whether it
trains, and whether it ends where ZeRO 0 ends (docs/benchmarks/deepspeed.md).

Cells: ZeRO stage x {fp32, bf16, bf16 with ``data_types.grad_accum_dtype=fp32`` at ZeRO 1}
x {Shampoo, Muon, SOAP} x {Trainer ``deepspeed=``, Accelerate's DeepSpeed plugin}, each on
2 gloo ranks (torchrun, ``DS_ACCELERATOR=cpu``), a GPT-2 of 2 layers, 64 wide, no dropout,
no gradient clipping. Each (path, stage, dtype) is one torchrun run of this file with
``--worker``; the parent compares every run's final model parameters with the ZeRO 0 run
of the same path and dtype (``torch.equal``, else the largest absolute difference) and
prints a markdown table.

    python -m benchmarks.deepspeed_table                      # every cell, ~10 min on 2 cores
    python -m benchmarks.deepspeed_table --paths trainer --stages 0 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIMS = {  # name: (Trainer optim, optim_args / make_optimizer keywords)
    "shampoo": ("distributed_shampoo", "start_preconditioning_step=1,precondition_frequency=1"),
    "muon": ("distributed_muon", ""),
    "soap": ("distributed_shampoo", "preconditioner=eigenvalue_corrected,"
             "start_preconditioning_step=1,precondition_frequency=1"),
}
DTYPES = {"fp32": (False, None), "bf16": (True, None), "bf16+gacc32": (True, "fp32")}


# ------------------------------------------------------------------------- worker side
def _worker(path: str, stage: int, dtype: str, steps: int, out: str) -> None:
    import gc
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import hf_shampoo
    from hf_shampoo.optimizer import DistributedShampoo

    bf16, grad_accum = DTYPES[dtype]
    rank = int(os.environ.get("RANK", 0))
    seen: dict = {}
    init = DistributedShampoo.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen["optimizer"] = self

    DistributedShampoo.__init__ = recording_init

    def model():
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))

    ids = torch.randint(0, 128, (64, 16), generator=torch.Generator().manual_seed(1))

    def ds_config():
        config = {"zero_optimization": {"stage": stage}, "gradient_clipping": 0.0,
                  "bf16": {"enabled": bf16}, "zero_allow_untested_optimizer": True,
                  "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
        if grad_accum:
            config["data_types"] = {"grad_accum_dtype": grad_accum}
        return config

    def trainer(optim, optim_args):
        from transformers import Trainer, TrainingArguments

        config = ds_config()
        config.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto",
                      gradient_clipping="auto", bf16={"enabled": "auto"})
        args = TrainingArguments(
            output_dir=os.path.join(out, "trainer"), max_steps=steps,
            per_device_train_batch_size=4, logging_steps=1, report_to=[], save_strategy="no",
            optim=optim, optim_args=optim_args or None, learning_rate=1e-2, max_grad_norm=0.0,
            bf16=bf16, deepspeed=config, disable_tqdm=True, use_cpu=bf16,
            dataloader_num_workers=0, seed=0)
        tr = Trainer(model=model(), args=args,
                     train_dataset=[{"input_ids": x, "labels": x} for x in ids])
        tr.train()
        return [h["loss"] for h in tr.state.log_history if "loss" in h], tr.model

    def accelerate(optim, optim_args):
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin

        acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config()),
                          mixed_precision="bf16" if bf16 else "no")
        m = model()
        kw: dict = {"lr": 1e-2}
        for item in filter(None, optim_args.split(",")):
            key, value = item.split("=")
            kw[key] = int(value) if value.isdigit() else value
        opt = hf_shampoo.make_optimizer(
            m, "muon" if optim == "distributed_muon" else "transformer", **kw)
        loader = torch.utils.data.DataLoader(ids, batch_size=4)
        m, opt, loader = acc.prepare(m, opt, loader)
        losses = []
        for i, x in enumerate(loader):
            if i == steps:
                break
            loss = m(input_ids=x, labels=x).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(acc.reduce(loss.detach().float(), "mean").item())
        return losses, m.module

    def reset():
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        try:
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
        except ImportError:
            pass
        gc.collect()

    results = {}
    for name, (optim, optim_args) in OPTIMS.items():
        seen.clear()
        try:
            losses, module = (trainer if path == "trainer" else accelerate)(optim, optim_args)
            opt = seen["optimizer"]
            res = {"status": "trains", "losses": [round(x, 4) for x in losses],
                   "distributor": type(opt.distributor).__name__,
                   "step": opt.state_dict()["param_groups"][0].get("step")}
            if rank == 0:
                torch.save([p.detach().clone() for p in module.parameters()],
                           os.path.join(out, f"{name}.pt"))
        except Exception as error:  # the cell's outcome is the error
            frames = traceback.extract_tb(error.__traceback__)
            res = {"status": "error", "error": f"{type(error).__name__}: {error}",
                   "where": f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}"}
            if "optimizer" in seen and seen["optimizer"].distributor is not None:
                res["distributor"] = type(seen["optimizer"].distributor).__name__
        results[name] = res
        reset()
    if rank == 0:
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(results, f)


# ------------------------------------------------------------------------- parent side
def _run_cell(path: str, stage: int, dtype: str, steps: int, out: str, port: int) -> dict:
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(port), os.path.abspath(__file__), "--worker", path,
           str(stage), dtype, str(steps), out]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    try:
        with open(os.path.join(out, "results.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        tail = (done.stdout + done.stderr)[-3000:]
        return {name: {"status": "error", "error": f"worker failed (rc {done.returncode}): "
                       f"{tail}"} for name in OPTIMS}


def _compare(out: str, base: str, name: str) -> str:
    import torch

    a_path, b_path = os.path.join(out, f"{name}.pt"), os.path.join(base, f"{name}.pt")
    if not (os.path.exists(a_path) and os.path.exists(b_path)):
        return "-"
    if a_path == b_path:
        return "(reference)"
    a, b = torch.load(a_path), torch.load(b_path)
    if all(torch.equal(x, y) for x, y in zip(a, b)):
        return "equal"
    diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))
    return f"max abs diff {diff:.2e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", nargs="+", default=["trainer", "accelerate"])
    parser.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=None, help="where the runs keep their files")
    parser.add_argument("--json", default=None, help="also write every cell's record here")
    args = parser.parse_args()
    from hf_shampoo.optional import require

    for library in ("deepspeed", *(["transformers"] if "trainer" in args.paths else []),
                    "accelerate"):  # before any rank is launched
        require(library, "benchmarks.deepspeed_table")
    out = args.out or tempfile.mkdtemp(prefix="hf_shampoo_ds_table_")
    cells = [(p, s, d) for p in args.paths for d in args.dtypes for s in args.stages
             if d != "bf16+gacc32" or s == 1]
    # the references (ZeRO 0 of each path and dtype) first
    needed = {(p, 0, "bf16" if d.startswith("bf16") else d) for p, _, d in cells}
    runs: dict = {}
    for i, (p, s, d) in enumerate(sorted(needed) + [c for c in cells if c not in needed]):
        if (p, s, d) not in runs:
            runs[(p, s, d)] = _run_cell(p, s, d, args.steps, os.path.join(out, f"{p}_z{s}_{d}"),
                                        29500 + 7 * i % 400)
            print(f"# {p} ZeRO {s} {d}: " + ", ".join(
                f"{n} {r['status']}" for n, r in runs[(p, s, d)].items()),
                file=sys.stderr, flush=True)
    rows, messages = [], {}
    for p, s, d in cells:
        base = os.path.join(out, f"{p}_z0_{'bf16' if d.startswith('bf16') else d}")
        for name, res in runs[(p, s, d)].items():
            if res["status"] == "trains":
                outcome = "trains, losses " + " ".join(f"{x:.4f}" for x in res["losses"])
                same = _compare(os.path.join(out, f"{p}_z{s}_{d}"), base, name)
            else:
                key = res["error"]
                messages.setdefault(key, f"E{len(messages) + 1}")
                outcome = f"refused ({messages[key]}, {res.get('where', '?')})"
                same = "-"
            rows.append(f"| {p} | {s} | {d} | {name} | {res.get('distributor', '-')} | "
                        f"{outcome} | {res.get('step', '-')} | {same} |")
    print("| path | ZeRO | dtype | optimizer | distributor | outcome | group step | "
          "final params vs ZeRO 0 (same path, dtype) |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    for message, label in messages.items():
        print(f"\n{label}: `{message}`")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{p}|z{s}|{d}": r for (p, s, d), r in runs.items()}, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6])
    else:
        main()
