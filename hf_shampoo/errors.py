"""The package's public exception types, in one module that imports nothing of the package.

``ShampooNumericalError`` (a ``RuntimeError``) is raised when a gradient or a factor matrix
is not finite or an eigendecomposition keeps failing (docs/keywords.md, "Numerical
failures"); ``CheckpointError`` (a ``ValueError``) when a checkpoint is missing, cut short or
damaged (docs/checkpoints.md, "Faults"). Both are also ``hf_shampoo.ShampooNumericalError``
and ``hf_shampoo.CheckpointError``, and the modules that defined them before,
``hf_shampoo.stack`` and ``hf_shampoo.checkpoint.integrity``, still export the same classes.
"""

from __future__ import annotations

import os

__all__ = ["CHECKPOINT_ADVICE", "CheckpointError", "ShampooNumericalError"]

#: what a ``CheckpointError`` tells a person to do unless the raiser says otherwise
CHECKPOINT_ADVICE = (
    "resume from the previous complete checkpoint instead (this one is left as it is)")


class ShampooNumericalError(RuntimeError):
    """A factor matrix became non-finite, or its eigendecomposition kept failing."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is: missing, cut short or damaged.

    ``checkpoint`` is the directory, ``file`` the file at fault (None when the whole
    directory is), ``problem`` what is wrong; nothing has been loaded when it is raised.
    """

    def __init__(self, checkpoint: str | os.PathLike, problem: str,
                 file: str | os.PathLike | None = None,
                 advice: str = CHECKPOINT_ADVICE) -> None:
        self.checkpoint = os.fspath(checkpoint)
        self.file = None if file is None else os.fspath(file)
        self.problem = problem if file is None else f"{os.fspath(file)}: {problem}"
        where = f"checkpoint {self.checkpoint!r}"
        if self.file is not None:
            where += f", file {self.file!r}"
        super().__init__(f"hf_shampoo: {where}: {problem}; {advice}")
