"""The package's import graph: modules import downward only, never in a circle; every
module opens with a docstring saying its role; and docs/design.md §12's module map lists
exactly the modules and subpackages in the tree (the deprecated shims apart, in the note
below the map)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.package_modules import PACKAGE, deprecated_shims, import_graph, package_modules

pytestmark = pytest.mark.unit

DESIGN = PACKAGE.parent / "docs" / "design.md"


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
    """The siblings import the interface (base), the placement facts (placements), the
    ranks they spread blocks over (groups) and the collectives by which ranks agree
    (collectives, which imports none of them); zero.py is the sharded distributor over
    DeepSpeed's partitions, so it adds sharded, and local.py (fsdp_mode="local") is one
    process per shard, so it adds single; agreement.py (ranks hold the same parameters)
    reads placements only, groups.py too."""
    graph = import_graph()
    collectives = {"hf_shampoo.distributors.collectives"}
    shared = {"hf_shampoo.distributors.base", "hf_shampoo.distributors.placements",
              "hf_shampoo.distributors.groups"} | collectives
    allowed = {"single": shared, "ddp": shared, "sharded": shared, "placements": collectives,
               "collectives": set(),
               "agreement": {"hf_shampoo.distributors.placements"} | collectives,
               "groups": {"hf_shampoo.distributors.placements"} | collectives,
               "zero": shared | {"hf_shampoo.distributors.sharded"},
               "local": shared | {"hf_shampoo.distributors.single"}}
    for sibling, may in allowed.items():
        imported = {m for m in graph[f"hf_shampoo.distributors.{sibling}"]
                    if m.startswith("hf_shampoo.distributors")}
        assert imported <= may, (sibling, imported)


def test_every_module_opens_with_its_role():
    for name, path in package_modules().items():
        docstring = ast.get_docstring(ast.parse(path.read_text()))
        assert docstring and len(docstring.split()) >= 5, name


# ---------------------------------------------------------------- the module map


def _relative(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def tree_entries() -> set[str]:
    """What the map must list: every ``hf_shampoo/**/*.py`` but ``__init__.py`` and the
    deprecated shims, and every subpackage (``hf_shampoo/checkpoint/``)."""
    shims = set(deprecated_shims().values())
    entries = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__init__.py":
            if path.parent != PACKAGE:
                entries.add(_relative(path.parent) + "/")
        elif path not in shims:
            entries.add(_relative(path))
    return entries


def section_12() -> str:
    text = DESIGN.read_text()
    start = text.index("\n## 12. Module map\n")
    return text[start:text.index("\n## ", start + 1)]


#: a map line starting at this column or further continues the description above it
DESCRIPTION_COLUMN = 16


def module_map() -> list[str]:
    """The entries of §12's ``text`` block as paths (``hf_shampoo/distributors/sharded.py``,
    ``hf_shampoo/checkpoint/``): a name two spaces deeper than the subpackage it belongs to,
    then its description, whose further lines start at ``DESCRIPTION_COLUMN`` or beyond."""
    block = re.search(r"```text\n(.*?)```", section_12(), re.S)
    assert block, "docs/design.md §12 has no ```text block"
    lines = block.group(1).splitlines()
    assert lines[0] == "hf_shampoo/", lines[0]
    folders, entries = ["hf_shampoo"], []
    for line in lines[1:]:
        indent = len(line) - len(line.lstrip(" "))
        if indent >= DESCRIPTION_COLUMN:
            assert entries, line
            continue
        depth, odd = divmod(indent, 2)
        assert not odd and 1 <= depth <= len(folders), f"misplaced map line: {line!r}"
        name = line.split()[0]
        del folders[depth:]
        entries.append("/".join(folders) + "/" + name)
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
    return entries


def noted_shims() -> set[str]:
    """The shims named in §12's note below the map (``hf_shampoo/pipeline.py`` → ...)."""
    note = section_12().split("```text", 1)[1].split("```", 1)[1]
    return set(re.findall(r"`(hf_shampoo/[\w/]+\.py)` →", note))


def test_the_shims_are_found():
    shims = deprecated_shims()
    assert "hf_shampoo.distributed_checkpoint" in shims
    assert "hf_shampoo.step" not in shims and "hf_shampoo" not in shims


def test_the_module_map_reads_its_entries():
    entries = module_map()
    assert "hf_shampoo/step.py" in entries and "hf_shampoo/preconditioners/" in entries
    assert "hf_shampoo/integrations/transformers/trainer.py" in entries
    assert "hf_shampoo/py.typed" in entries


def test_the_module_map_lists_exactly_the_modules_in_the_tree():
    """docs/design.md §12, the one module map: every module but ``__init__.py`` and the
    shims, every subpackage, each once; other entries (``py.typed``) must exist."""
    entries = module_map()
    assert len(entries) == len(set(entries)), sorted(e for e in entries if entries.count(e) > 1)
    listed = {e for e in entries if e.endswith((".py", "/"))}
    tree = tree_entries()
    assert not listed - tree, f"in the map, not in the tree: {sorted(listed - tree)}"
    assert not tree - listed, f"in the tree, not in the map: {sorted(tree - listed)}"
    for other in set(entries) - listed:
        assert (PACKAGE.parent / other).is_file(), other


def test_the_map_leaves_the_shims_to_its_note():
    """The deprecated shims are not in the map; the note below it names exactly them."""
    shims = {_relative(path) for path in deprecated_shims().values()}
    assert not shims & set(module_map())
    assert noted_shims() == shims


# ---------------------------------------------------------------- benchmarks/


def test_benchmarks_readme_lists_every_script_and_shared_module():
    """benchmarks/README.md's tables name every ``benchmarks/*.py`` (but ``__init__.py``),
    and every script and module there opens with what it measures or holds."""
    folder = PACKAGE.parent / "benchmarks"
    listed = set(re.findall(r"^\| `(\w+\.py)` \|", (folder / "README.md").read_text(), re.M))
    present = {path.name for path in folder.glob("*.py")} - {"__init__.py"}
    assert present - listed == set(), "not in benchmarks/README.md"
    assert listed - present == set(), "listed in benchmarks/README.md, not in benchmarks/"
    for name in present:
        docstring = ast.get_docstring(ast.parse((folder / name).read_text()))
        assert docstring and len(docstring.split()) >= 5, name
