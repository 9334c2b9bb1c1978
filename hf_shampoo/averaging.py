"""Iterate averaging: generalized primal averaging and schedule-free (docs/design.md §2 line 9).

``iterate_averaging="gpa"`` (arXiv 2512.17131) and ``"schedule_free"`` (arXiv 2405.15682),
Meta's ``GeneralizedPrimalAveragingConfig`` / ``ScheduleFreeConfig``, keep three sequences
per block: ``z`` takes the plain steps ``u = -lr P``; ``x`` averages ``z`` (the weights to
evaluate); ``y = μ_y x + (1 - μ_y) z`` is where gradients are taken. With ``μ_x`` the
``eval_interp_coeff`` (schedule-free: ``1 - lr_t^p / Σ_{i≤t} lr_i^p``) and ``μ_y`` the
``train_interp_coeff``, a step is

    z' = (1 - lr α) z + u                          (α: decoupled weight decay, else 0)
    y' = y + (1 - μ_x μ_y) u + (1 - μ_x)(z_decayed - y)

In train mode the parameters hold ``y``; ``optimizer.eval()`` moves them to
``x = y + (1 - 1/μ_y)(z - y)`` and ``optimizer.train()`` back. The state kept per block is
``D = z - y`` (``iterate_offset``, zero at the start as Meta's ``z`` starts at the
parameters): a switch then needs no parameters on the rank that owns the block, and ``z - y``
is never the difference of two nearby large numbers. Coefficients are float32 values
computed as Meta computes them (its lr and coefficient tensors are float32), so that the
numbers agree with Meta's.
"""

from __future__ import annotations

import torch
from torch import Tensor

STATE = "iterate_offset"


def enabled(group) -> bool:
    return group.get("iterate_averaging") is not None


def in_train_mode(group) -> bool:
    return group.get("train_mode", True)


def _f32(value: float) -> Tensor:
    return torch.tensor(float(value), dtype=torch.float32, device="cpu")


def step_coefficients(group) -> tuple[tuple[float, float, float] | None, float | None]:
    """This step's ``(1 - μ_x μ_y, 1 - μ_x, float32 lr)`` for an averaging group (None
    otherwise) and the group's new ``lr_sum`` (schedule-free), which the caller stores once
    the step has succeeded."""
    if not enabled(group):
        return None, None
    mu_y = _f32(group["train_interp_coeff"])
    lr = _f32(float(group["lr"]))
    lr_sum = None
    if group["iterate_averaging"] == "gpa":
        mu_x = _f32(group["eval_interp_coeff"])
    else:
        power = torch.pow(lr, group["eval_coeff_lr_power"])
        total = _f32(group.get("lr_sum", 0.0)) + power
        lr_sum = total.item()
        # nothing has had weight yet (lr 0 so far, e.g. a warm-up's first step): keep x,
        # where Meta's 0/0 gives nan
        mu_x = 1.0 - power / total if lr_sum > 0 else _f32(1.0)
    return ((1.0 - mu_y * mu_x).item(), (1.0 - mu_x).item(), lr.item()), lr_sum


def decay_factor(lr32: float, alpha: float | None) -> float | None:
    """``1 - lr α`` as Meta's float32 tensors give it (None without decoupled decay)."""
    if alpha is None:
        return None
    return (1.0 - _f32(lr32) * alpha).item()


def apply(state: dict, coefficients: tuple[float, float, float], decay: float | None,
          param: Tensor | None, out: Tensor, scratch: Tensor) -> None:
    """Turn ``out`` (``u = -lr P`` of the rows) into the parameters' step ``y' - y`` and
    advance ``D = z - y`` (``state[STATE]``, the same rows). ``decay``: ``1 - lr α`` with
    decoupled weight decay, which shrinks ``z`` (``param``: the rows' parameters ``y``)."""
    step, pull, _ = coefficients
    offset = state[STATE]
    if decay is not None:  # D <- (1 - lr α) z - y = (1 - lr α) D - lr α y
        offset.mul_(decay).add_(param, alpha=decay - 1.0)
    moved = torch.mul(offset, pull, out=scratch).add_(out, alpha=step)
    offset.add_(out).sub_(moved)  # z' - y' = (z_decayed - y) + u - (y' - y)
    out.copy_(moved)


def switch_coefficients(group, to_train: bool) -> tuple[float, float | None]:
    """``(c, k)``: the parameters move by ``c · D`` and ``D = z - y`` becomes ``k · D``
    (None: stays). To eval: ``x = y + (1 - 1/μ_y) D``. To train: ``y = x + (1 - μ_y)(z - x)``
    with ``z - x = (1 - (1 - 1/μ_y)) D``, and ``z`` unchanged: ``D <- (z - x)(1 - (1 - μ_y))``.
    Each coefficient is rounded to float32 as Meta's are (exactly Meta's numbers), so
    ``eval()`` then ``train()`` gives ``y`` back up to about 1e-8·|D|, below float32
    parameters' resolution, with ``z`` kept."""
    mu_y = _f32(group["train_interp_coeff"])
    to_eval = (1.0 - torch.reciprocal(mu_y)).item()
    if not to_train:
        return to_eval, None
    z_minus_x = 1.0 - to_eval
    back = (1.0 - mu_y).item()
    return back * z_minus_x, (1.0 - back) * z_minus_x


# ------------------------------------------------------------ train() / eval()
def refuse_eval_mode(groups) -> None:
    """A step in eval mode raises, naming the group (nothing has changed yet)."""
    for gi, group in enumerate(groups):
        if enabled(group) and not in_train_mode(group):
            raise RuntimeError(
                f"DistributedShampoo: step() in eval mode: parameter group {gi} uses "
                f"iterate_averaging={group['iterate_averaging']!r} and its parameters "
                "hold the averaged weights; call optimizer.train() before training "
                "(nothing was changed)"
            )


def groups_to_switch(groups, to_train: bool) -> list[int]:
    """The indices of the averaging groups whose mode differs from the one asked for."""
    return [gi for gi, group in enumerate(groups)
            if enabled(group) and in_train_mode(group) != to_train]


def switch(layout, distributor, groups, moving_groups: list[int], to_train: bool) -> None:
    """Move every block of ``moving_groups`` by ``c · D`` (``switch_coefficients``): each
    owner writes its blocks' moves into their directions, the distributor shares and adds
    them (``finish_step``, a collective: every rank calls it)."""
    if distributor.needs_reallocation(layout.stacks):
        distributor.allocate_directions(layout.stacks)
    moving = {id(s): list(range(len(s.members))) if s.group_index in moving_groups else []
              for s in layout.stacks}
    for stack in layout.owned:
        if stack.group_index not in moving_groups:
            continue
        offset = stack.state.get(STATE)
        if offset is None:  # no step yet: z = y = x
            stack.directions.zero_()
            continue
        c, k = switch_coefficients(stack.settings(groups), to_train)
        torch.mul(offset, c, out=stack.directions)
        if k is not None:
            offset.mul_(k)
    distributor.finish_step(layout, moving)


def mark_mode(groups, to_train: bool) -> None:
    """Record the mode of every averaging group without moving a parameter (the caller
    moved them, or put weights of that mode in place, as ``load_best_model_at_end``)."""
    for group in groups:
        if enabled(group):
            group["train_mode"] = to_train
