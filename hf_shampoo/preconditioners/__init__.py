"""Preconditioner kinds, one module each, behind the interface of ``base.Preconditioner``.

``KINDS`` maps the ``preconditioner`` keyword's values to the kinds; ``kind_of(group)``
picks a group's. A kind owns its configuration (its keyword rows, cross-keyword rules,
refreshes, start step, exponents: ``base.Preconditioner``), so a new kind is a module here
and one entry in ``KINDS`` below; ``config.py`` builds the keyword table from them
(docs/design.md §7).
"""

from __future__ import annotations

from .base import KroneckerFactored, Preconditioner
from .diagonal import Diagonal
from .eigendecomposed import EigendecomposedKLShampoo, EigendecomposedShampoo
from .eigenvalue_corrected import EigenvalueCorrected
from .kl_shampoo import KLShampoo
from .quantized import (
    QuantizedEigendecomposedShampoo,
    QuantizedEigenvalueCorrected,
    QuantizedShampoo,
)
from .riemannian_lora import RiemannianLoRA
from .shampoo import Shampoo
from .sign_descent import SignDescent
from .sketchy import Sketchy
from .spectral_descent import SpectralDescent

KINDS: dict[str, Preconditioner] = {
    kind.name: kind for kind in (Shampoo(), EigenvalueCorrected(), Diagonal(), KLShampoo(),
                                 SpectralDescent(), SignDescent(), EigendecomposedShampoo(),
                                 EigendecomposedKLShampoo(), RiemannianLoRA(), Sketchy())
}
# quantization="4bit": the kinds that keep their factors in 4 bits (the others have none)
QUANTIZED_KINDS: dict[str, Preconditioner] = {
    kind.name: kind for kind in (QuantizedShampoo(), QuantizedEigenvalueCorrected(),
                                 QuantizedEigendecomposedShampoo())
}


def kind_of(group: dict) -> Preconditioner:
    """The preconditioner kind of a parameter group."""
    if group.get("quantization") == "4bit" and group["preconditioner"] in QUANTIZED_KINDS:
        return QUANTIZED_KINDS[group["preconditioner"]]
    return KINDS[group["preconditioner"]]


__all__ = ["KINDS", "QUANTIZED_KINDS", "KroneckerFactored", "Preconditioner", "kind_of"]
