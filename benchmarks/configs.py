"""The reference optimizer configurations of the training benchmarks, in one place.

``ablation.py``, ``convergence.py`` and ``quantization_accuracy.py`` train with these and
derive their variants from them (``dict(SHAMPOO, quantization="4bit")``), so that a change
of the reference is a change here. The values are those the recorded results were measured
with (docs/benchmarks/convergence.md, docs/benchmarks/memory.md):

- ``SHAMPOO``: Adam grafting, ε 1e-12, betas (0.9, 0.999), weight decay 1e-4, blocks of
  128, a refresh every 10 steps;
- ``SOAP``: eigenvalue-corrected Shampoo (no grafting), ε 1e-8, otherwise as ``SHAMPOO``;
- ``ADAMW``: torch.optim.AdamW's keywords in the same benchmarks (the baseline).

The step-time benchmarks (step_time.py, ab_step_time.py, compile_step_time.py,
end_to_end.py, ...) time steady or refresh steps of configurations chosen for what they
time (blocks of 1024, no refresh in the timed steps) and keep those next to their timing.
"""

from __future__ import annotations

ADAMW = dict(betas=(0.9, 0.999), weight_decay=1e-4)
SHAMPOO = dict(betas=(0.9, 0.999), epsilon=1e-12, grafting="adam", grafting_beta2=0.999,
               grafting_epsilon=1e-8, weight_decay=1e-4, max_preconditioner_dim=128,
               precondition_frequency=10)
SOAP = dict(betas=(0.9, 0.999), epsilon=1e-8, preconditioner="eigenvalue_corrected",
            weight_decay=1e-4, max_preconditioner_dim=128, precondition_frequency=10)
