"""The vocabulary of the keyword table: a ``Keyword`` row and the checks rows are built from.

A row says everything about one keyword of ``DistributedShampoo``: its default, the type
``optim_args`` casts a string to, the check of a value on its own, its scope (``"global"``:
one value for the whole optimizer; ``"runtime"``: not loaded from a checkpoint;
``"layout"``: fixed once state exists) and the sentence of docs/keywords.md. The common
rows are in ``config.py``; each preconditioner kind declares its own (``preconditioners/``),
and ``config.py`` joins them into the table everything else is generated from
(docs/design.md §7). Checks raise ``ValueError`` naming the keyword, the value and what is
allowed. This module imports nothing of the package.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

Check = Callable[[str, Any], None]


@dataclass(frozen=True)
class Keyword:
    """One keyword: ``name``, ``default``, the ``type`` of its values (``optim_args`` casts
    to it; ``nullable``: ``None`` is valid too), the ``check`` of one value, its ``scope``,
    its ``doc`` (the meaning column of docs/keywords.md) and, where ``type`` says too little
    for a type checker (``tuple``, ``dict``), the constructor's ``annotation``."""

    name: str
    default: Any
    type: Any
    check: Check | None
    doc: str
    scope: frozenset[str] = frozenset()
    nullable: bool | None = None  # None: whether the default is None
    annotation: str | None = None  # None: from ``type``

    @property
    def hint(self) -> str:
        """The annotation of the constructor's parameter (source text): ``annotation`` or
        the name of ``type``, ``| None`` where ``None`` is valid."""
        hint = self.annotation or type_name(self.type)
        return f"{hint} | None" if self.optional else hint

    @property
    def optional(self) -> bool:
        """Whether ``None`` is a valid value."""
        return self.default is None if self.nullable is None else self.nullable

    def validate(self, value: Any) -> None:
        """Raise ``ValueError`` if ``value`` is not valid for this keyword on its own."""
        if value is None and self.optional:
            return
        if self.check is not None:
            self.check(self.name, value)


def fail(key: str, value: Any, allowed: str) -> None:
    """Raise the package's ``ValueError`` for ``key=value``, saying what is ``allowed``."""
    raise ValueError(f"DistributedShampoo: invalid {key}={value!r}; {allowed}")


def did_you_mean(name: Any, choices: Iterable[Any]) -> str:
    """`` (did you mean 'x'?)`` with the closest of ``choices`` to ``name``, or ``""``."""
    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def is_real(value: Any) -> bool:
    """A finite real number (not a bool)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_real(key: str, value: Any, low: float, high: float = math.inf,
               low_open: bool = False, high_open: bool = False) -> None:
    ok = is_real(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (
            value < high if high_open else value <= high)
    if not ok:
        if high == math.inf:
            fail(key, value, f"expected a finite real number {'>' if low_open else '>='} {low}")
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        fail(key, value, f"expected a finite real number in {lo}{low}, {high}{hi}")


def check_int(key: str, value: Any, low: int) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
        fail(key, value, f"expected an integer >= {low}")


def check_choice(key: str, value: Any, choices: Iterable[Any]) -> None:
    choices = tuple(choices)
    if value not in choices:
        fail(key, value, f"expected one of {', '.join(repr(c) for c in choices)}"
             f"{did_you_mean(value, choices) if isinstance(value, str) else ''}")


def real(low: float, high: float = math.inf, low_open: bool = False,
         high_open: bool = False) -> Check:
    """A finite real number in the given interval."""
    return lambda key, value: check_real(key, value, low, high, low_open, high_open)


def integer(low: int) -> Check:
    """An integer ``>= low`` (not a bool)."""
    return lambda key, value: check_int(key, value, low)


def choice(*choices: Any) -> Check:
    """One of ``choices`` (``None`` among them for a keyword whose default is None)."""
    return lambda key, value: check_choice(key, value, choices)


def boolean(meaning: str = "") -> Check:
    """``True`` or ``False`` (``meaning``: what they mean, for the message)."""
    def check(key: str, value: Any) -> None:
        if not isinstance(value, bool):
            fail(key, value, f"expected True{meaning} or False")
    return check


def dtype_choice(*dtypes: torch.dtype) -> Check:
    """One of ``dtypes``."""
    return choice(*dtypes)


#: the dtypes a keyword may name for the dtype some computation runs in (``working_dtype``)
WORKING_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def working_dtype(name: str, doc: str, scope: frozenset[str] = frozenset()) -> Keyword:
    """The row of a keyword naming the dtype some computation runs in: ``None`` (by
    default: another keyword's dtype, as ``doc`` says) or one of ``WORKING_DTYPES``."""
    return Keyword(name, None, torch.dtype, choice(None, *WORKING_DTYPES), scope=scope, doc=doc)


def scoped(*names: str) -> frozenset[str]:
    """A row's scope: ``"global"``, ``"runtime"``, ``"layout"``."""
    unknown = set(names) - {"global", "runtime", "layout"}
    if unknown:
        raise ValueError(f"unknown keyword scope(s) {sorted(unknown)}")
    return frozenset(names)


def render_default(value: Any) -> str:
    """A default as docs/keywords.md writes it."""
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, torch.dtype):
        return str(value)
    return repr(value).replace("e-0", "e-")


def type_name(kind: Any) -> str:
    """A type as an annotation writes it: ``float``, ``torch.dtype``, ``bool | dict``."""
    if isinstance(kind, type):
        module = "" if kind.__module__ == "builtins" else f"{kind.__module__}."
        return module + kind.__name__
    return str(kind)


def render_source(value: Any) -> str:
    """A default as Python source writes it (the generated signature)."""
    if isinstance(value, str) and '"' not in value and "\\" not in value:
        return f'"{value}"'
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, tuple):
        return "(" + ", ".join(map(render_source, value)) + ("," if len(value) == 1 else "") + ")"
    return repr(value).replace("e-0", "e-")


def render_table(rows: Iterable[Keyword]) -> str:
    """The markdown table of docs/keywords.md: keyword, default, meaning."""
    lines = ["| keyword | default | meaning |", "|---|---|---|"]
    lines += [f"| `{row.name}` | `{render_default(row.default)}` | {row.doc} |" for row in rows]
    return "\n".join(lines) + "\n"
