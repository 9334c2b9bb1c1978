"""Run code right after given modules are imported, without importing them here.

The integrations register ``hf_shampoo`` with transformers and timm this way, so that
``import hf_shampoo`` stays light and either import order works.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from types import ModuleType

Callback = Callable[[str, ModuleType], object]


def call_after_import(names: Iterable[str], callback: Callback, library: str) -> None:
    """``callback(name, module)`` for each module of ``names``: now for those already
    imported, right after their code has run for the others. A failing callback warns
    instead of breaking an import; calling again with the same callback adds no second
    hook."""
    pending = []
    for name in names:
        module = sys.modules.get(name)
        if module is None:
            pending.append(name)
        else:
            _call(callback, name, module, library)
    if pending and not any(
        isinstance(f, _AfterImport) and f.callback is callback for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _AfterImport(pending, callback, library))


def _call(callback: Callback, name: str, module: ModuleType, library: str) -> None:
    try:
        callback(name, module)
    except Exception as error:  # noqa: BLE001 - never break an import
        warnings.warn(f"hf_shampoo: could not register with {library}: {error}", stacklevel=3)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wraps the loader of each pending module so that the callback runs right after the
    module executes; removes itself once no module is pending."""

    def __init__(self, names: Iterable[str], callback: Callback, library: str) -> None:
        self.pending = set(names)
        self.callback, self.library = callback, library
        self._busy = threading.local()  # the find_spec below re-enters this finder

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.on = False
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_call(module: ModuleType) -> None:
            exec_module(module)
            self.pending.discard(fullname)
            if not self.pending and self in sys.meta_path:
                sys.meta_path.remove(self)
            _call(self.callback, fullname, module, self.library)

        loader.exec_module = exec_then_call  # this module's loader instance only
        return spec
