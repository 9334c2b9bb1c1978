"""The update rules of docs/design.md §2 that every preconditioner kind shares, as small
functions.

Each works on a stack of same-shape blocks (leading dim: the block) and the stack's state
dict, in place where it can: grafting state (line 3), the filtered gradient (line 4),
grafting a direction (line 5), weight decay folded into the direction (line 6), classic
momentum (line 7) and the ``-lr`` scaling (line 8); iterate averaging (line 9) is
``averaging.py``. The kind-specific parts (statistics, refresh, preconditioning) live in
``preconditioners/``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

GRAFTING_NORM_EPSILON = 1e-16

#: elements up to which small blocks are stacked in groups for the decay's addition; larger
#: ones are added one by one straight from the parameters' views (``add_rows``); on a GPU,
#: where a kernel launch costs more than a small copy, groups are larger
ROW_GROUP_CPU = 1 << 14
ROW_GROUP_GPU = 1 << 20


def row_groups(rows: Sequence[Tensor]):
    """``(start, stop)`` ranges of ``rows`` (one tensor per block of a stack): a large block
    alone, small ones together up to ``ROW_GROUP_CPU`` / ``ROW_GROUP_GPU`` elements."""
    limit = ROW_GROUP_CPU if rows and rows[0].device.type == "cpu" else ROW_GROUP_GPU
    start = 0
    while start < len(rows):
        stop, size = start + 1, rows[start].numel()
        while stop < len(rows) and size + rows[stop].numel() <= limit:
            size += rows[stop].numel()
            stop += 1
        yield start, stop
        start = stop


def add_rows(target: Tensor, rows: Tensor | Sequence[Tensor], alpha: float) -> None:
    """``target += alpha · stack(rows)`` (weight decay): ``rows`` a stack, or one tensor per
    row of ``target`` (views of the parameters, ``Distributor.param_rows``), added straight
    from them: the same result for every element, without a copy of the parameters."""
    if isinstance(rows, Tensor):
        target.add_(rows, alpha=alpha)
        return
    for start, stop in row_groups(rows):
        piece = rows[start].unsqueeze(0) if stop - start == 1 else torch.stack(rows[start:stop])
        target[start:stop].add_(piece, alpha=alpha)


def stacked(rows: Tensor | Sequence[Tensor] | None, dtype: torch.dtype) -> Tensor | None:
    """``rows`` (see ``add_rows``) as one stacked tensor of ``dtype``."""
    if rows is None:
        return None
    return (rows if isinstance(rows, Tensor) else torch.stack(list(rows))).to(dtype)


class Scratch:
    """Workspace tensors for one stack's step: ``scratch(name)`` has the stack's shape and
    working dtype; ``scratch.get(name, shape, dtype)`` any other shape."""

    def __init__(self, workspace, like: Tensor) -> None:
        self.workspace, self.like = workspace, like

    def __call__(self, name: str) -> Tensor:
        like = self.like
        return self.workspace.get(name, like.shape, like.dtype, like.device)

    def get(self, name: str, shape, dtype: torch.dtype) -> Tensor:
        return self.workspace.get(name, shape, dtype, self.like.device)


def state_shapes(group: dict, shape: tuple[int, ...], dtype: torch.dtype) -> dict:
    """Name → (per-block shape, dtype) of the state these update rules keep."""
    shapes = {}
    if group["grafting"] in ("adagrad", "rmsprop", "adam"):
        shapes["grafting_state"] = (shape, dtype)
    if group["betas"][0] > 0:
        shapes["filtered_grad"] = (shape, dtype)
    if group["momentum"] > 0:
        shapes["momentum"] = (shape, dtype)
    if group["iterate_averaging"] is not None:
        shapes["iterate_offset"] = (shape, dtype)  # averaging.py's D = z - y
    return shapes


def second_moment_bias(group: dict, step: int) -> float:
    """``bc2 = 1 - β2^t`` with bias correction, else 1 (docs/design.md §2)."""
    beta2 = group["betas"][1]
    return 1.0 - beta2**step if group["use_bias_correction"] and beta2 < 1 else 1.0


def update_grafting_state(state: dict, group: dict, grad: Tensor) -> None:
    """Line 3: the grafting method's second moment ``V`` from the (post-L2) gradient."""
    grafting, beta2 = group["grafting"], group["grafting_beta2"]
    if grafting == "adagrad":
        state["grafting_state"].addcmul_(grad, grad)
    elif grafting in ("rmsprop", "adam"):
        state["grafting_state"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)


