"""Optimizer step times on a model's parameter shapes: hf_shampoo against Meta's
``distributed_shampoo`` (when importable) and against ``torch.optim.AdamW``.

Setting: Adam grafting (beta2 0.999, eps 1e-8), betas (0.9, 0.999), epsilon 1e-12,
max_preconditioner_dim 1024, float32, one process, fixed random gradients. To reach the
Shampoo phase without running thousands of steps, the step counter is set just before
``precondition_frequency = start_preconditioning_step = F`` (both implementations), so the
next step is the first refresh (``eigh`` of every factor); later steps are steady steps,
and setting the counter to ``2F - 1`` gives a second refresh (warm-started QR with
``eigendecomposition="qr"``). Implementations are timed in interleaved rounds, so that a
change in machine load hits all of them alike; medians are reported. The figures and
options are listed in benchmarks/README.md.

``--device cuda``: every step is timed with CUDA events recorded around it (the host
synchronised before each step so nothing earlier leaks in); the other figures synchronise
before reading the clock. Meta's implementation is never vendored: pass ``--meta-path`` (a
checkout of facebookresearch/optimizers) or put it on PYTHONPATH.

    python -m benchmarks.step_time --meta-path ../optimizers --threads 2
    python -m benchmarks.step_time --device cuda --model gpt2-medium --meta-path .meta
    python -m benchmarks.step_time --write docs/benchmarks/step_time.md   # its marked section
"""

from __future__ import annotations

import math
import os
import sys

import torch

from benchmarks.common import (
    StaleCounter,
    arguments,
    build_model,
    hardware,
    load_average,
    log,
    markers,
    median,
    table_head,
    table_row,
    timed,
    timed_once,
    trainable,
    write_section,
)
from benchmarks.harness import train_loop
from hf_shampoo import DistributedShampoo, eigenbasis, kronecker, linalg

F = 100_000  # precondition_frequency = start_preconditioning_step for the counter trick
MARK_BEGIN, MARK_END = markers("step_time")


# ----------------------------------------------------------------------------- runners
class Runner:
    """One optimizer on the shared parameters; ``step()`` returns its wall time."""

    def __init__(self, name: str, params, grads, optimizer, set_step=None) -> None:
        self.name, self.params, self.grads = name, params, grads
        self.optimizer, self._set_step = optimizer, set_step
        self.steady: list[float] = []
        self.refresh: list[float] = []
        self.second_refresh: list[float] = []

    def step(self) -> float:
        for p, g in zip(self.params, self.grads):
            p.grad = g
        return timed_once(self.optimizer.step, self.params[0].device)

    def set_step(self, t: int) -> None:
        self._set_step(t)


def ours(params, grads, name="hf_shampoo", **kw) -> Runner:
    config = dict(lr=1e-3, betas=(0.9, 0.999), epsilon=1e-12, grafting="adam",
                  grafting_beta2=0.999, grafting_epsilon=1e-8, max_preconditioner_dim=1024,
                  precondition_frequency=F, start_preconditioning_step=F, distributed="none")
    opt = DistributedShampoo(params, **{**config, **kw})

    def set_step(t: int) -> None:
        for group in opt.param_groups:
            group["step"] = t

    return Runner(name, params, grads, opt, set_step)


def meta(params, grads, packing: bool, roots: torch.dtype = torch.float32) -> Runner | None:
    try:
        import logging

        from distributed_shampoo import (
            AdamPreconditionerConfig,
            RootInvShampooPreconditionerConfig,
        )
        from distributed_shampoo import DistributedShampoo as MetaShampoo
        from distributed_shampoo.shampoo_types import STEP
    except ImportError:
        return None
    logging.getLogger("distributed_shampoo").setLevel(logging.ERROR)
    opt = MetaShampoo(
        params, lr=1e-3, betas=(0.9, 0.999), epsilon=1e-12, max_preconditioner_dim=1024,
        precondition_frequency=F, start_preconditioning_step=F,
        grafting_config=AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8),
        preconditioner_config=RootInvShampooPreconditionerConfig(
            use_symmetric_packing=packing, inv_factor_matrix_dtype=roots),
    )

    def set_step(t: int) -> None:
        for state_lists in opt._per_group_state_lists:
            state_lists[STEP].fill_(t)

    low = "" if roots == torch.float32 else f", {str(roots).removeprefix('torch.')} roots"
    return Runner(f"Meta distributed_shampoo (packing {'on' if packing else 'off'}{low})",
                  params, grads, opt, set_step)


