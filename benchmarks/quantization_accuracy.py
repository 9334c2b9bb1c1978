"""Where 4-bit Shampoo loses accuracy, and whether a change wins it back.

``roots``: trains the small GPT-2 with 32-bit Shampoo and, at every refresh, takes each
factor large enough to be quantised (``d² ≥ 4096``) and compares its inverse root
``I = (A + εI)^(-1/4)`` with two 4-bit representations of it, for several ε: the root
stored as a float32 diagonal and a 4-bit off-diagonal (what ``quantization="4bit"`` keeps),
and the root rebuilt from 4-bit eigenvectors (after Björck steps) and float32 eigenvalues
(what arXiv 2405.18144 keeps). Printed: the median and worst relative errors of the root
(Frobenius) and of the preconditioned gradient ``I G`` along the run.

``train``: the small GPT-2 (the ablation's task) trained by several configurations at
given peak learning rates, with a warm-up + cosine schedule or at a constant lr after the
warm-up, for several seeds; prints the validation loss of each and its difference to
32-bit Shampoo of the same kind and blocks, and the mean time of its runs.

``4-bit no warm-up, float32 storage`` is 4-bit Shampoo with its state stored and loaded
without quantisation error (``LosslessStorage``): the same sampled statistics, float32 numbers. It
separates what the sample cadence costs from what the 4-bit numbers cost.

    python -m benchmarks.quantization_accuracy roots --steps 300 --lr 1e-2
    python -m benchmarks.quantization_accuracy train --lrs 3e-3 1e-2 --seeds 0 1 2 \
        --schedules cosine constant --configs 32-bit 4-bit
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time

import torch

from benchmarks.common import hardware, table_head, table_row
from benchmarks.configs import SHAMPOO
from benchmarks.harness import train_loop, warmup_cosine
from benchmarks.tasks import language_model_parts, make_gpt2, text_tokens
from hf_shampoo import DistributedShampoo, quantization
from hf_shampoo.preconditioners.quantized import QuantizedFactors, QuantizedShampoo

# the configuration of the report: Adam grafting, ε 1e-12, f = 10, blocks of 256
BASE = dict(SHAMPOO, max_preconditioner_dim=256)
CONFIGS = {
    "32-bit": dict(BASE),
    "4-bit": dict(BASE, quantization="4bit"),
    "4-bit every 2": dict(BASE, quantization="4bit", statistics_frequency=2),
    "4-bit every 1": dict(BASE, quantization="4bit", statistics_frequency=1),
    "32-bit pinv": dict(BASE, epsilon=0.0, rank_deficient="pseudo_inverse", rank_rtol=None),
    "4-bit pinv": dict(BASE, quantization="4bit", epsilon=0.0, rank_deficient="pseudo_inverse",
                       rank_rtol=None),
    "32-bit eps1e-6": dict(BASE, epsilon=1e-6),
    "4-bit eps1e-6": dict(BASE, quantization="4bit", epsilon=1e-6),
    "32-bit eps1e-8": dict(BASE, epsilon=1e-8),
    "4-bit eps1e-8": dict(BASE, quantization="4bit", epsilon=1e-8),
    "SOAP 32-bit": dict(BASE, preconditioner="eigenvalue_corrected", epsilon=1e-8,
                        grafting=None),
    "SOAP 4-bit every 1": dict(BASE, preconditioner="eigenvalue_corrected", epsilon=1e-8,
                               grafting=None, quantization="4bit", statistics_frequency=1),
    "SOAP 4-bit default cadence": dict(BASE, preconditioner="eigenvalue_corrected",
                                       epsilon=1e-8, grafting=None, quantization="4bit"),
    # measured before the warm-up existed: statistics_warmup=0 reproduces them
    "4-bit no warm-up": dict(BASE, quantization="4bit", statistics_warmup=0),
    "4-bit no warm-up, float32 storage": dict(BASE, quantization="4bit", statistics_warmup=0),
    "32-bit blocks 128": dict(BASE, max_preconditioner_dim=128),
    "4-bit no warm-up blocks 128": dict(BASE, max_preconditioner_dim=128, quantization="4bit",
                                        statistics_warmup=0),
}
# configurations run with their 4-bit state kept in float32 (see LosslessStorage)
LOSSLESS = {"4-bit no warm-up, float32 storage"}


def reference_of(name: str) -> str:
    """The 32-bit configuration a configuration is compared with."""
    if name.startswith("SOAP"):
        return "SOAP 32-bit"
    if name.endswith("blocks 128"):
        return "32-bit blocks 128"
    return "32-bit"


class LosslessStorage(contextlib.AbstractContextManager):
    """Within it, every matrix the 4-bit state stores (eigenvectors, roots' off-diagonal
    parts) is also kept in float32 beside its codes and loaded from there: the optimizer
    runs its 4-bit algorithm (the same samples, decompositions and roots) with float32
    numbers. Keyed by the codes tensor, which lives as long as the state."""

    def __enter__(self):
        self.saved = quantization.load, quantization.store
        self.eigenvectors = QuantizedFactors.eigenvectors
        load, store = self.saved
        exact: dict[int, torch.Tensor] = {}

        def lossless_store(state, name, matrices, rows=None):
            store(state, name, matrices, rows)
            key = state[f"{name}_codes"].data_ptr()
            if rows is None:
                exact[key] = matrices.detach().clone()
                return
            if key not in exact:  # the other rows: their initial values (exact in 4 bits)
                exact[key] = load(state, name, matrices.shape[-1])
            exact[key].index_copy_(0, rows, matrices.detach())

        def lossless_load(state, name, cols):
            key = state[f"{name}_codes"].data_ptr()
            return exact[key].clone() if key in exact else load(state, name, cols)

        def eigenvectors(self, state, dim, d, rows=None, bjorck=0):
            # rows are taken after loading, so that the whole stack's key is looked up
            v = quantization.load(state, f"factor_eigenvectors_{dim}", d).mT
            return quantization.bjorck(v if rows is None else v[rows], bjorck)

        quantization.load, quantization.store = lossless_load, lossless_store
        QuantizedFactors.eigenvectors = eigenvectors
        return self

    def __exit__(self, *exc):
        quantization.load, quantization.store = self.saved
        QuantizedFactors.eigenvectors = self.eigenvectors
        return False


class Args:
    val_windows = 128
    text_batch_size = 16


def root_errors(factor: torch.Tensor, bias: float, epsilon: float, g: torch.Tensor,
                bjorck_steps: int) -> dict[str, tuple[float, float]]:
    """(root error, direction error) of the two 4-bit representations of one factor's
    inverse root, ``g`` the gradient contracted to (d, m) along that dim."""
    a = factor.double() / bias
    eig = torch.linalg.eigh(a + epsilon * torch.eye(a.shape[-1], dtype=a.dtype))
    lam = eig.eigenvalues.clamp_min(epsilon)
    vectors = eig.eigenvectors
    root = (vectors * lam.pow(-0.25)) @ vectors.T
    exact = root @ g.double()
    out = {}
    # the state entries of the root (float32 diagonal, 4-bit off-diagonal), read back as
    # the optimizer reads them
    off = root.float().clone()
    state = {"inverse_root_0_diagonal": off.diagonal().clone()}
    off.diagonal().zero_()
    quantized = quantization.quantize(off)
    state.update(inverse_root_0_codes=quantized.codes, inverse_root_0_scales=quantized.scales)
    stored = QuantizedShampoo.stored_root(state, 0, off.shape[-1]).double()
    # 4-bit eigenvectors (one per row), Björck-rectified, float32 eigenvalues
    v = quantization.dequantize(quantization.quantize(vectors.T.float().contiguous())).mT
    v = quantization.bjorck(v, bjorck_steps).double()
    rebuilt = (v * lam.float().double().pow(-0.25)) @ v.T
    for name, approx in (("stored root", stored), ("from eigenvectors", rebuilt)):
        out[name] = (float((approx - root).norm() / root.norm()),
                     float((approx @ g.double() - exact).norm() / exact.norm()))
    return out


def roots(args) -> None:
    torch.set_num_threads(args.threads)
    tokens = text_tokens(None)
    batches, loss_fn, _ = language_model_parts(Args, *tokens)
    model = make_gpt2(0, n_embd=128)
    opt = DistributedShampoo(model.parameters(), lr=args.lr, **BASE)
    errors: dict[tuple, list[tuple[float, float]]] = {}

    def compare(step: int) -> None:
        if step % BASE["precondition_frequency"] or step < args.start:
            return
        bias = 1 - BASE["betas"][1] ** step
        params = [p for group in opt.param_groups for p in group["params"]]
        rows = [row for row in opt.describe_blocks() if row["owned"]]
        for j in range(max(len(row["shape"]) for row in rows)):
            for row in rows:
                shape = row["shape"]
                param = params[row["param_index"]]
                name = f"block_{row['block']}.factor_matrix_{j}"
                if j >= len(shape) or shape[j] ** 2 < quantization.MIN_QUANTIZED_ELEMENTS \
                        or name not in opt.state[param]:
                    continue
                d = shape[j]
                grad = param.grad.reshape(row["merged_shape"])[
                    tuple(slice(o, o + n) for o, n in zip(row["offset"], shape))]
                g = grad.movedim(j, 0).reshape(d, -1)
                factor = opt.state[param][name]
                for epsilon in args.epsilons:
                    for rep, pair in root_errors(factor, bias, epsilon, g,
                                                 args.bjorck).items():
                        errors.setdefault((epsilon, rep), []).append(pair)

    train_loop(model, opt, batches(0, args.steps), loss_fn,
               warmup_cosine(args.steps, decay=False), after_step=compare)
    print(f"{hardware()}; 32-bit Shampoo on the small GPT-2, lr {args.lr} constant after "
          f"the warm-up, refreshes from step {args.start} to {args.steps}, factors with "
          f"d² ≥ {quantization.MIN_QUANTIZED_ELEMENTS}, Björck steps {args.bjorck}\n")
    print(table_head("ε", "4-bit representation", "root error median / max",
                     "I·G error median / max"))
    for (epsilon, rep), pairs in errors.items():
        r = [p[0] for p in pairs]
        dvals = [p[1] for p in pairs]
        print(table_row(f"{epsilon:g}", rep, f"{statistics.median(r):.3f} / {max(r):.3f}",
                        f"{statistics.median(dvals):.3f} / {max(dvals):.3f}"))


def train_one(name: str, lr: float, seed: int, steps: int, schedule: str) -> float:
    with LosslessStorage() if name in LOSSLESS else contextlib.nullcontext():
        return train_config(CONFIGS[name], lr, seed, steps, schedule)


def train_config(config: dict, lr: float, seed: int, steps: int, schedule: str) -> float:
    tokens = text_tokens(None)
    batches, loss_fn, evaluate = language_model_parts(Args, *tokens)
    model = make_gpt2(seed, n_embd=128)
    opt = DistributedShampoo(model.parameters(), lr=lr, **config)
    run = train_loop(model, opt, batches(seed, steps), loss_fn,
                     warmup_cosine(steps, decay=schedule == "cosine"))
    if run.diverged:
        return math.nan
    return evaluate(model)["val loss"]


def train(args) -> None:
    torch.set_num_threads(args.threads)
    print(f"{hardware()}; the small GPT-2 (2 layers, 128 wide), {args.steps} steps\n")
    results: dict[tuple, list[float]] = {}
    times: dict[tuple, list[float]] = {}
    for schedule in args.schedules:
        for lr in args.lrs:
            for name in args.configs:
                for seed in args.seeds:
                    start = time.process_time()
                    value = train_one(name, lr, seed, args.steps, schedule)
                    seconds = time.process_time() - start
                    results.setdefault((schedule, lr, name), []).append(value)
                    times.setdefault((schedule, lr, name), []).append(seconds)
                    print(f"{schedule} lr {lr:g} {name} seed {seed}: {value:.4f} "
                          f"({seconds:.0f} s)", flush=True)
    print("\n" + table_head("schedule", "lr", "configuration", "val loss",
                            "− 32-bit (same kind)", "s per run"))
    for (schedule, lr, name), values in results.items():
        reference = results.get((schedule, lr, reference_of(name)))
        mean = statistics.mean(values)
        spread = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
        delta = f"{mean - statistics.mean(reference):+.3f}" if reference else "–"
        seconds = statistics.mean(times[(schedule, lr, name)])
        print(table_row(schedule, f"{lr:g}", name, f"{mean:.3f}{spread}", delta, f"{seconds:.0f}"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("roots", help="4-bit root errors along a 32-bit run")
    r.add_argument("--steps", type=int, default=300)
    r.add_argument("--start", type=int, default=10)
    r.add_argument("--lr", type=float, default=1e-2)
    r.add_argument("--epsilons", type=float, nargs="+", default=[1e-12, 1e-8, 1e-6])
    r.add_argument("--bjorck", type=int, default=1)
    r.add_argument("--threads", type=int, default=1)
    t = sub.add_parser("train", help="validation loss of configurations")
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--lrs", type=float, nargs="+", default=[3e-3, 1e-2])
    t.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    t.add_argument("--schedules", nargs="+", default=["cosine", "constant"],
                   choices=["cosine", "constant"])
    t.add_argument("--configs", nargs="+", default=["32-bit", "4-bit"], choices=list(CONFIGS))
    t.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    (roots if args.command == "roots" else train)(args)


if __name__ == "__main__":
    main()
