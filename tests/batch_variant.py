"""Products whose rounding depends on the whole call: a stand-in for a library that batches
differently (docs/design.md §13, "The same calls everywhere").

A BLAS may give a block other bits inside a batch than alone, or in a batch of other
companions: AMD's and Intel's do so at other sizes, cuBLAS at most sizes. The optimizer's
promise, one process and any layout bit for bit alike, must not rest on which library runs
the tests. ``BatchVariantProducts`` makes the worst such library out of the one at hand:
while it is active, every product and decomposition (``mm``, ``bmm``, ``baddbmm``,
``matmul``, ``einsum``, ``tensordot``, the matrix-vector forms, ``eigh``, ``qr``, ``svd``,
``cholesky``, the triangular solves, ...) returns its result scaled by ``1 + c·u``, where
``u`` is the dtype's unit in the last place and ``c`` in ``{-2, -1, 1, 2}`` is drawn from a
hash of the call: its name, every tensor argument's shape and exact values. The same call
on the same inputs gives the same bits; a block computed in a batch of another size, or
beside other blocks, gets other bits, about as far apart as two real libraries' results.

It is a torch function mode, so it sees what the optimizer calls, plain tensors only
(DTensor and other subclasses pass through). Tests enter it per case
(``tests/layout_cases.py`` draws ``batch_variant``) or for a whole process by
``HF_SHAMPOO_BATCH_VARIANT=1`` (``tests/__init__.py``).
"""

from __future__ import annotations

import hashlib
import os

import torch
from torch.overrides import TorchFunctionMode

ENV = "HF_SHAMPOO_BATCH_VARIANT"

_T = torch.Tensor
_LINALG = torch.linalg
#: functional products and decompositions: their result is scaled out of place
FUNCTIONAL = {
    torch.mm, torch.bmm, torch.matmul, torch.addmm, torch.baddbmm, torch.addbmm,
    torch.einsum, torch.tensordot, torch.mv, torch.addmv, torch.dot, torch.vdot,
    torch.inner, torch.outer, torch.chain_matmul, torch.cholesky_solve,
    _LINALG.matmul, _LINALG.multi_dot, _LINALG.vecdot, _LINALG.eigh, _LINALG.eigvalsh,
    _LINALG.qr, _LINALG.svd, _LINALG.svdvals, _LINALG.cholesky, _LINALG.cholesky_ex,
    _LINALG.solve_triangular, _LINALG.solve, _LINALG.inv, _LINALG.inv_ex,
    _T.mm, _T.bmm, _T.matmul, _T.__matmul__, _T.__rmatmul__, _T.addmm, _T.baddbmm,
    _T.addbmm, _T.mv, _T.addmv, _T.dot, _T.vdot, _T.inner, _T.outer,
}
#: in-place forms: the tensor they wrote is scaled in place
IN_PLACE = {_T.addmm_, _T.baddbmm_, _T.addbmm_, _T.addmv_}


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _plain(tensor: torch.Tensor) -> bool:
    return type(tensor) in (torch.Tensor, torch.nn.Parameter)


def call_factor_code(func, args, kwargs) -> int:
    """``c`` of the call: a hash of its name and of every input tensor's shape and exact
    values (bytes of a float64 contiguous copy, so that strides do not count). Not inputs:
    ``out=`` tensors, and the added tensor of ``addmm`` and its kin under ``beta=0``
    (whatever a workspace held before)."""
    digest = hashlib.blake2b(getattr(func, "__name__", repr(func)).encode(), digest_size=8)
    kwargs = {k: v for k, v in kwargs.items() if k != "out"}
    if kwargs.get("beta", 1) == 0:
        args = args[1:]
    for tensor in _tensors((args, kwargs)):
        digest.update(repr(tuple(tensor.shape)).encode())
        values = tensor.detach()
        if values.is_floating_point() or values.is_complex():
            values = values.to("cpu", torch.float64 if values.is_floating_point()
                               else torch.complex128)
        digest.update(values.cpu().contiguous().numpy().tobytes())
    return (-2, -1, 1, 2)[digest.digest()[0] % 4]


def _scale(value, factor_code: int, in_place: bool):
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point() or not _plain(value):
            return value
        factor = 1.0 + factor_code * torch.finfo(value.dtype).eps
        if in_place:
            with torch.no_grad():
                value.mul_(factor)
            return value
        return value * factor
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        scaled = [_scale(v, factor_code, in_place) for v in value]
        if type(value) is tuple:
            return tuple(scaled)
        # a namedtuple takes its fields, torch's return types (structseq) a sequence
        return type(value)(*scaled) if hasattr(value, "_fields") else type(value)(scaled)
    return value


class BatchVariantProducts(TorchFunctionMode):
    """While active, every product's and decomposition's rounding depends on its whole
    call (module docstring). ``calls`` counts the calls it scaled."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        watched = func in FUNCTIONAL or func in IN_PLACE
        if watched and not all(_plain(t) for t in _tensors((args, kwargs))):
            watched = False
        code = call_factor_code(func, args, kwargs) if watched else 0
        result = func(*args, **kwargs)
        if not watched:
            return result
        self.calls += 1
        out = kwargs.get("out")
        if out is not None:  # the result was written into ``out``
            _scale(out, code, in_place=True)
            return result
        return _scale(result, code, in_place=func in IN_PLACE)


_installed: BatchVariantProducts | None = None


def install_from_env() -> None:
    """Enter the mode for the whole process where ``HF_SHAMPOO_BATCH_VARIANT`` is set."""
    global _installed
    if os.environ.get(ENV) and _installed is None:
        _installed = BatchVariantProducts()
        _installed.__enter__()
