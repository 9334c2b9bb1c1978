"""DeepSpeed ZeRO stages 1 and 2: full-shape blocks over DeepSpeed's flat partitions
(docs/deepspeed.md).

``deepspeed.initialize`` (also through the Trainer's ``deepspeed=`` and Accelerate's
DeepSpeed plugin) replaces each of the optimizer's parameter groups by one flat fp32
partition per rank: a contiguous range of the group's parameters flattened one after the
other, and calls ``step()`` once per group with only that group in ``param_groups``. A
Kronecker-factored or spectral optimizer stepping those vectors would be a diagonal method
in disguise. Here the optimizer recognises the partitions (DeepSpeed links every original
parameter to its piece of the partition: ``param._hp_mapping``), keeps blocking the
original parameters exactly as one process does, and treats each rank's pieces as the
boxes it holds (``placements.flat_range_boxes``): the sharded distributor brings every
owner the gradient parts of its blocks from the ranks whose partitions hold them and sends
the direction parts back into the partitions. DeepSpeed then copies the fp32 partitions
to the model's parameters and all-gathers them as usual.

The optimizer waits for the last group's call: the earlier calls keep each group's
gradient partition (DeepSpeed drops it after the call), the last one steps every group
and writes the earlier groups' model-precision copies (``tensor_fragment.update_lp``), as
DeepSpeed itself does for the group it just stepped.

Refused, before anything changes: ZeRO 3 (``placements.refuse_unsupported``), CPU
offload, a data-parallel group smaller than the world (DeepSpeed's model or sequence
parallelism), and iterate averaging (its ``train()`` / ``eval()`` move parameters outside
DeepSpeed's step); and, without ZeRO, fp16 (``refuse_deepspeed_fp16_stage0``: DeepSpeed's
stage-0 wrapper unscales gradients it never scaled). Nothing here imports DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from .placements import flat_range_boxes
from .sharded import ShardedDistributor

__all__ = ["ZeroPartitions", "find_zero_partitions", "refuse_deepspeed_fp16_stage0"]


def _linked(param: Tensor) -> bool:
    """Whether DeepSpeed ZeRO 1/2 linked this parameter to its fp32 partition."""
    return hasattr(param, "_hp_mapping") and hasattr(param, "_dp_group")


def find_zero_partitions(groups: list[dict], constructed: list[list[Tensor]]
                         ) -> ZeroPartitions | None:
    """The ZeRO view of the optimizer when DeepSpeed has replaced its groups' parameters by
    flat partitions (None otherwise). ``groups``: the optimizer's own list of group dicts;
    ``constructed``: each group's parameters as the optimizer was built with them."""
    if len(groups) != len(constructed):
        return None
    swapped = False
    for group, originals in zip(groups, constructed):
        params = group["params"]
        ours = {id(p) for p in originals}
        if all(id(p) in ours for p in params):
            continue
        trainable = [p for p in originals if p.requires_grad]
        if not trainable:  # a frozen group: DeepSpeed's partition of it is empty
            continue
        if len(params) != 1 or params[0].dim() != 1 or not all(_linked(p) for p in trainable):
            return None
        swapped = True
    if not swapped:
        return None
    return ZeroPartitions(groups, constructed)


def refuse_deepspeed_fp16_stage0(constructed: list[list[Tensor]]) -> None:
    """Raise when the optimizer was built over float16 parameters and DeepSpeed's stage-0
    wrapper (``FP16_UnfusedOptimizer``) makes its construction step on fp32 copies of them.

    Called where that step is recognised (``DistributedShampoo._initialising_under_
    deepspeed``): inside ``deepspeed.initialize``, on every rank, before any state exists
    or any parameter moves. DeepSpeed 0.19.8's ``engine.backward`` does not scale the loss
    under fp16 without ZeRO, while the wrapper's ``step`` divides the gradients by the loss
    scale (deepspeedai/DeepSpeed PR 8393, open): the optimizer would see gradients 65,536x
    too small (the default dynamic scale), no overflow would ever trigger, and the run
    would look healthy. bf16 uses the same wrapper with a scale of 1 and is not refused;
    ZeRO 1 and 2 scale the loss themselves."""
    if not any(p.dtype == torch.float16 for params in constructed for p in params):
        return
    raise ValueError(
        "DistributedShampoo: DeepSpeed fp16 without ZeRO (zero_optimization.stage 0, its "
        "FP16_UnfusedOptimizer) is not supported: DeepSpeed divides the gradients by the "
        "loss scale without having scaled the loss (deepspeedai/DeepSpeed PR 8393), so the "
        "optimizer would step on gradients too small by the loss scale (65,536 by default) "
        "and no overflow would ever show. Use bf16 (\"bf16\": {\"enabled\": true}, the "
        "Trainer's bf16=True), or fp16 under ZeRO stage 1 or 2 (\"zero_optimization\": "
        "{\"stage\": 1}), which scale the loss correctly (docs/deepspeed.md)")


