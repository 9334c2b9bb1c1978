"""Riemannian preconditioned LoRA (Zhang & Pilanci, "Riemannian Preconditioned LoRA for
Fine-Tuning Foundation Models", ICML 2024; docs/lora.md).

A LoRA adapter is a factorization ``ΔW = s · B A`` with ``A`` of shape ``(r, d_in)`` and
``B`` of shape ``(d_out, r)``. The kind preconditions each factor's gradient by the other
factor's ``r × r`` Gram matrix, the metric of the quotient manifold of rank-``r`` matrices::

    ∇A  ←  (BᵀB + δ I)⁻¹ ∇A          ∇B  ←  ∇B (AAᵀ + δ I)⁻¹

and the grafting method (``grafting="adam"``: the paper's scaled AdamW; ``"sgd"`` or ``None``:
its scaled GD with ``betas[0]``'s momentum) then runs on the preconditioned gradient, so the
state is exactly the grafting method's (AdamW's ``m`` and ``v``): nothing of order ``d²``,
not even ``r²``, because the Gram matrices are recomputed from the weights every step.

Each Gram matrix is normalized by its mean eigenvalue (``tr / r``) before ``δ = epsilon``
is added (a relative regularizer). The normalization changes the
preconditioned gradient by one scalar per block and step, which keeps the second moment
free of the ``1/‖B‖²`` blow-up of the first steps.

Pairs are found by name in the block's parameter group (``param_names``: named parameters,
``make_optimizer``, the Trainer): ``….lora_A.<adapter>.weight`` with ``….lora_B.<adapter>.weight``
and ``lora_embedding_A.<adapter>`` with ``lora_embedding_B.<adapter>`` (peft's linear,
convolution and embedding adapters; rank-stabilized LoRA and DoRA have the same pairs,
DoRA's magnitude vector is a vector). A parameter without a partner (a task head, a bias)
gets the grafting method alone, as ``preconditioner="diagonal"``.

Distribution: the Gram matrix of a block's partner is computed from the partner's full
weight, which data-parallel ranks (DDP) all hold, so the owner of ``A``'s blocks need not
own ``B`` and nothing is communicated; the state is the grafting method's, keyed per block
as for every kind. Under FSDP2 / HSDP (lossless: DTensor parameters, full blocks gathered
on their owner) a rank holds a shard of the partner: ``before_step``, which every rank runs
at the start of every step, materialises the full weight of every partner of the kind's
blocks (``DTensor.full_tensor()``, one all-gather per sharded partner, in layout order on
every rank), before any weight changes, and keeps those its owned blocks read.
``fsdp_mode="local"`` blocks each rank's shard, which cuts the pairs: refused.
"""

from __future__ import annotations

import math
import re
import warnings

import torch
from torch import Tensor

from .. import update_rules
from .base import Preconditioner

# peft's adapter names: "lora_A" / "lora_B" (linear, conv) and "lora_embedding_A" / "_B"
_SIDE = re.compile(r"lora_(?:embedding_)?([AB])(?=\.|$)")


def adapter_side(name: str) -> tuple[str, str] | None:
    """``(side, partner's name)`` of a peft adapter parameter (``side`` "A" or "B"), or
    None for any other name."""
    matches = list(_SIDE.finditer(name))
    if not matches:
        return None
    match = matches[-1]  # the last one: a module path may hold the same letters earlier
    side = match.group(1)
    other = "B" if side == "A" else "A"
    return side, name[:match.start(1)] + other + name[match.end(1):]


def group_names(group) -> dict[str, Tensor]:
    """Name → parameter of a parameter group (empty without ``param_names``)."""
    names = group.get("param_names")
    if not names:
        return {}
    return dict(zip(names, group["params"]))


def partner_of(name: str, group) -> tuple[str, str, Tensor | None] | None:
    """``(side, partner name, partner tensor or None)`` for an adapter parameter of
    ``group``; None for a parameter that is not an adapter."""
    found = adapter_side(name)
    if found is None:
        return None
    side, other = found
    return side, other, group_names(group).get(other)


def pair_label(name: str, group) -> str:
    """``describe()``'s note on a parameter of this kind: its side and partner, or why it
    has none."""
    found = partner_of(name, group)
    if found is None:
        return "no partner: grafting alone"
    side, other, partner = found
    if partner is None:
        return f"lora_{side} without its partner in the group: grafting alone"
    r = partner.shape[0] if side == "B" else as_matrix(partner).shape[1]
    gram = "(BᵀB+δI)⁻¹ ∇A" if side == "A" else "∇B (AAᵀ+δI)⁻¹"
    return f"lora_{side} of a pair, r={r}: {gram}"


