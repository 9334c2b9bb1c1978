"""hf_shampoo: Distributed Shampoo as a first-class optimizer in the Hugging Face stack.

``DistributedShampoo`` is the optimizer (docs/keywords.md); ``make_optimizer(model,
preset=...)`` builds it with per-module rules (``preset="muon"``: Muon on hidden matrices,
Adam elsewhere) and ``describe(optimizer)`` shows what each parameter got;
``ShampooNumericalError`` is raised when a gradient or a factor matrix is not finite or an
eigendecomposition keeps failing; ``CheckpointError`` when a checkpoint is missing, cut short
or damaged (which checkpoint, which file, what to do); both live in ``errors.py``.
Importing the package registers the optimizer with transformers
(``TrainingArguments(optim="distributed_shampoo")`` and ``optim="distributed_muon"``) and
timm (``opt="shampoo"``) as soon as those libraries load, without importing either itself.
torch is the only requirement; an integration used without its library raises an
``ImportError`` naming the extra to install (``optional.py``). ``__version__`` is the
release's version.
"""

from .describe_table import describe
from .errors import CheckpointError, ShampooNumericalError
from .factory import make_optimizer
from .integrations.timm import register_on_import as _register_timm
from .integrations.transformers import register_on_import as _register_transformers
from .optimizer import DistributedShampoo

__all__ = ["CheckpointError", "DistributedShampoo", "ShampooNumericalError", "describe",
           "make_optimizer"]
__version__ = "0.2.0"  # the release; pyproject.toml's version is the same (tests/test_packaging.py)

_register_timm()  # timm: opt="shampoo" / "soap" as soon as timm.optim is imported
_register_transformers()  # transformers: optim="distributed_shampoo" once it is imported