@dataclass
class ZeroPartitions:
    """Each group's flat fp32 partition on this rank, the original parameters, and the
    gradient partitions kept from DeepSpeed's per-group calls of one step."""

    groups: list[dict]
    originals: list[list[Tensor]]
    grads: list[Tensor | None] = field(default_factory=list)
    distributor: ZeroDistributor | None = None

    def __post_init__(self) -> None:
        self.flats = [g["params"][0] if g["params"] else None for g in self.groups]
        self.grads = [None] * len(self.groups)
        for originals in self.originals:
            for p in originals:
                if not _linked(p):
                    continue
                mapping = p._hp_mapping
                if mapping is not None and getattr(mapping, "use_offload", False):
                    raise ValueError(
                        "DistributedShampoo under DeepSpeed ZeRO: optimizer CPU offload "
                        "(offload_optimizer) keeps the partitions where this optimizer "
                        "cannot exchange them; turn offload off, or use FSDP2 "
                        "(docs/deepspeed.md)")
                group = getattr(p, "_dp_group", None)
                world = dist.get_world_size()
                if group is not None and dist.get_world_size(group) != world:
                    raise ValueError(
                        f"DistributedShampoo under DeepSpeed ZeRO: the data-parallel group has "
                        f"{dist.get_world_size(group)} of the world's {world} ranks (model or "
                        "sequence parallelism); only pure data parallelism is supported")
        for group in self.groups:
            if group.get("iterate_averaging") is not None:
                raise ValueError(
                    "DistributedShampoo under DeepSpeed ZeRO: iterate_averaging moves "
                    "parameters in train() / eval(), outside DeepSpeed's step, which then "
                    "would not reach the model; use ZeRO stage 0 or FSDP2 for it")
        self.group_of = {id(p): gi for gi, originals in enumerate(self.originals)
                         for p in originals}
        self.distributor = ZeroDistributor(self)

    def group_index(self, shown: list[dict]) -> int | None:
        """Which group DeepSpeed shows in this call (None: all of them, BF16_Optimizer)."""
        if len(shown) == len(self.groups) and all(a is b for a, b in zip(shown, self.groups)):
            return None
        if len(shown) != 1:
            raise RuntimeError("DistributedShampoo under DeepSpeed ZeRO: step() was shown "
                               f"{len(shown)} of {len(self.groups)} groups")
        return next(i for i, g in enumerate(self.groups) if g is shown[0])

    def collect(self, shown: list[dict]) -> tuple[bool, int | None]:
        """Keep the gradient partitions of the groups in this call; whether every group has
        been shown in this step (time to step them all), and which group this call showed
        (``group_index``)."""
        index = self.group_index(shown)
        indices = range(len(self.groups)) if index is None else [index]
        if index in (None, 0):
            self.grads = [None] * len(self.groups)
        for i in indices:
            self.grads[i] = None if self.flats[i] is None else self.flats[i].grad
        return index is None or index == len(self.groups) - 1, index

    def write_model_copies(self, upto: int) -> None:
        """Copy the fp32 partitions of groups ``[0, upto)`` to their model-precision pieces
        (DeepSpeed did so right after their calls, before they were stepped here)."""
        for originals in self.originals[:upto]:
            for p in originals:
                mapping = getattr(p, "_hp_mapping", None)
                if mapping is not None:
                    mapping.update_lp()

    def boxes(self, params: dict[int, Tensor], names: dict[int, str]) -> dict[int, list]:
        """Every rank's pieces of the given parameters as ``(box, offset in its partition)``
        (one ``all_gather_object`` of ``(start, numel, offset)`` per parameter)."""
        mine = {}
        for index, p in params.items():
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is not None:
                mine[index] = (mapping.lp_fragment_address.start,
                               mapping.lp_fragment_address.numel,
                               mapping.hp_fragment_address.start)
        world = dist.get_world_size()
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
        out: dict[int, list] = {}
        for index, p in params.items():
            per_rank: list = []
            for rank in range(world):
                piece = everyone[rank].get(index)
                if piece is None:
                    per_rank.append(None)
                    continue
                start, numel, offset = piece
                per_rank.append([(box, offset + at) for box, at in
                                 flat_range_boxes(p.shape, start, start + numel)])
            out[index] = per_rank
        return out


class ZeroDistributor(ShardedDistributor):
    """The sharded distributor over DeepSpeed's flat partitions: a rank's values of a
    parameter are its group's fp32 partition, its gradient that partition's gradient."""

    def __init__(self, zero: ZeroPartitions) -> None:
        super().__init__(torch.float32, boxes_of=zero.boxes)
        self.zero = zero

    def collective_layout(self, params) -> bool:
        """``ZeroPartitions.boxes`` gathers every rank's pieces at every layout."""
        return self.needs_agreement()

    def _flat(self, param: Tensor) -> int:
        return self.zero.group_of[id(param)]

    def values_of(self, param: Tensor) -> Tensor:
        return self.zero.flats[self._flat(param)]

    def grad_of(self, param: Tensor) -> Tensor | None:
        return self.zero.grads[self._flat(param)]

    def has_grad(self, param: Tensor) -> bool:
        return param.requires_grad and self.grad_of(param) is not None

    def grad_elements(self, param: Tensor) -> Tensor:
        mapping = getattr(param, "_hp_mapping", None)
        grad = self.grad_of(param)
        if mapping is None or grad is None:
            return torch.zeros(0, device=param.device)
        address = mapping.hp_fragment_address
        return grad[address.start:address.start + address.numel]
