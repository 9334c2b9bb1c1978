"""Optional dependencies: which extra of ``pip install 'hf_shampoo[...]'`` brings each library
the integrations use, and ``require()``, which imports one or says which extra to install.

torch is the only hard requirement: the optimizer, checkpoints and ``describe`` need nothing
else, and ``import hf_shampoo`` never imports another library. The Trainer hook, the
Accelerate helpers, timm's registry and the benchmarks' plots call ``require()`` when used,
so a missing library is an ``ImportError`` naming the extra (pyproject.toml's
``[project.optional-dependencies]``; ``tests/test_torch_only.py`` checks both sides).
"""

from __future__ import annotations

import importlib
from types import ModuleType

# top-level module -> (its distribution's name, the extra that installs it)
EXTRAS: dict[str, tuple[str, str]] = {
    "transformers": ("transformers", "transformers"),
    "accelerate": ("accelerate", "accelerate"),
    "timm": ("timm", "timm"),
    "torchvision": ("torchvision", "timm"),
    "peft": ("peft", "peft"),
    "deepspeed": ("deepspeed", "deepspeed"),
    "datasets": ("datasets", "examples"),
    "sklearn": ("scikit-learn", "examples"),
    "matplotlib": ("matplotlib", "examples"),
}


def install_hint(module: str) -> str:
    """``pip install 'hf_shampoo[EXTRA]'`` for a top-level module of ``EXTRAS``."""
    _, extra = EXTRAS[module.partition(".")[0]]
    return f"pip install 'hf_shampoo[{extra}]'"


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` (a library of ``EXTRAS``, or one of its submodules) for ``feature``.

    When the library is not installed, raises ``ImportError`` saying what needs it and which
    extra installs it. An ``ImportError`` from inside an installed library (one of *its*
    dependencies missing, a broken install) or for a submodule that the installed version
    lacks is raised unchanged.
    """
    top = module.partition(".")[0]
    distribution, _ = EXTRAS[top]
    try:
        return importlib.import_module(module)
    except ImportError as error:
        if error.name != top:
            raise
        raise ImportError(
            f"{feature} needs {distribution}, which is not installed: {install_hint(top)}",
            name=module,
        ) from error
