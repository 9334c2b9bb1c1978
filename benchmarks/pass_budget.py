"""The pass budget of a steady optimizer step: per kind (Shampoo, SOAP, Muon, diagonal) and
per stage of the step, the memory-bound passes over the gradients / parameters and the bytes
they move, counted from ``torch.profiler``'s operator records of one step in one process.

The parameters are the hidden matrices of a GPT-2 (``--layers``, ``--width``: ``c_attn``,
``attn.c_proj``, ``c_fc``, ``mlp.c_proj``) in float32 with fixed gradients; the step is
steady (past the first refresh, before the next). Every leaf aten operator of the step is
attributed to the stage it runs in (the step's stages, ``step.py``): ``check`` (the
non-finite gradient check) and ``apply`` (adding the directions to the parameters) read every
gradient or parameter on every rank; ``gather`` (stacking gradients) and ``directions`` (the
preconditioner's math) touch only the blocks a rank owns. Per operator: calls, the elements
it reads and writes (from its recorded input shapes; an in-place operator writes its first
input, a reduction writes nothing worth counting, any other writes the size of its largest
input, a ``cat`` / ``stack`` the sum of its inputs), in units of all gradients' elements (a
read of 1.00 is one read of every gradient), and the bytes. Views and allocations move
nothing and are left out; matrix products (``mm``, ``bmm``, ``baddbmm``, ...) are counted
apart: they are the math, not a pass.

    python -m benchmarks.pass_budget
    python -m benchmarks.pass_budget --layers 2 --width 128 --kinds muon shampoo
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.common import command_line, hardware
from hf_shampoo import DistributedShampoo, step

KINDS = {
    "shampoo": dict(preconditioner="shampoo", grafting="adam", epsilon=1e-12),
    "soap": dict(preconditioner="eigenvalue_corrected", epsilon=1e-8),
    "muon": dict(preconditioner="spectral_descent", betas=(0.95, 1.0), beta3=0.95**2,
                 use_bias_correction=False, weight_decay=0.1,
                 spectral_lr_adjustment="match_rms_adamw",
                 newton_schulz_dtype=torch.bfloat16, max_preconditioner_dim=2**31 - 1),
    "diagonal": dict(preconditioner="diagonal", epsilon=1e-8),
}
#: stages that read every gradient / parameter on every rank, and those over owned blocks
OVER = {"check": "all gradients", "apply": "all parameters", "gather": "owned blocks",
        "refresh check": "owned blocks", "directions": "owned blocks", "other": "-"}
MATH = ("mm", "bmm", "baddbmm", "baddbmm_", "addmm", "addmm_", "matmul", "addbmm", "addbmm_",
        "linalg_eigh", "_linalg_eigh")
#: operators that move no data (views, allocations)
VIEWS = ("view", "as_strided", "resolve_conj", "resolve_neg", "slice", "select", "transpose",
         "t", "mT", "permute", "expand", "unsqueeze", "squeeze", "reshape", "alias", "detach",
         "narrow", "unbind", "split", "chunk", "diagonal", "view_as", "_reshape_alias",
         "empty", "empty_like", "empty_strided", "lift_fresh", "unfold", "as_strided_")
REDUCTIONS = ("norm", "sum", "amax", "amin", "max", "min", "all", "any", "mean", "dot",
              "vdot", "aminmax")
F = 1000  # precondition_frequency and start_preconditioning_step


def hidden_shapes(layers: int, width: int) -> list[tuple[int, int]]:
    """GPT-2's hidden matrices (``Conv1D`` weights are ``(in, out)``)."""
    w = width
    return [(w, 3 * w), (w, w), (w, 4 * w), (4 * w, w)] * layers


def make(kind: str, shapes) -> tuple[DistributedShampoo, list[torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    config = dict(lr=1e-3, precondition_frequency=F, start_preconditioning_step=F,
                  distributed="none")
    config.update(KINDS[kind])
    if kind == "muon":
        config.pop("precondition_frequency"), config.pop("start_preconditioning_step")
    return DistributedShampoo(params, **config), params


def _labelled(label: str, fn):
    def wrapped(*args, **kwargs):
        with record_function(f"stage::{label}"):
            return fn(*args, **kwargs)
    return wrapped


@contextlib.contextmanager
def stages_labelled(opt: DistributedShampoo):
    """The step's stages wrapped in profiler ranges (``step``'s functions, the
    distributor's methods), restored on exit; nothing else changes."""
    distributor = type(opt.distributor)
    patches = [(step, "gather_gradients", "gather"),
               (step, "check_refreshed_factors", "refresh check"),
               (step, "compute_directions", "directions"),
               (distributor, "active_members", "check"),
               (distributor, "finish_step", "apply")]
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in patches]
    for owner, name, label in patches:
        setattr(owner, name, _labelled(label, getattr(owner, name)))
    try:
        yield
    finally:
        for owner, name, original in saved:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def _numel(shape) -> int:
    if shape and isinstance(shape[0], (list, tuple)):  # a tensor list
        return sum(_numel(s) for s in shape)
    return math.prod(shape) if shape else 0


def _itemsize(dtype: str) -> int:
    sizes = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "bool": 1,
             "long int": 8, "int": 4}
    return sizes.get(dtype, 4)


