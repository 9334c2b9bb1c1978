"""The precision of the products that apply a preconditioner in the steady step:
``apply_precision`` (docs/performance.md#apply_precision).

``"ieee"`` (the default): float32 products, as Meta's. ``"tf32"``: the products that apply
the roots or eigenbases take their float32 operands in TF32 (10-bit mantissa), accumulated
in float32, as a GPU's tensor cores do; the statistics, refreshes and everything else stay
as they are. On CUDA that is torch's TF32 switch, on for those calls and restored after. The
switch is the whole process's, so a refresh running beside the step (``refresh_delay``)
would take it by timing: that combination is refused on CUDA (``check``). Elsewhere the
rounding is emulated (``EmulatedTF32``, a dispatch mode of the calling thread only, so a
worker thread is never affected): the same numbers a GPU's TF32 gives up to its
accumulation order, for measuring accuracy on a CPU, and slower than float32 there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["EmulatedTF32", "applying", "check", "to_tf32"]

#: the ``apply_precision`` values
IEEE, TF32 = "ieee", "tf32"


def to_tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to TF32 (sign, 8-bit exponent, 10-bit mantissa): to nearest,
    ties to even; infinities and NaNs kept."""
    bits = x.contiguous().view(torch.int32)
    odd = torch.bitwise_and(torch.bitwise_right_shift(bits, 13), 1)
    rounded = torch.bitwise_and(bits + 0x0FFF + odd, ~0x1FFF).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x)


_aten = torch.ops.aten
#: products and where their multiplied operands are (the added term of ``addmm`` and
#: ``baddbmm`` is not rounded: TF32 applies to the multiplication only)
_OPERANDS = {_aten.mm: (0, 1), _aten.bmm: (0, 1), _aten.mv: (0, 1), _aten.dot: (0, 1),
             _aten.addmm: (1, 2), _aten.baddbmm: (1, 2), _aten.addmv: (1, 2),
             _aten.addbmm: (1, 2)}


class EmulatedTF32(TorchDispatchMode):
    """Round the float32 operands of every matrix product to TF32 (``to_tf32``) before it
    runs: a model of a GPU's TF32 on any device, for this thread only."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        where = _OPERANDS.get(func.overloadpacket)
        if where is not None:
            args = list(args)
            for i in where:
                if torch.is_tensor(args[i]) and args[i].dtype == torch.float32:
                    args[i] = to_tf32(args[i])
        return func(*args, **kwargs)


@contextlib.contextmanager
def _cuda_tf32() -> Iterator[None]:
    """cuBLAS's TF32 switch on, then back as it was. Through the legacy ``allow_tf32``,
    which torch reads and sets whichever API set it before, but for a process that set
    ``fp32_precision="tf32"`` itself (then its matmuls are TF32 already, and torch would
    refuse the legacy read)."""
    matmul = torch.backends.cuda.matmul
    if getattr(matmul, "fp32_precision", None) == "tf32":
        yield
        return
    saved = matmul.allow_tf32
    matmul.allow_tf32 = True
    try:
        yield
    finally:
        matmul.allow_tf32 = saved


def applying(group: Mapping[str, Any], device: torch.device):
    """The context the products applying ``group``'s preconditioner run in."""
    if group.get("apply_precision", IEEE) != TF32:
        return contextlib.nullcontext()
    if device.type == "cuda":
        return _cuda_tf32()
    return EmulatedTF32()


def check(group: Mapping[str, Any], device: torch.device) -> None:
    """Refuse ``apply_precision="tf32"`` with ``refresh_delay >= 1`` on CUDA, before any
    state changes: torch's TF32 switch is the process's, and the refresh computed beside the
    step would take it or not by timing."""
    if group.get("apply_precision", IEEE) == TF32 and group.get("refresh_delay", 0) and \
            device.type == "cuda":
        raise ValueError(
            f"DistributedShampoo: apply_precision='tf32' with refresh_delay="
            f"{group['refresh_delay']} on CUDA: torch's TF32 switch is the whole process's, "
            "so the refresh running beside the step would round by timing; use "
            "refresh_delay=0 with 'tf32', or apply_precision='ieee' with a delay "
            "(valid apply_precision values: 'ieee', 'tf32')")