def adamw(params, grads, **kw) -> Runner:
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, **kw)
    flavour = "fused" if kw.get("fused") else "foreach"
    return Runner(f"torch.optim.AdamW ({flavour})", params, grads, opt, lambda t: None)


# ----------------------------------------------------------------------------- figures
def factor_matrices(opt: DistributedShampoo) -> list[torch.Tensor]:
    """Every factor matrix ``F/bc2 + εI`` of the (single-process) optimizer."""
    mats = []
    params = [p for group in opt.param_groups for p in group["params"]]
    for row in opt.describe_blocks():
        if not row["owned"]:
            continue
        group = opt.param_groups[row["group"]]
        t, beta2 = group["step"], group["betas"][1]
        bc2 = 1 - beta2**t
        for name, m in opt.state[params[row["param_index"]]].items():
            if name.startswith(f"block_{row['block']}.factor_matrix_"):
                eye = torch.eye(m.shape[-1], device=m.device)
                mats.append(m / bc2 + group["epsilon"] * eye)
    return mats


def eigh_seconds(mats: list[torch.Tensor]) -> float:
    """One ``torch.linalg.eigh`` per matrix, one after the other."""
    return timed_once(lambda: [torch.linalg.eigh(m) for m in mats], mats[0].device)


def steady_flops(opt: DistributedShampoo) -> int:
    """Multiply-adds ×2 of the steady step's matmuls, as the code runs them: per block and
    preconditioned dim ``j`` (``d = d_j``, ``k = numel / d``) the factor update ``G Gᵀ``
    (``linalg.syrk``, which skips the lower-left blocks) and the mode product ``2 d² k``."""
    total = 0
    for row in opt.describe_blocks():
        if not row["owned"]:
            continue
        numel = math.prod(row["shape"])
        for j in row["preconditioned_dims"]:
            d = row["shape"][j]
            k = numel // d
            total += syrk_flops(d, k) + 2 * k * d * d
    return total


def syrk_flops(d: int, k: int) -> int:
    """Flops of ``linalg.syrk`` for a ``d × k`` operand, following its recursion."""
    if d < linalg.SYRK_MIN_DIM or k < linalg.SYRK_MIN_INNER:
        return 2 * d * d * k
    h = d // 2
    return syrk_flops(h, k) + 2 * h * (d - h) * k + syrk_flops(d - h, k)


def dense_flops(opt: DistributedShampoo) -> int:
    """``4 d² k`` per block and dim: factor update and mode product as full products."""
    total = 0
    for row in opt.describe_blocks():
        if row["owned"]:
            total += sum(4 * math.prod(row["shape"]) * row["shape"][j]
                         for j in row["preconditioned_dims"])
    return total


