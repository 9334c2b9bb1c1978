"""hf_shampoo: Distributed Shampoo as a first-class optimizer in the Hugging Face stack.

``DistributedShampoo`` is the optimizer (SPEC §7 keywords); ``ShampooNumericalError`` is
raised when a factor matrix becomes non-finite or its eigendecomposition keeps failing.
"""

from .optimizer import DistributedShampoo
from .stack import ShampooNumericalError

__all__ = ["DistributedShampoo", "ShampooNumericalError"]
__version__ = "0.1.0"
