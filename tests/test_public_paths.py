"""Every import path the documentation shows works, and the moved ones still do, with a
``DeprecationWarning`` that names the new path (CHANGELOG.md): the same objects as the new
module's, from a shim the package itself never imports. Saved state names no module."""

from __future__ import annotations

import importlib
import importlib.util
import pickle
import pickletools
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.package_modules import deprecated_shims, import_graph

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FROM_IMPORT = re.compile(r"from (hf_shampoo(?:\.\w+)*) import ([\w, ()]+)")
IMPORT = re.compile(r"^\s*import (hf_shampoo(?:\.\w+)*)", re.MULTILINE)


def documented_imports() -> list[tuple[str, str | None]]:
    found = set()
    for path in DOCS:
        text = path.read_text()
        for module, names in FROM_IMPORT.findall(text):
            for name in re.split(r"[,\s()]+", names):
                if name and name != "as":
                    found.add((module, name))
        for module in IMPORT.findall(text):
            found.add((module, None))
    return sorted(found, key=lambda pair: (pair[0], pair[1] or ""))


DOTTED = re.compile(r"`(hf_shampoo(?:\.\w+)+)")


def documented_names() -> list[str]:
    """Dotted names the docs write in code spans (``hf_shampoo.checkpoint.save_sharded``)."""
    return sorted({m for path in DOCS for m in DOTTED.findall(path.read_text())})


def resolve(dotted: str):
    """The object a dotted name denotes: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            target = getattr(target, attribute)
        return target
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("dotted", documented_names())
def test_every_dotted_name_in_the_docs_resolves(dotted):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert resolve(dotted) is not None


def test_the_docs_show_imports():
    assert len(documented_imports()) >= 10


@pytest.mark.parametrize(("module", "name"), documented_imports())
def test_every_documented_import_works_without_a_warning(module, name):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        imported = importlib.import_module(module)
        if name is not None:
            assert hasattr(imported, name) or importlib.util.find_spec(
                f"{module}.{name}") is not None, (module, name)


def test_the_moved_checkpoint_path_warns_and_still_works():
    sys.modules.pop("hf_shampoo.distributed_checkpoint", None)
    message = "consolidate_checkpoint from hf_shampoo.checkpoint"
    with pytest.warns(DeprecationWarning, match=message):
        old = importlib.import_module("hf_shampoo.distributed_checkpoint")
    from hf_shampoo.checkpoint import consolidate_checkpoint, load_sharded, save_sharded

    assert (old.save_sharded, old.load_sharded, old.consolidate_checkpoint) == (
        save_sharded, load_sharded, consolidate_checkpoint)


#: old import path → its new home, or homes where its module was split (CHANGELOG.md,
#: "Deprecated"); each old one is removed in 0.3.0
MOVED = {
    "hf_shampoo.pipeline": "hf_shampoo.step",
    "hf_shampoo.stages": "hf_shampoo.update_rules",
    "hf_shampoo.distributors.fsdp": "hf_shampoo.distributors.sharded",
    "hf_shampoo.integrations.modules": ("hf_shampoo.model_rules", "hf_shampoo.factory",
                                        "hf_shampoo.describe_table"),
}


def homes(new: str | tuple[str, ...]) -> tuple[str, ...]:
    return (new,) if isinstance(new, str) else new


def moved_message(old: str, new: str | tuple[str, ...]) -> str:
    """What the shim at ``old`` warns: ``a``, ``a and b``, ``a, b and c``."""
    *first, last = homes(new)
    where = f"{', '.join(first)} and {last}" if first else last
    return f"{old} moved to {where}; the old path is removed in 0.3.0"


def import_anew(old: str):
    """Run the old module again (a second import of a cached module issues nothing)."""
    sys.modules.pop(old, None)
    return importlib.import_module(old)


def test_every_shim_in_the_package_is_tested_here():
    assert set(deprecated_shims()) == {*MOVED, "hf_shampoo.distributed_checkpoint"}


@pytest.mark.parametrize(("old", "new"), MOVED.items())
def test_the_old_path_warns_naming_the_new_one(old, new):
    message = moved_message(old, new)
    with pytest.warns(DeprecationWarning, match=re.escape(message)) as caught:
        import_anew(old)
    assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [message]


@pytest.mark.parametrize(("old", "new"), MOVED.items())
def test_the_old_path_exposes_the_new_modules_objects(old, new):
    """Every name of the new module (of each, where it was split), private ones and
    ``__all__`` included, is the same object under the old path, as an attribute and in
    ``from old import ...``; ``import *`` gives the same names."""
    with pytest.warns(DeprecationWarning):
        moved = import_anew(old)
    new_star: dict = {}
    for home in homes(new):
        module = importlib.import_module(home)
        names = [n for n in vars(module) if not (n.startswith("__") and n.endswith("__"))]
        assert len(names) > 5
        for name in names:  # so a name two homes hold (torch, Any) is one object in both
            assert getattr(moved, name) is getattr(module, name), (home, name)
        if hasattr(module, "__all__"):
            assert moved.__all__ == module.__all__
        else:
            assert not hasattr(moved, "__all__")
        first = names[0]
        imported: dict = {}
        exec(f"from {old} import {first}", imported)
        assert imported[first] is getattr(module, first)
        star: dict = {}
        exec(f"from {home} import *", star)
        del star["__builtins__"]
        assert all(new_star.setdefault(k, v) is v for k, v in star.items()), home
    old_star: dict = {}
    exec(f"from {old} import *", old_star)
    del old_star["__builtins__"]
    assert old_star.keys() == new_star.keys()
    assert all(old_star[k] is new_star[k] for k in new_star)
    with pytest.raises(AttributeError, match=f"module '{old}' has no attribute 'nothing_such'"):
        moved.nothing_such  # noqa: B018


def test_attribute_access_through_the_package_works():
    with pytest.warns(DeprecationWarning):
        import_anew("hf_shampoo.pipeline")
        import_anew("hf_shampoo.distributors.fsdp")
    import hf_shampoo
    from hf_shampoo.distributors.sharded import ShardedDistributor
    from hf_shampoo.step import Layout

    assert hf_shampoo.pipeline.Layout is Layout
    assert hf_shampoo.distributors.fsdp.ShardedDistributor is ShardedDistributor


def test_no_module_of_the_package_imports_a_shim():
    shims = set(deprecated_shims())
    importers = {name: sorted(imported & shims) for name, imported in import_graph().items()
                 if name not in shims and imported & shims}
    assert not importers


STEP_WITHOUT_SHIMS = """
import sys, torch, hf_shampoo, hf_shampoo.step, hf_shampoo.update_rules, hf_shampoo.errors
import hf_shampoo.distributors.sharded, hf_shampoo.checkpoint
w = torch.nn.Parameter(torch.randn(6, 4))
for kind in ("shampoo", "eigenvalue_corrected", "spectral_descent"):
    opt = hf_shampoo.DistributedShampoo([w], lr=0.01, preconditioner=kind,
                                        precondition_frequency=1, momentum=0.5,
                                        weight_decay=0.1, grafting="adam")
    for _ in range(2):
        w.grad = torch.randn(6, 4)
        opt.step()
    opt.load_state_dict(opt.state_dict())
