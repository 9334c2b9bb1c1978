"""``compile=True``: the step's elementwise stages compiled with ``torch.compile``.

``stages_for(group)`` gives ``BlockStack.direction`` the stages it runs: the
``update_rules`` module itself (eager, ``compile=False``), or a ``CompiledStages`` with the
same functions for docs/design.md §2 lines 3 and 5–8 (grafting state, grafting, weight
decay, momentum, ``-lr``), each one ``torch.compile``d kernel over the stack: one pass over
memory where eager torch makes one per operation. Everything else, the preconditioner
kinds' statistics, eigendecompositions, QR, root solves and preconditioning products,
stays eager, as Meta's ``ShampooPT2CompileConfig`` leaves preconditioning out of its graph.

Line 4, the filtered gradient ``Ĝ``, stays eager too: it is what the preconditioner
multiplies, and it must be eager's to the last bit. A fused kernel rounded ``β1 M +
(1-β1) G`` three times where eager's ``add_(alpha=)`` is one FMA (on CPU and CUDA; inductor
emits one only on GPUs): a last-bit difference in ``Ĝ``. But at a refresh ``Ĝ`` lies in
the range of the factor matrices it was accumulated in, and while they are rank-deficient
(fewer steps than dims) the root ``(F + εI)^(-1/r)`` multiplies the rounding noise
outside that range by up to ``ε^(-1/r)``: with the default ε = 1e-12, 1e-7 relative noise
in float32 became 2e-3 to 5e-2 of a block's direction, 1e-16 in float64 2e-10.

How the kernels avoid recompiling:

- every tensor is passed as ``(n, numel)`` rows (the blocks of a stack), so stacks of
  any block order share a graph; the second shape makes the sizes symbolic (torch's
  automatic dynamic shapes), after which one graph serves every stack;
- the coefficients (``β2``, ``μ``, the bias correction, ``-lr``, the decay factor) are computed in
  Python as in ``update_rules.py`` and passed as 0-dim float64 CPU tensors, so a learning
  rate schedule or the step counter never recompiles; only the settings that choose a branch
  (grafting method, momentum on or off, ...) are part of a graph.

A call the kernels do not cover (a non-contiguous tensor) runs ``update_rules.py``'s
function.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor

from . import update_rules


def compile_options(value: Any) -> dict[str, Any] | None:
    """The ``torch.compile`` keyword arguments of a ``compile`` value (None: eager)."""
    if value is False:
        return None
    return {} if value is True else dict(value)


def compile_parameters() -> list[str]:
    """The keyword arguments ``torch.compile`` takes besides the function."""
    return [name for name in inspect.signature(torch.compile).parameters if name != "model"]


def _scalar(value: float) -> Tensor:
    return torch.tensor(value, dtype=torch.float64, device="cpu")


def _rows(t: Tensor) -> Tensor:
    """``t`` as ``(n, numel / n)`` on the same memory. Not a view: a view would carry its
    base's shape into the graph's guards, one graph per base shape."""
    n = t.shape[0]
    m = t.numel() // n if n else 0
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), (n, m), (m, 1))


def _flat(*tensors: Tensor | None) -> bool:
    """Whether every tensor can be seen as rows without a copy."""
    return all(t is None or t.is_contiguous() for t in tensors)


# ---------------------------------------------------------------- the kernels (rows)
def _second_moment(v: Tensor, g: Tensor, beta2: Tensor, weight: Tensor) -> None:
    """Line 3: ``V = β2 V + w G²``."""
    v.copy_(v * beta2 + g * g * weight)


def _graft(v: Tensor, x: Tensor, out: Tensor, bias: Tensor, eps: Tensor) -> None:
    """Line 5's grafting direction ``x / (sqrt(V / bias) + ε)``."""
    out.copy_(x / ((v / bias).sqrt() + eps))


def _finish(direction: Tensor, scale: Tensor | None, param: Tensor | None,
            buf: Tensor | None, out: Tensor, alpha: Tensor, mu: Tensor, damp: Tensor,
            neg_lr: Tensor, nesterov: bool) -> None:
    """Lines 6–8: ``out = -lr · momentum(scale · P + α W)`` (``buf``: momentum)."""
    d = direction if scale is None else direction * scale
    if param is not None:
        d = d + param * alpha
    if buf is not None:
        new = buf * mu + d * (1.0 - damp)
        buf.copy_(new)
        d = d * (1.0 - damp) + new * mu if nesterov else new
    out.copy_(d * neg_lr)


