"""The stages of docs/design.md §2 that every preconditioner kind shares, as small functions.

Each works on a stack of same-shape blocks (leading dim: the block) and the stack's state
dict, in place where it can: grafting state (line 3), the filtered gradient (line 4),
grafting a direction (line 5), weight decay folded into the direction (line 6), classic
momentum (line 7) and the ``-lr`` scaling (line 8); iterate averaging (line 9) is
``averaging.py``. The kind-specific parts (statistics, refresh, preconditioning) live in
``preconditioners/``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

GRAFTING_NORM_EPSILON = 1e-16

#: elements in a tile of the CPU's elementwise stages (256 KiB of float32): a stage's
#: several operators run tile by tile, so that all but the first read of a tile come from
#: the core's cache instead of memory (measured: the filtered gradient's four operators
#: over GPT-2's hidden matrices 0.68x the time of four whole passes, one thread)
TILE = 1 << 16


def tiles(*tensors: Tensor):
    """Pieces of ``tensors`` (operands of the same shape, elementwise), one tuple of views
    per tile: flat ranges of ``TILE`` elements where all are contiguous CPU tensors larger
    than a tile, else the tensors themselves (on a GPU each operator is one kernel anyway).
    An elementwise operator gives every element the same result in pieces as whole."""
    first = tensors[0]
    if (first.device.type != "cpu" or first.numel() <= TILE
            or not all(t.shape == first.shape and t.is_contiguous() for t in tensors)):
        yield tensors
        return
    flat = [t.view(-1) for t in tensors]
    for start in range(0, first.numel(), TILE):
        yield tuple(f[start : start + TILE] for f in flat)


def row_tiles(like: Tensor):
    """Index tuples into a stack shaped like ``like`` (blocks along dim 0) that cut it into
    tiles of about ``TILE`` elements on the CPU: several whole blocks, or one block's range
    of rows (dim 1) when a block is larger; the whole stack at once on a GPU. For stages
    with per-block operands (a grafting scale, the parameters)."""
    blocks = like.shape[0]
    if like.device.type != "cpu" or like.numel() <= TILE or like.dim() < 2:
        yield (slice(0, blocks),)
        return
    per_block = like[0].numel()
    if per_block <= TILE:
        step = TILE // per_block
        for start in range(0, blocks, step):
            yield (slice(start, min(blocks, start + step)),)
        return
    step = max(1, TILE // max(1, per_block // like.shape[1]))
    for block in range(blocks):
        for start in range(0, like.shape[1], step):
            yield slice(block, block + 1), slice(start, min(like.shape[1], start + step))


def param_rows(param: Tensor | list[Tensor] | None, index: tuple) -> Tensor | None:
    """The tile ``index`` (``row_tiles``) of the stacked parameters ``param``: a stack, or a
    list of one tensor per block (views of the parameters, ``Distributor.param_rows``)."""
    if param is None or isinstance(param, Tensor):
        return param if param is None else param[index]
    blocks, rest = index[0], index[1:]
    if blocks.stop - blocks.start == 1:
        return param[blocks.start][rest].unsqueeze(0)
    return torch.stack(param[blocks])[(slice(None), *rest)]


def stacked(param: Tensor | list[Tensor] | None, dtype: torch.dtype) -> Tensor | None:
    """``param`` (see ``param_rows``) as one stacked tensor of ``dtype``."""
    if isinstance(param, list):
        param = torch.stack(param)
    return param if param is None else param.to(dtype)


def add_rows(target: Tensor, rows: list[Tensor], alpha: float) -> None:
    """``target += alpha · stack(rows)`` tile by tile (L2 weight decay into the gradients)."""
    for index in row_tiles(target):
        target[index].add_(param_rows(rows, index), alpha=alpha)


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
    """Name → (per-block shape, dtype) of the state these stages keep."""
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
    if grafting not in ("adagrad", "rmsprop", "adam"):
        return
    for v, g in tiles(state["grafting_state"], grad):
        if grafting == "adagrad":
            v.addcmul_(g, g)
        else:
            v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)


def filtered_gradient(state: dict, group: dict, step: int, grad: Tensor, out: Tensor) -> Tensor:
    """Line 4: ``Ĝ`` (into ``out`` unless it is ``grad`` or ``M`` itself)."""
    beta1 = group["betas"][0]
    if beta1 == 0:
        return grad
    beta3 = group["beta3"] if group["beta3"] is not None else beta1
    m = state["filtered_grad"]
    bias = group["use_bias_correction"]
    if beta3 == beta1:
        for m_t, g_t, out_t in tiles(m, grad, out):
            m_t.mul_(beta1).add_(g_t, alpha=1.0 - beta1)
            if bias:
                torch.div(m_t, 1.0 - beta1**step, out=out_t)
        return out if bias else m
    for m_t, g_t, out_t in tiles(m, grad, out):
        filtered = torch.mul(m_t, beta3, out=out_t).add_(g_t, alpha=1.0 - beta3)
        if bias:
            filtered.div_(1.0 - beta3 * beta1 ** (step - 1))
        m_t.mul_(beta1).add_(g_t, alpha=1.0 - beta1)
    return out


def graft(state: dict, group: dict, step: int, x: Tensor, out: Tensor) -> Tensor:
    """Line 5's grafting direction of ``x`` into ``out`` (``x`` itself for sgd / none)."""
    grafting = group["grafting"]
    if grafting in (None, "sgd"):
        return x
    bias = 1.0 - group["grafting_beta2"] ** step if grafting == "adam" else None
    for v, x_t, out_t in tiles(state["grafting_state"], x, out):
        if bias is not None:
            torch.div(v, bias, out=out_t)
        else:
            out_t.copy_(v)
        out_t.sqrt_().add_(group["grafting_epsilon"])
        torch.div(x_t, out_t, out=out_t)
    return out


