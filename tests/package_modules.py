"""The package's modules read from its source tree, for the layout tests
(tests/test_package_layout.py, tests/test_public_paths.py): every module of ``hf_shampoo``
and its file, the import graph between them, and the deprecated shims (the modules that
warn with a ``DeprecationWarning`` when imported)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hf_shampoo"


def package_modules() -> dict[str, Path]:
    """Module name → its file, for every module of the package (a package: its
    ``__init__.py``)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Module → the package modules it imports (at any depth of its code)."""
    modules = package_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1])
                    target = f"{base}.{node.module}" if node.module else base
                else:
                    target = node.module or ""
                # "from . import x" imports the submodule x, not the package's own code
                candidates = [target] if node.module else []
                candidates += [f"{target}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            graph[name] |= {c for c in candidates if c in modules and c != name}
    return graph


def _warns_deprecation(node: ast.stmt) -> bool:
    """Whether a statement is a call of ``warn(..., DeprecationWarning, ...)``."""
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
        return False
    call = node.value
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(
        call.func, "id", None)
    arguments = [*call.args, *(k.value for k in call.keywords)]
    return name == "warn" and any(isinstance(a, ast.Name) and a.id == "DeprecationWarning"
                                  for a in arguments)


def deprecated_shims() -> dict[str, Path]:
    """The modules kept only as old import paths: those that warn with a
    ``DeprecationWarning`` when imported (a ``warn`` call at module level)."""
    return {name: path for name, path in package_modules().items()
            if any(_warns_deprecation(node) for node in ast.parse(path.read_text()).body)}
