"""Launcher for unmodified scripts: register ``hf_shampoo``'s optimizers, then run the script.

    python -m hf_shampoo.run SCRIPT.py [ARGS...]
    python -m hf_shampoo.run -m PACKAGE.MODULE [ARGS...]
    torchrun --nproc_per_node 2 -m hf_shampoo.run SCRIPT.py [ARGS...]
    accelerate launch -m hf_shampoo.run SCRIPT.py [ARGS...]

The script runs as ``__main__`` with ``sys.argv = [SCRIPT.py, ARGS...]``, so Hugging Face
example scripts accept ``--optim distributed_shampoo --optim_args "..."`` untouched (timm's
``--opt shampoo`` likewise). Registration is lazy: nothing is imported that the script would
not import itself.
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = (
    "usage: python -m hf_shampoo.run SCRIPT.py [ARGS...]\n"
    "       python -m hf_shampoo.run -m MODULE [ARGS...]\n"
    "Registers optim='distributed_shampoo' (transformers) and opt='shampoo' (timm), then runs\n"
    "the script as __main__ with its own arguments."
)


def register_all() -> None:
    """Arrange registration with every library hf_shampoo adapts (each one lazily)."""
    from .integrations import transformers as hf_transformers

    hf_transformers.register_on_import()
    try:
        from .integrations import timm as hf_timm
    except ImportError:  # pragma: no cover - the timm adapter ships with the package
        return
    register = getattr(hf_timm, "register_on_import", None)
    if register is not None:
        register()


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    register_all()
    if argv[0] == "-m":
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            raise SystemExit(2)
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]  # runpy replaces argv[0] with the module's path
        sys.path.insert(0, os.getcwd())  # as `python -m MODULE` does
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, args = argv[0], argv[1:]
    if not os.path.isfile(script):
        print(f"hf_shampoo.run: no such script: {script}\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT.py` does
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