def square_matmul_rate(device: torch.device, size: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of one large square fp32 matmul (the machine's best case; 8192² on a GPU)."""
    size = 8192 if device.type == "cuda" else size
    a, b = (torch.randn(size, size, device=device) for _ in range(2))
    out = torch.empty(size, size, device=device)
    torch.mm(a, b, out=out)
    best = min(timed_once(lambda: torch.mm(a, b, out=out), device) for _ in range(repeats))
    return 2 * size**3 / best / 1e9


def matmul_replay_seconds(opt: DistributedShampoo, repeats: int) -> float:
    """The steady step's matmuls alone (factor updates, preconditioning) on random data of
    the same shapes, through the same kernels: the machine's matmul time for this step."""
    cases = []
    device = opt.param_groups[0]["params"][0].device
    stacks: dict[int, list[dict]] = {}  # the owned blocks of each stack (one batched call)
    for row in opt.describe_blocks():
        if row["owned"]:
            stacks.setdefault(row["stack"], []).append(row)
    for rows in stacks.values():
        group, shape = opt.param_groups[rows[0]["group"]], rows[0]["shape"]
        n = len(rows)
        grad = torch.randn(n, *shape, device=device)
        factors = [torch.zeros(n, d, d, device=device) for d in shape]
        roots = [torch.randn(n, d, d, device=device) for d in shape]
        out, scratch, unfold = (torch.empty_like(grad) for _ in range(3))
        cases.append((group, grad, factors, roots, out, scratch, unfold))

    def run() -> None:
        for _group, grad, factors, roots, out, scratch, unfold in cases:
            for j, factor in enumerate(factors):
                kronecker.update_factor(factor, grad, j, 0.999, scratch=unfold)
            kronecker.multi_mode_product(grad, roots, out=out, scratch=scratch)

    run()  # warm-up
    return median(timed(run, repeats, device))


def real_run(frequency: int, steps: int, batch: int, device: torch.device | str = "cpu",
             **kw) -> tuple[list[float], float]:
    """ResNet-50 trained on scikit-learn's digits (8×8 upsampled to 32×32, 3 channels):
    every step executed, so the factors drift as in training. Returns each optimizer
    step's seconds (forward / backward not included) and the share of factor matrices
    the refresh criterion sent to a new decomposition (after the first refresh)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).div(16).unsqueeze(1)
    images = torch.nn.functional.interpolate(images, size=32, mode="bilinear").repeat(1, 3, 1, 1)
    labels = torch.tensor(digits.target)
    images, labels = images.to(device), labels.to(device)
    torch.manual_seed(0)
    model = build_model("resnet50").to(device)
    opt = DistributedShampoo(model.parameters(), lr=1e-3, betas=(0.9, 0.999), epsilon=1e-12,
                             grafting="adam", max_preconditioner_dim=1024,
                             precondition_frequency=frequency, distributed="none", **kw)
    g = torch.Generator().manual_seed(0)
    times = []
    batches = (torch.randint(0, len(labels), (batch,), generator=g).to(device)
               for _ in range(steps))
    with StaleCounter() as counter:
        train_loop(model, opt, batches,
                   lambda model, i: torch.nn.functional.cross_entropy(model(images[i]),
                                                                      labels[i]),
                   step=lambda: times.append(timed_once(opt.step, device)))
    return times, (counter.stale / counter.checked if counter.checked else float("nan"))


# ----------------------------------------------------------------------------- main
def main() -> None:
    parser = arguments(__doc__, model="resnet50", threads=2, rounds=2)
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda or cuda:N (timed with CUDA events there)")
    parser.add_argument("--steady", type=int, default=4, help="steady steps per round")
    parser.add_argument("--meta-path", default=None, help="checkout of facebookresearch/optimizers")
    parser.add_argument("--no-meta", action="store_true")
    parser.add_argument("--qr-tolerance", type=float, nargs="*", default=[0.0],
                        help="eigenbasis_tolerance values for the QR runs")
    parser.add_argument("--soap", action="store_true",
                        help="also eigenvalue-corrected Shampoo (SOAP), eigh and QR")
    parser.add_argument("--orthogonalization", nargs="*", default=["householder"],
                        choices=["householder", "cholesky_qr"],
                        help="orthogonalisations of the QR runs (and a per-size cost table "
                             "when more than Householder is asked for)")
    parser.add_argument("--low-precision-roots", action="store_true",
                        help="also inv_factor_matrix_dtype=bfloat16 (ours and Meta's): roots "
                             "and the steady step's products in bfloat16")
    parser.add_argument("--quantization", action="store_true",
                        help="also 4-bit Shampoo (and 4-bit SOAP with --soap)")
    parser.add_argument("--only-orthogonalization", action="store_true",
                        help="only the per-size cost table of the orthogonalisations")
    parser.add_argument("--staggered", type=int, default=0, metavar="F",
                        help="also time refresh_schedule all / staggered over a period of F "
                             "steps on the model's shapes")
    parser.add_argument("--only-staggered", action="store_true",
                        help="skip the fixed-gradient comparison")
    parser.add_argument("--real-run", type=int, default=0, metavar="F",
                        help="also time real ResNet-50 training runs with precondition_frequency F")
    parser.add_argument("--batch-size", type=int, default=32, help="of the real runs")
    parser.add_argument("--only-real-run", action="store_true",
                        help="skip the fixed-gradient comparison")
    parser.add_argument("--write", default=None, help="put the tables into this markdown file")
    args = parser.parse_args()
    args.device = parse_device(parser, args.device)
    torch.set_num_threads(args.threads)
    if args.meta_path:
        sys.path.insert(0, os.path.abspath(args.meta_path))
    if args.only_orthogonalization:
        lines = orthogonalization_lines(args)
    else:
        skip = args.only_real_run or args.only_staggered
        lines = [] if skip else fixed_gradient_lines(args)
        if len(args.orthogonalization) > 1:
            lines += orthogonalization_lines(args)
    if args.staggered:
        lines += staggered_lines(args)
    if args.real_run:
        lines += real_run_lines(args)
    lines.append(load_average())
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section(args.write, text, MARK_BEGIN, MARK_END)


def parse_device(parser, name: str) -> torch.device:
    """``--device``, refused (with the valid values) before anything is built."""
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        parser.error(f"--device {name!r}: expected cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {name!r}: torch sees no CUDA device")
    return device


def params_and_grads(args) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``--model``'s parameters on ``--device`` and fixed gradients for them (drawn on the
    CPU: the same gradients on every device)."""
    torch.manual_seed(0)
    params = trainable(build_model(args.model).to(args.device))
    g = torch.Generator().manual_seed(0)
    grads = [(torch.randn(p.shape, generator=g) * 1e-2).to(args.device) for p in params]
    return params, grads


def fixed_gradient_lines(args) -> list[str]:
    """hf_shampoo (eigh, QR), Meta's implementation and AdamW on fixed gradients."""
    params, grads = params_and_grads(args)

    def qr_runners(name: str, **kw) -> list[Runner]:
        return [ours(params, grads, f"{name}, qr, τ={tolerance:g}"
                     + ("" if method == "householder" else f", {method}"),
                     eigendecomposition="qr", eigenbasis_tolerance=tolerance,
                     orthogonalization=method, **kw)
                for method in args.orthogonalization for tolerance in args.qr_tolerance]

    runners = [ours(params, grads), *qr_runners("hf_shampoo")]
    if args.low_precision_roots:
        runners.append(ours(params, grads, "hf_shampoo, bfloat16 roots",
                            inv_factor_matrix_dtype=torch.bfloat16))
    if args.quantization:
        runners.append(ours(params, grads, "hf_shampoo 4-bit", quantization="4bit"))
    if args.soap:
        soap = dict(preconditioner="eigenvalue_corrected", grafting=None, epsilon=1e-8)
        runners.append(ours(params, grads, "hf_shampoo SOAP, eigh", **soap))
        if args.quantization:
            # samples at refresh steps only, as 4-bit Shampoo's default (the optimizer
            # asks SOAP users for an explicit cadence; this times the steady step)
            runners.append(ours(params, grads, "hf_shampoo SOAP 4-bit, eigh",
                                quantization="4bit", statistics_frequency=F, **soap))
        runners += qr_runners("hf_shampoo SOAP", **soap)
    if not args.no_meta:
        metas = [meta(params, grads, True), meta(params, grads, False)]
        if args.low_precision_roots:
            metas.append(meta(params, grads, False, torch.bfloat16))
        runners += [runner for runner in metas if runner is not None]
    baselines = [adamw(params, grads, foreach=True), adamw(params, grads, fused=True)]
    for runner in runners + baselines:
        runner.step()  # allocates state (a grafting-only step)

    # interleaved rounds: refresh at t = k·F (QR runs: the second one is warm-started)
    for round_index in range(args.rounds):
        for runner in runners:
            runner.set_step((round_index + 1) * F - 1)
            elapsed = runner.step()
            (runner.refresh if round_index == 0 else runner.second_refresh).append(elapsed)
        for _ in range(args.steady):
            for runner in runners + baselines:
                runner.steady.append(runner.step())
        log(f"round {round_index + 1}/{args.rounds} done")

    main_runner = runners[0]
    mats = factor_matrices(main_runner.optimizer)
    floor_eigh = eigh_seconds(mats)
    flops = steady_flops(main_runner.optimizer)
    square = square_matmul_rate(args.device)
    replay = matmul_replay_seconds(main_runner.optimizer, 3)
    steady = median(main_runner.steady)
    meta_runners = [r for r in runners if r.name.startswith("Meta")]

    refresh = median(main_runner.refresh + main_runner.second_refresh)
    size = sum(p.numel() for p in params) / 1e6
    lines = [f"### Optimizer step, {args.model} shapes ({size:.1f}M parameters, "
             f"{len(mats)} factor matrices)", "",
             f"Hardware: {hardware()}. Medians of {args.rounds * args.steady} steady steps and "
             f"{args.rounds} refreshes per implementation, interleaved.", "",
             table_head("implementation", "steady step s", "refresh (eigh) s", "2nd refresh s")]
    for runner in runners:
        second = median(runner.second_refresh) if runner.second_refresh else float("nan")
        lines.append(table_row(runner.name, f"{median(runner.steady):.3f}",
                               f"{runner.refresh[0]:.2f}", f"{second:.2f}"))
    lines += [table_row(r.name, f"{median(r.steady):.3f}", "–", "–") for r in baselines]
    floor = floor_eigh + steady
    lines += ["", f"- refresh floor Σ eigh(factor) + steady: {floor_eigh:.2f} + {steady:.3f} "
              f"= {floor:.2f} s; hf_shampoo's eigh refresh (median of {args.rounds}) "
              f"{refresh:.2f} s = {refresh / floor:.2f}× the floor"]
    low = [r for r in runners if r.name == "hf_shampoo, bfloat16 roots"]
    for m in meta_runners:
        ref_refresh = median(m.refresh + m.second_refresh)
        if "bfloat16 roots" in m.name and low:  # like against like
            r = low[0]
            lines.append(f"- {r.name} vs {m.name}: steady "
                         f"{median(r.steady) / median(m.steady):.2f}×, eigh refresh "
                         f"{median(r.refresh + r.second_refresh) / ref_refresh:.2f}×")
            continue
        qr = "".join(f"; {r.name}: 2nd refresh {median(r.second_refresh) / ref_refresh:.2f}×"
                     for r in runners[1:]
                     if not r.name.startswith("Meta") and r.second_refresh)
        lines.append(f"- vs {m.name}: steady {steady / median(m.steady):.2f}×, "
                     f"eigh refresh {refresh / ref_refresh:.2f}×{qr}")
    dense = dense_flops(main_runner.optimizer)
    lines.append(f"- steady step: {flops / 1e9:.1f} GFLOP (matmuls as run; the dense count, "
                 f"without the symmetric saving, is {dense / 1e9:.1f}), "
                 f"{flops / steady / 1e9:.0f} GFLOP/s achieved; the same matmuls alone at the "
                 f"same shapes take {replay:.3f} s ({flops / replay / 1e9:.0f} GFLOP/s), so the "
                 f"step runs at {replay / steady:.0%} of the machine's matmul rate at these "
                 f"shapes ({flops / steady / 1e9 / square:.0%} of a 2048² matmul's "
                 f"{square:.0f} GFLOP/s)")
    for runner in baselines:
        lines.append(f"- steady step / {runner.name}: {steady / median(runner.steady):.1f}×")

    return lines


def orthogonalization_lines(args) -> list[str]:
    """Per factor size of the model, the seconds of ``eigh``, Householder QR, shifted
    Cholesky-QR3 and one matmul over every factor matrix of that size, batched as a
    refresh runs them (``linalg``'s one-matrix-per-thread pool for ``eigh`` and
    Householder; batched products for the others), ``--threads`` threads; SPD matrices of
    the factors' sizes with condition number 1e6."""
    torch.manual_seed(0)
    sizes: dict[int, int] = {}
    opt = DistributedShampoo(trainable(build_model(args.model).to(args.device)),
                             max_preconditioner_dim=1024, distributed="none")
    for row in opt.describe_blocks():
        for j in row["preconditioned_dims"]:
            sizes[row["shape"][j]] = sizes.get(row["shape"][j], 0) + 1
    methods = {
        "eigh": linalg.batched_eigh,
        "Householder QR": eigenbasis.orthonormal_basis,
        "Cholesky-QR3": eigenbasis.cholesky_qr_basis,
        "matmul": lambda a: a @ a,
    }
    lines = ["", f"#### Orthogonalisation cost per factor size, {args.model} "
             f"({sum(sizes.values())} factor matrices)", "",
             f"Hardware: {hardware()}. Medians of 3, seconds for all matrices of a size.", "",
             table_head("d", "matrices", *(f"{m} s" for m in methods))]
    totals = dict.fromkeys(methods, 0.0)
    for d in sorted(sizes, reverse=True):
        a = _with_condition(sizes[d], d, 1e6).to(args.device)
        cells = []
        for name, fn in methods.items():
            fn(a)  # warm-up
            seconds = median(timed(lambda fn=fn, a=a: fn(a), 3, args.device))
            totals[name] += seconds
            cells.append(f"{seconds:.3f}")
        lines.append(table_row(d, sizes[d], *cells))
        log(lines[-1])
    lines.append(table_row("all", sum(sizes.values()), *(f"**{t:.2f}**" for t in totals.values())))
    return lines


def _with_condition(n: int, d: int, condition: float) -> torch.Tensor:
    q = torch.linalg.qr(torch.randn(n, d, d, dtype=torch.float64))[0]
    values = torch.logspace(0, -math.log10(condition), d, dtype=torch.float64)
    return ((q * values.unsqueeze(-2)) @ q.mT).float()


def staggered_lines(args) -> list[str]:
    """Per-step times with every refresh at once against the staggered schedule."""
    f = args.staggered
    params, grads = params_and_grads(args)
    lines = ["", f"#### Refresh schedules over one period, {args.model} shapes", "",
             f"Hardware: {hardware()}. precondition_frequency = start_preconditioning_step = "
             f"{f}, fixed gradients; steps {2 * f}-{3 * f - 1} timed (every block refreshes "
             f"once in them under either schedule; eigh refreshes).", "",
             table_head("schedule", "median step s", "slowest step s", "slowest / median",
                        "mean step s", "mean / AdamW (fused)")]
    adam = adamw(params, grads, fused=True)
    adam.step()
    adam_mean = sum(adam.step() for _ in range(min(f, 20))) / min(f, 20)
    for schedule in ("all", "staggered"):
        runner = ours(params, grads, precondition_frequency=f, start_preconditioning_step=f,
                      refresh_schedule=schedule)
        times = [runner.step() for _ in range(3 * f - 1)][2 * f - 1:]
        mean = sum(times) / len(times)
        lines.append(table_row(schedule, f"{median(times):.4f}", f"{max(times):.4f}",
                         f"{max(times) / median(times):.1f}", f"{mean:.4f}",
                         f"{mean / adam_mean:.2f}×"))
        log(lines[-1])
        del runner
    lines.append(f"| torch.optim.AdamW (fused) | – | – | – | {adam_mean:.4f} | 1.00× |")
    return lines


def real_run_lines(args) -> list[str]:
    """Real ResNet-50 training runs: staggered against all-at-once, QR refresh times."""
    f = args.real_run
    steps = 3 * f + 1
    lines = ["", f"Real training run: ResNet-50 on scikit-learn digits (8×8 upsampled to "
             f"32×32), batch {args.batch_size}, precondition_frequency {f}, {steps} steps, "
             f"{args.threads} thread(s); optimizer step times only (forward / backward "
             f"excluded). Refreshes at t = {f} (eigh), {2 * f}, {3 * f} (warm-started QR in "
             f"the qr rows); with \"staggered\" each block refreshes on its own step. "
             f"Slowest / median over t ≥ {f}.", "",
             table_head("configuration", "median step s", "slowest step s", "slowest / median",
                        f"refresh t={2 * f} s", f"refresh t={3 * f} s", "refreshed share")]
    configs = [("eigh, all", {}), ("eigh, staggered", {"refresh_schedule": "staggered"})]
    configs += [(f"qr τ={t:g}, all", {"eigendecomposition": "qr", "eigenbasis_tolerance": t})
                for t in args.qr_tolerance]
    for name, kw in configs:
        times, stale = real_run(f, steps, args.batch_size, args.device, **kw)
        window = times[f - 1:]
        share = "–" if stale != stale else f"{stale:.0%}"
        lines.append(table_row(name, f"{median(window):.3f}", f"{max(window):.3f}",
                         f"{max(window) / median(window):.2f}", f"{times[2 * f - 1]:.2f}",
                         f"{times[3 * f - 1]:.2f}", share))
        log(lines[-1])
    return lines


if __name__ == "__main__":
    main()