def as_matrix(t: Tensor) -> Tensor:
    """A factor as the matrix of the product ``B A`` (``(rows, the rest)``)."""
    return t.reshape(t.shape[0], -1)


class _Pairs:
    """Per stack position: ``(side, partner tensor)`` or None (no partner: identity)."""

    def __init__(self, key: tuple, entries: list) -> None:
        self.key, self.entries = key, entries


class RiemannianLoRA(Preconditioner):
    name = "riemannian_lora"
    grafted = False  # the direction is the grafting method's, of the preconditioned gradient
    matrix_blocks = True  # blocks of the (rows, rest) matrix, so that r stays one dim
    refreshes = False
    needs_grafting = True  # the method prescribes Adam on top (docs/lora.md)
    steps_on_every_rank = True  # before_step gathers the sharded partners' weights (FSDP2)
    # epsilon is its Gram matrices' delta; the refresh keywords change nothing
    ignores = frozenset({"precondition_frequency", "refresh_schedule",
                         "start_preconditioning_step"})

    def rule_keywords(self, shape_role: str, effective: dict) -> dict:
        """Under the module rules: Adam on top unless a grafting method is given; a vector
        matched by the same pattern (DoRA's magnitude, a bias) the diagonal method."""
        keywords = {} if effective.get("grafting") is not None else {"grafting": "adam"}
        if shape_role == "vector":
            keywords["vector_preconditioner"] = "diagonal"
        return keywords

    def describe_label(self, name: str, group: dict) -> str:
        return pair_label(name, group)

    def preconditioned_dims(self, group: dict, order: int) -> list[int]:
        return []

    def step_flops(self, shape: tuple[int, ...], group: dict) -> float:
        """Elementwise passes, the partner's Gram matrix (``2 d r²``, charged to the block)
        and the solve against the block (``2 r · numel``)."""
        numel = math.prod(shape)
        r = min(shape) if len(shape) == 2 else 1
        return 10.0 * numel + 4.0 * r * numel

    # ------------------------------------------------------------------ pairing
    def pairs(self, stack, group) -> list:
        """Each stack member's ``(side, partner)``, found once per stack (by name)."""
        key = tuple(id(m.param) for m in stack.members)
        cached = stack.__dict__.get("_adapter_pairs")
        if cached is not None and cached.key == key:
            return cached.entries
        named = bool(group.get("param_names"))
        entries = []
        for member in stack.members:
            found = partner_of(member.name, group) if named else None
            if found is None:
                entries.append(None)
                continue
            side, other, partner = found
            if partner is None:
                warnings.warn(
                    f"DistributedShampoo: preconditioner='riemannian_lora': {member.name!r} is a "
                    f"LoRA factor but its partner {other!r} is not in its parameter group; "
                    "it gets the grafting method alone (put both factors of an adapter in "
                    "one group)", stacklevel=6)
                entries.append(None)
                continue
            self._check(member, side, partner, stack.shape)
            entries.append((side, partner))
        if not named and stack.members:
            raise ValueError(
                "DistributedShampoo: preconditioner='riemannian_lora' pairs peft's lora_A / "
                "lora_B by name, but the group of "
                f"{stack.members[0].name!r} has no parameter names: pass "
                "model.named_parameters(), or build the optimizer with "
                "hf_shampoo.make_optimizer(model, ...)")
        stack.__dict__["_adapter_pairs"] = _Pairs(key, entries)
        return entries

    def before_step(self, stacks: list, groups: list[dict], distributor) -> None:
        """Every rank, every step, before anything changes: with DTensor parameters
        (FSDP2, HSDP), the full weight of every sharded partner of the kind's blocks, one
        ``full_tensor()`` each in the layout's order (the same collectives on every rank);
        the owned stacks keep the ones they read until the next step. Nothing without
        DTensors (one process, DDP: every rank holds every weight)."""
        if not any(_is_dtensor(m.param) for stack in stacks for m in stack.members):
            return
        for stack in stacks:
            for member in stack.members:
                if tuple(distributor.blocking_shape(member.param)) != tuple(member.param.shape):
                    raise NotImplementedError(
                        "DistributedShampoo: preconditioner='riemannian_lora' with "
                        "fsdp_mode='local' blocks each rank's shard of "
                        f"{member.name!r}, which cuts the adapter pairs' rank dim; use the "
                        "default lossless mode (docs/lora.md)")
        partners: dict[int, Tensor] = {}
        needed: list[tuple] = []  # (owned stack, partner ids it reads)
        for stack in stacks:
            entries = self.pairs(stack, stack.settings(groups))
            ids = []
            for entry in entries:
                if entry is not None and _is_dtensor(entry[1]):
                    partners.setdefault(id(entry[1]), entry[1])
                    ids.append(id(entry[1]))
            if stack.rank == distributor.rank:
                needed.append((stack, ids))
        with torch.no_grad():
            full = {key: p.detach().full_tensor() for key, p in partners.items()}
        for stack, ids in needed:
            stack.__dict__["_partner_weights"] = {key: full[key] for key in ids}

    @staticmethod
    def _full_weight(stack, partner: Tensor) -> Tensor:
        """The partner's full weight: itself, or (a DTensor) what ``before_step`` gathered."""
        if not _is_dtensor(partner):
            return partner
        found = stack.__dict__.get("_partner_weights", {}).get(id(partner))
        if found is None:
            raise RuntimeError(
                "DistributedShampoo: preconditioner='riemannian_lora' reads a sharded "
                "partner's full weight, gathered by before_step on every rank at the start "
                "of the step; it was not gathered (a step not driven by "
                "DistributedShampoo.step()?)")
        return found

    @staticmethod
    def _check(member, side: str, partner: Tensor, block_shape: tuple[int, ...]) -> None:
        r = member.param.shape[0] if side == "A" else as_matrix(member.param).shape[1]
        if len(block_shape) != 2 or block_shape[0 if side == "A" else 1] != r:
            raise ValueError(
                f"DistributedShampoo: preconditioner='riemannian_lora': the blocks "
                f"{tuple(block_shape)} of {member.name!r} cut its rank dim (r = {r}); set "
                f"max_preconditioner_dim >= {r}")

    # ------------------------------------------------------------------ the step
    def update_statistics(self, stack, job, g: Tensor, scratch) -> None:
        """Replace each paired row of ``job.grad`` by its preconditioned gradient (before
        the grafting state and the filtered gradient see it)."""
        entries = self.pairs(stack, job.group)
        rows = {"A": [], "B": []}
        for row, position in enumerate(job.members):
            entry = entries[position]
            if entry is not None:
                rows[entry[0]].append((row, entry[1]))
        if not rows["A"] and not rows["B"]:
            return
        delta = float(job.group["epsilon"])
        grams: dict[int, Tensor] = {}
        grad = job.grad
        for side, chosen in rows.items():
            if not chosen:
                continue
            index, matrices = [], []
            for row, partner in chosen:
                key = id(partner)
                if key not in grams:
                    grams[key] = _normalized_gram(self._full_weight(stack, partner), side,
                                                  delta)
                index.append(row)
                matrices.append(grams[key])
            m = torch.stack(matrices)  # (k, r, r), float64
            x = grad[index].to(torch.float64)  # A rows: (k, r, b); B rows: (k, b, r)
            if side == "A":
                y = torch.linalg.solve(m, x)
            else:
                y = torch.linalg.solve(m, x.transpose(1, 2)).transpose(1, 2)
            grad[index] = y.to(grad.dtype)

    def precondition(self, stack, job, filtered: Tensor, out: Tensor, scratch) -> Tensor:
        return update_rules.graft(job.state, job.group, job.step, filtered, scratch("graft"))


def _is_dtensor(tensor: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(tensor, DTensor)


def _normalized_gram(partner: Tensor, side: str, delta: float) -> Tensor | None:
    """The Gram matrix that preconditions the *other* side: ``BᵀB`` for a row of ``A``
    (``partner`` = B), ``AAᵀ`` for a row of ``B`` (``partner`` = A), divided by its mean
    eigenvalue, plus ``δ I``. A zero partner (``B`` at its initialization) gives ``δ I``:
    the gradient it preconditions is zero then (``∇A = s Bᵀ ∇ΔW``). No host sync."""
    p = as_matrix(partner.detach()).to(torch.float64)
    gram = p.T @ p if side == "A" else p @ p.T
    mean = torch.trace(gram).div_(gram.shape[0]).clamp_(min=torch.finfo(torch.float64).tiny)
    gram = gram / mean
    gram.diagonal().add_(max(delta, 1e-30))
    return gram
