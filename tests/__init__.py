"""The test suite (docs/design.md §13). ``HF_SHAMPOO_BATCH_VARIANT=1`` runs a whole process,
spawned ranks included, with products whose rounding depends on the call
(``tests/batch_variant.py``)."""

from tests.batch_variant import install_from_env

install_from_env()
