"""The benchmark scripts, a package so that each runs from the repository root as
``python -m benchmarks.<name>`` and imports the shared modules without path edits:
``common`` (models' shapes, timing, options, tables, simulated ranks), ``tasks`` (the
small training tasks), ``configs`` (the reference optimizer configurations), ``harness``
(the one training loop).
"""
