"""The package's import graph: modules import downward only, never in a circle, and every
module opens with a docstring saying its role (docs/README.md's package layout)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[1] / "hf_shampoo"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Module → the package modules it imports (at any depth of its code)."""
    modules = _modules()
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


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_in_the_package():
    assert cycles(import_graph()) == []


def test_distributors_import_only_their_base():
    """The siblings import the interface (base), the placement facts (placements) and the
    ranks they spread blocks over (groups); zero.py is the sharded distributor over
    DeepSpeed's partitions, so it adds sharded, and local.py (fsdp_mode="local") is one
    process per shard, so it adds single; agreement.py (ranks hold the same parameters)
    reads placements only, groups.py too."""
    graph = import_graph()
    shared = {"hf_shampoo.distributors.base", "hf_shampoo.distributors.placements",
              "hf_shampoo.distributors.groups"}
    allowed = {"single": shared, "ddp": shared, "sharded": shared, "placements": set(),
               "agreement": {"hf_shampoo.distributors.placements"},
               "groups": {"hf_shampoo.distributors.placements"},
               "zero": shared | {"hf_shampoo.distributors.sharded"},
               "local": shared | {"hf_shampoo.distributors.single"}}
    for sibling, may in allowed.items():
        imported = {m for m in graph[f"hf_shampoo.distributors.{sibling}"]
                    if m.startswith("hf_shampoo.distributors")}
        assert imported <= may, (sibling, imported)


def test_every_module_opens_with_its_role():
    for name, path in _modules().items():
        docstring = ast.get_docstring(ast.parse(path.read_text()))
        assert docstring and len(docstring.split()) >= 5, name