def _finish_scaled(direction: Tensor, scale: Tensor, out: Tensor, neg_lr: Tensor) -> None:
    """Lines 5–8 without decay or momentum: ``out = P · (scale · -lr)`` (as eager)."""
    out.copy_(direction * (scale * neg_lr))


KERNELS = ("_second_moment", "_graft", "_finish", "_finish_scaled")


# ---------------------------------------------------------- update_rules.py's interface
class CompiledStages:
    """``update_rules.py``'s functions for lines 3 and 5–8, run by the compiled kernels; any
    other name (line 4's ``filtered_gradient`` among them) is the module's own (eager)
    function."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        self.kernels = {name: torch.compile(globals()[name], **options) for name in KERNELS}

    def __getattr__(self, name: str) -> Any:
        return getattr(update_rules, name)

    def update_grafting_state(self, state: dict, group, grad: Tensor) -> None:
        grafting, beta2 = group["grafting"], group["grafting_beta2"]
        if grafting not in ("adagrad", "rmsprop", "adam"):
            return
        v = state["grafting_state"]
        if not _flat(v, grad):
            return update_rules.update_grafting_state(state, group, grad)
        beta2, weight = (1.0, 1.0) if grafting == "adagrad" else (beta2, 1.0 - beta2)
        self.kernels["_second_moment"](_rows(v), _rows(grad), _scalar(beta2), _scalar(weight))

    def graft(self, state: dict, group, step: int, x: Tensor, out: Tensor) -> Tensor:
        grafting = group["grafting"]
        if grafting in (None, "sgd"):
            return x
        v = state["grafting_state"]
        if not _flat(v, x, out):
            return update_rules.graft(state, group, step, x, out)
        self.kernels["_graft"](_rows(v), _rows(x), _rows(out), self._graft_bias(group, step),
                               _scalar(group["grafting_epsilon"]))
        return out

    @staticmethod
    def _graft_bias(group, step: int) -> Tensor:
        adam = group["grafting"] == "adam"
        return _scalar(1.0 - group["grafting_beta2"] ** step if adam else 1.0)

    def apply_grafting(self, state: dict, group, step: int, direction: Tensor,
                       filtered: Tensor, grafting_rows: list[int], out: Tensor,
                       norms: list | None = None) -> Tensor | None:
        """``update_rules.apply_grafting`` with the grafting direction by the compiled kernel;
        the norms stay eager: torch's float32 norm of a large block is off by a few 1e-6 (its
        summation order), and a fused sum in another order would not give eager's
        numbers."""
        return update_rules.apply_grafting(state, group, step, direction, filtered,
                                           grafting_rows, out, graft_fn=self.graft,
                                           norms=norms)

    def finish_direction(self, state: dict, group, direction: Tensor, scale: Tensor | None,
                         owned: bool, param: Tensor | None, lr: float, out: Tensor,
                         copy_into: Tensor) -> None:
        alpha = update_rules.folded_decay_factor(group)
        mu = group["momentum"]
        buf = state["momentum"] if mu > 0 else None
        param = update_rules.stacked(param, direction.dtype) if alpha is not None else None
        if not _flat(direction, scale, param, buf, out):
            return update_rules.finish_direction(state, group, direction, scale, owned, param,
                                                 lr, out, copy_into)
        if alpha is None and buf is None and scale is not None:
            self.kernels["_finish_scaled"](_rows(direction), _rows(scale), _rows(out),
                                           _scalar(-lr))
            return
        self.kernels["_finish"](
            _rows(direction), None if scale is None else _rows(scale),
            None if param is None else _rows(param), None if buf is None else _rows(buf),
            _rows(out), _scalar(alpha or 0.0), _scalar(mu), _scalar(group["dampening"]),
            _scalar(-lr), bool(group["nesterov"]))


def graph_counts() -> dict[str, int]:
    """Kernel name → graphs torch.compile holds for it in this process (its recompile
    limit, ``torch._dynamo.config.recompile_limit``, is per kernel)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return {name: len(_debug_get_cache_entry_list(globals()[name].__code__))
            for name in KERNELS}


_COMPILED: dict[str, CompiledStages] = {}  # repr of the options → their compiled stages


def stages_for(group) -> Any:
    """The stages a step of this group runs: ``update_rules`` (``compile=False``) or the
    compiled stages of its ``compile`` options (made once per process and options)."""
    options = compile_options(group["compile"])
    if options is None:
        return update_rules
    key = repr(sorted(options.items()))
    if key not in _COMPILED:
        _COMPILED[key] = CompiledStages(options)
    return _COMPILED[key]
