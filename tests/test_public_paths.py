"""Every import path the documentation shows works, and the moved ones still do, with a
``DeprecationWarning`` that names the new path (CHANGELOG.md)."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import warnings
from pathlib import Path

import pytest

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