def traffic(event) -> tuple[int, int]:
    """(elements read, elements written) of one leaf operator (see the module docstring)."""
    name = event.name.split("::")[-1]
    tensors = [(s, d) for s, d in zip(event.input_shapes, event.input_dtypes)
               if isinstance(s, list) and s and d]
    sizes = [_numel(s) for s, _ in tensors]
    read = sum(sizes)
    if not sizes:
        return 0, 0
    if name.endswith("_") or name in ("copy_",):
        written = sizes[0]
    elif any(r in name for r in REDUCTIONS) or name in ("isfinite", "isnan"):
        written = 0
    elif name in ("cat", "stack"):
        written = read
    else:
        written = max(sizes)
    if name == "copy_":  # copy_(self, src): reads the source only
        read = sizes[1] if len(sizes) > 1 else sizes[0]
    return read, written


def _stage(event) -> str:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("stage::"):
            return parent.name[len("stage::"):]
        parent = parent.cpu_parent
    return "other"


def _aten_children(event) -> list:
    return [c for c in event.cpu_children if c.name.startswith("aten::")
            and c.name.split("::")[-1] not in VIEWS]


def _movers(event) -> list:
    """The operators that stand for ``event``'s traffic: itself (a matrix product always,
    a leaf, or an operator whose children move less than half of what it does: a scalar's
    conversion inside ``mul_``), else its children's (``stack`` → ``cat``, ``to`` →
    ``copy_``, ``_foreach_norm`` → ``linalg_vector_norm``)."""
    name = event.name.split("::")[-1]
    if name in VIEWS:
        return []
    children = _aten_children(event)
    if name in MATH or not children:
        return [event]
    below = [m for c in children for m in _movers(c)]
    own = sum(traffic(event))
    return below if sum(sum(traffic(m)) for m in below) >= own / 2 else [event]


def _event_itemsize(event) -> int:
    return max((_itemsize(d) for s, d in zip(event.input_shapes, event.input_dtypes)
                if isinstance(s, list) and s and d), default=4)


def budget(kind: str, shapes) -> list[dict]:
    """One profiled steady step: per (stage, operator), calls, elements moved, bytes. The
    step reads the gradients and never touches them, so whether they are the tensors the
    last step saw (``zero_grad(set_to_none=False)``) or new ones (``zero_grad()``) changes
    nothing here: they are stacked by one copy either way."""
    opt, _ = make(kind, shapes)
    opt.step()  # the state
    for group in opt.param_groups:
        group["step"] = F - 1
    opt.step()  # the first refresh (as benchmarks/ab_step_time.py)
    opt.step()  # a steady step
    with stages_labelled(opt), profile(activities=[ProfilerActivity.CPU],
                                       record_shapes=True) as prof:
        opt.step()
    rows: dict[tuple[str, str], dict] = defaultdict(lambda: dict(calls=0, read=0, written=0,
                                                                 bytes=0))
    for event in prof.events():
        parent = event.cpu_parent
        if event.name.startswith("aten::") and not (parent and parent.name.startswith("aten::")):
            for counted in _movers(event):  # the outermost operators, then down
                read, written = traffic(counted)
                row = rows[(_stage(counted), counted.name.split("::")[-1])]
                row["calls"] += 1
                row["read"] += read
                row["written"] += written
                row["bytes"] += (read + written) * _event_itemsize(counted)
    return [dict(stage=s, op=o, **v) for (s, o), v in rows.items()]


def table(kind: str, rows: list[dict], total: int) -> str:
    """A kind's budget: one row per (stage, operator) that moves at least 1% of the
    gradients' size; reads and writes in units of all gradients' elements."""
    order = list(OVER)
    lines = [f"**{kind}**\n",
             "| stage | over | operator | calls | reads (× gradients) | writes (× gradients) "
             "| MB |", "|---|---|---|---|---|---|---|"]
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    products: dict[str, int] = defaultdict(int)
    for r in sorted(rows, key=lambda r: (order.index(r["stage"]),
                                         -(r["read"] + r["written"]))):
        if r["op"] in MATH:
            products[r["op"]] += r["calls"]
            continue
        read, written = r["read"] / total, r["written"] / total
        if read + written < 0.01:
            continue
        over = totals[OVER[r["stage"]]]
        over[0] += read
        over[1] += written
        over[2] += r["bytes"] / 1e6
        lines.append(f"| {r['stage']} | {OVER[r['stage']]} | `{r['op']}` | {r['calls']} | "
                     f"{read:.2f} | {written:.2f} | {r['bytes'] / 1e6:.1f} |")
    for over, (read, written, mb) in totals.items():
        lines.append(f"| **total** | {over} | | | **{read:.2f}** | **{written:.2f}** | "
                     f"**{mb:.1f}** |")
    math_ops = ", ".join(f"`{op}` ×{n}" for op, n in sorted(products.items())) or "none"
    lines.append(f"\nMatrix products (the math, not counted above): {math_ops}.\n")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    shapes = hidden_shapes(args.layers, args.width)
    total = sum(math.prod(s) for s in shapes)
    print(f"`{command_line()}`; {hardware()}\n")
    print(f"GPT-2 hidden matrices ({args.layers} layers, width {args.width}; {len(shapes)} "
          f"matrices, {total:,} float32 elements = {total * 4 / 1e6:.1f} MB of gradients); "
          "one steady step in one process\n")
    for kind in args.kinds:
        print(table(kind, budget(kind, shapes), total), flush=True)


if __name__ == "__main__":
    main()
