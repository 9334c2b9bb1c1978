"""Registration with an optional library as its modules load (timm's optimizer factory,
transformers' Trainer modules), so that ``import hf_shampoo`` never imports the library
itself, whichever of the two is imported first: the one import hook ``timm.py`` and
``transformers/registration.py`` share. A failure to register warns, never breaks an
import.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
import warnings
from collections.abc import Callable, Collection
from typing import Any

#: ``action(fullname, module)``: what to do with a module once it has executed
Action = Callable[[str, Any], None]


def warn_on_failure(library: str, action: Action, fullname: str, module: Any) -> None:
    """``action(fullname, module)``; a failure is a warning naming ``library``."""
    try:
        action(fullname, module)
    except Exception as error:  # noqa: BLE001 - never break an import
        warnings.warn(f"hf_shampoo: could not register with {library}: {error}", stacklevel=3)


class AfterImport(importlib.abc.MetaPathFinder):
    """Import hook: runs ``action`` on each of ``modules`` right after it has executed
    (those ``done`` says need nothing are left alone), and leaves ``sys.meta_path`` once
    every one has had it."""

    def __init__(
        self, library: str, modules: Collection[str], action: Action, done: Callable[[str], bool]
    ) -> None:
        self.library, self.modules, self.action, self.done = library, modules, action, done
        self._ran: set[str] = set()
        self._busy = threading.local()

    def _finished(self, fullname: str) -> bool:
        return fullname in self._ran or self.done(fullname)

    def find_spec(self, fullname, path, target=None):
        if (
            fullname not in self.modules
            or self._finished(fullname)
            or getattr(self._busy, "on", False)
        ):
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

        def exec_then_act(module):
            exec_module(module)
            self._ran.add(fullname)
            warn_on_failure(self.library, self.action, fullname, module)
            if all(self._finished(name) for name in self.modules) and self in sys.meta_path:
                sys.meta_path.remove(self)

        loader.exec_module = exec_then_act  # this module's loader instance only
        return spec


def on_import(
    library: str,
    modules: Collection[str],
    action: Action,
    done: Callable[[str], bool] = lambda fullname: False,
) -> None:
    """Run ``action`` on each of ``library``'s ``modules`` already loaded now, and on the
    others right after they load (one ``AfterImport`` hook per library). Costs nothing
    where the library is not installed."""
    if importlib.util.find_spec(library) is None:
        return
    waiting = False
    for fullname in modules:
        module = sys.modules.get(fullname)
        if module is not None:
            warn_on_failure(library, action, fullname, module)
        else:
            waiting = True
    if waiting and not any(
        isinstance(f, AfterImport) and f.library == library for f in sys.meta_path
    ):
        sys.meta_path.insert(0, AfterImport(library, modules, action, done))