print(sorted(set(sys.argv[1:]) & set(sys.modules)))
"""


def test_importing_and_stepping_issues_no_deprecation_warning():
    """In a fresh process with DeprecationWarning an error: importing the package and its
    renamed modules, steps of three kinds and a state round trip; no shim gets imported."""
    result = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", STEP_WITHOUT_SHIMS,
         *deprecated_shims()], capture_output=True, text=True, timeout=300,
        cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_exceptions_live_in_errors_and_keep_their_old_homes():
    from hf_shampoo import CheckpointError, ShampooNumericalError, checkpoint, errors, stack
    from hf_shampoo.checkpoint import integrity

    assert ShampooNumericalError is errors.ShampooNumericalError is stack.ShampooNumericalError
    assert CheckpointError is errors.CheckpointError is integrity.CheckpointError
    assert CheckpointError is checkpoint.CheckpointError
    assert integrity.ADVICE == errors.CHECKPOINT_ADVICE
    assert issubclass(ShampooNumericalError, RuntimeError)
    assert issubclass(CheckpointError, ValueError)


def test_make_optimizer_is_where_the_docs_say():
    """``hf_shampoo.make_optimizer`` and ``hf_shampoo.describe`` are the functions of
    ``factory.py`` and ``describe_table.py``."""
    import hf_shampoo
    from hf_shampoo import describe_table, factory

    assert hf_shampoo.make_optimizer is factory.make_optimizer
    assert hf_shampoo.describe is describe_table.describe


def _pickled_modules(obj) -> set[str]:
    """The modules a pickle of ``obj`` names (its GLOBAL / STACK_GLOBAL references)."""
    found, strings = set(), []
    for opcode, arg, _ in pickletools.genops(pickle.dumps(obj)):
        if opcode.name == "GLOBAL":
            found.add(arg.split(" ")[0])
        elif opcode.name == "STACK_GLOBAL":
            found.add(strings[-2])
        if isinstance(arg, str):
            strings.append(arg)
    return found


def test_saved_state_names_no_module_of_the_package():
    """A checkpoint (``state_dict()``, with a delayed refresh pending) pickles no class of
    the package, so that moving a module never breaks loading one; pickling the optimizer
    itself names only ``hf_shampoo.optimizer`` (its class)."""
    from hf_shampoo import DistributedShampoo

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 6)), torch.nn.Parameter(torch.randn(6))]
    opt = DistributedShampoo(params, lr=0.01, grafting="adam", precondition_frequency=2,
                             momentum=0.5, refresh_delay=1)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    state = opt.state_dict()
    assert not {m for m in _pickled_modules(state) if m.split(".")[0] == "hf_shampoo"}
    assert {m for m in _pickled_modules(opt) if m.split(".")[0] == "hf_shampoo"} == {
        "hf_shampoo.optimizer"}