def filtered_gradient(state: dict, group: dict, step: int, grad: Tensor, out: Tensor) -> Tensor:
    """Line 4: ``Ĝ`` (into ``out`` unless it is ``grad`` or ``M`` itself)."""
    beta1 = group["betas"][0]
    if beta1 == 0:
        return grad
    beta3 = group["beta3"] if group["beta3"] is not None else beta1
    m = state["filtered_grad"]
    bias = group["use_bias_correction"]
    if beta3 == beta1:
        m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        return torch.div(m, 1.0 - beta1**step, out=out) if bias else m
    filtered = torch.mul(m, beta3, out=out).add_(grad, alpha=1.0 - beta3)
    if bias:
        filtered.div_(1.0 - beta3 * beta1 ** (step - 1))
    m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    return filtered


def graft(state: dict, group: dict, step: int, x: Tensor, out: Tensor) -> Tensor:
    """Line 5's grafting direction of ``x`` into ``out`` (``x`` itself for sgd / none)."""
    grafting = group["grafting"]
    if grafting in (None, "sgd"):
        return x
    if grafting == "adam":
        torch.div(state["grafting_state"], 1.0 - group["grafting_beta2"] ** step, out=out)
    else:
        out.copy_(state["grafting_state"])
    out.sqrt_().add_(group["grafting_epsilon"])
    return torch.div(x, out, out=out)


def apply_grafting(
    state: dict, group: dict, step: int, direction: Tensor, filtered: Tensor,
    grafting_rows: list[int], out: Tensor, graft_fn=graft, norms: list | None = None,
) -> Tensor | None:
    """Line 5: per block, the scale ``‖graft(Ĝ)‖ / ‖P‖`` that gives the preconditioned
    direction the grafting method's norm (None without grafting). Rows that still graft
    (a staggered start) get scale 1 and the grafting direction itself. ``graft_fn``
    computes the grafting direction (``graft``, or the compiled stages' kernel);
    ``norms`` receives ``(‖graft(Ĝ)‖, ‖P‖)`` per row (the tensors themselves, for
    ``metrics()``)."""
    if group["grafting"] is None:
        return None
    reduce = tuple(range(1, direction.dim()))
    grafted = graft_fn(state, group, step, filtered, out)
    graft_norm = torch.linalg.vector_norm(grafted, dim=reduce, keepdim=True)
    norm = torch.linalg.vector_norm(direction, dim=reduce, keepdim=True)
    if norms is not None:
        norms.append((graft_norm, norm))
    scale = graft_norm / (norm + GRAFTING_NORM_EPSILON)
    if grafting_rows:
        scale[grafting_rows] = 1.0
        direction[grafting_rows] = grafted[grafting_rows]
    return scale


def decoupled_decay_factor(group: dict) -> float | None:
    """Line 6: the factor of ``W`` added to the direction (None without decay, and for L2
    decay, which line 1 adds to the gradient instead)."""
    wd, wd_type = group["weight_decay"], group["weight_decay_type"]
    if wd == 0 or wd_type == "l2":
        return None
    peak = group["peak_lr"]
    return {
        "decoupled": wd,
        "corrected": wd * float(group["lr"]) / peak if peak else 0.0,
        "independent": wd / peak if peak else 0.0,
    }[wd_type]


def folded_decay_factor(group: dict) -> float | None:
    """Line 6's ``α`` where it is folded into the direction: None without decoupled decay
    and with iterate averaging, whose decay shrinks ``z`` instead (``averaging.apply``)."""
    return None if group["iterate_averaging"] is not None else decoupled_decay_factor(group)


def finish_direction(
    state: dict, group: dict, direction: Tensor, scale: Tensor | None, owned: bool,
    param: Tensor | Sequence[Tensor] | None, lr: float, out: Tensor, copy_into: Tensor,
) -> None:
    """Lines 6–8: ``out = -lr · momentum(scale · P + α W)``.

    ``owned``: whether ``direction`` may be modified (else it is first copied into
    ``copy_into``). ``param``: the parameters' blocks when decay needs them, a stack or one
    view per row (``add_rows``; only read).
    Without decay and momentum, the grafting scale and ``-lr`` are one pass. With iterate
    averaging, decoupled decay shrinks ``z`` instead (``averaging.apply``), as in Meta.
    """
    alpha = folded_decay_factor(group)
    mu = group["momentum"]
    if alpha is None and mu == 0:
        if scale is None:
            torch.mul(direction, -lr, out=out)
        else:
            torch.mul(direction, scale.mul_(-lr), out=out)
        return
    if scale is not None:
        direction.mul_(scale)
    elif not owned:
        direction = copy_into.copy_(direction)
    if alpha is not None:
        add_rows(direction, param, alpha)  # as Meta: one pass, W left as it is
    if mu > 0:
        dampening = group["dampening"]
        buf = state["momentum"]
        buf.mul_(mu).add_(direction, alpha=1.0 - dampening)
        if group["nesterov"]:
            direction.mul_(1.0 - dampening).add_(buf, alpha=mu)
        else:
            direction = buf
    torch.mul(direction, -lr, out=out)  # line 8: the caller adds out to the parameters