def apply_grafting(
    state: dict, group: dict, step: int, direction: Tensor, filtered: Tensor,
    grafting_rows: list[int], out: Tensor, graft_fn=graft,
) -> Tensor | None:
    """Line 5: per block, the scale ``‖graft(Ĝ)‖ / ‖P‖`` that gives the preconditioned
    direction the grafting method's norm (None without grafting). Rows that still graft
    (a staggered start) get scale 1 and the grafting direction itself. ``graft_fn``
    computes the grafting direction (``graft``, or the compiled stages' kernel)."""
    if group["grafting"] is None:
        return None
    reduce = tuple(range(1, direction.dim()))
    grafted = graft_fn(state, group, step, filtered, out)
    graft_norm = torch.linalg.vector_norm(grafted, dim=reduce, keepdim=True)
    norm = torch.linalg.vector_norm(direction, dim=reduce, keepdim=True)
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


@dataclass
class Scaled:
    """A kind's direction ``factor · tensor`` not yet formed (``tensor`` may be of a
    narrower dtype, or a transposed view): ``finish_direction`` forms it tile by tile, so
    that the wide copy never makes a pass of its own through memory; ``form`` gives the
    same numbers whole."""

    tensor: Tensor
    factor: float

    def form(self, out: Tensor) -> Tensor:
        """``factor · tensor`` into ``out`` (out's dtype; the product rounded once there)."""
        if self.factor == 1.0:
            return out.copy_(self.tensor)
        if self.tensor.dtype == out.dtype:
            return torch.mul(self.tensor, self.factor, out=out)
        return out.copy_(self.tensor).mul_(self.factor)


def finish_direction(
    state: dict, group: dict, direction: Tensor, scale: Tensor | None, owned: bool,
    param: Tensor | list[Tensor] | None, lr: float, out: Tensor, copy_into: Tensor,
) -> None:
    """Lines 6–8: ``out = -lr · momentum(scale · P + α W)``.

    ``owned``: whether ``direction`` may be modified (else it is first copied into
    ``copy_into``). ``param``: the stacked parameters when decay needs them, a stack or one
    view per row (``param_rows``). Without decay and momentum, the grafting scale and
    ``-lr`` are one pass; otherwise the rows go tile by tile (``row_tiles``), and a
    ``Scaled`` direction is formed in each tile first. With iterate
    averaging, decoupled decay shrinks ``z`` instead (``averaging.apply``), as in Meta.
    """
    alpha = folded_decay_factor(group)
    mu = group["momentum"]
    buf = state["momentum"] if mu > 0 else None
    if isinstance(direction, Scaled):  # formed tile by tile into copy_into
        for index in row_tiles(out):
            formed = Scaled(direction.tensor[index], direction.factor).form(copy_into[index])
            _finish_rows(group, formed, None if scale is None else scale[index[0]], True,
                         None if alpha is None else param_rows(param, index), alpha,
                         None if buf is None else buf[index], lr, out[index],
                         copy_into[index])
        return
    if alpha is None and mu == 0:
        if scale is None:
            torch.mul(direction, -lr, out=out)
        else:
            torch.mul(direction, scale.mul_(-lr), out=out)
        return
    for index in row_tiles(out):
        _finish_rows(group, direction[index], None if scale is None else scale[index[0]],
                     owned, None if alpha is None else param_rows(param, index), alpha,
                     None if buf is None else buf[index], lr, out[index], copy_into[index])


def _finish_rows(group: dict, direction: Tensor, scale: Tensor | None, owned: bool,
                 param: Tensor | None, alpha: float | None, buf: Tensor | None, lr: float,
                 out: Tensor, copy_into: Tensor) -> None:
    """``finish_direction`` on some rows (``buf``: their momentum)."""
    if scale is not None:
        direction.mul_(scale)
    elif not owned:
        direction = copy_into.copy_(direction)
    if alpha is not None:
        direction.add_(param, alpha=alpha)  # as Meta: one pass, W left as it is
    if buf is not None:
        mu, dampening = group["momentum"], group["dampening"]
        buf.mul_(mu).add_(direction, alpha=1.0 - dampening)
        if group["nesterov"]:
            direction.mul_(1.0 - dampening).add_(buf, alpha=mu)
        else:
            direction = buf
    torch.mul(direction, -lr, out=out)  # line 8: the caller adds out to the parameters
