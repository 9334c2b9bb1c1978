"""The kernels a steady step dispatches do not grow with the model's depth under
``stacking="fused"``: same-shape blocks share one stack, so each operation is one call
whatever the number of layers (docs/performance.md#stacking).

A ``TorchDispatchMode`` counts the non-view ATen operators of one steady step (past the
first refresh, none due) of GPT-2's layer shapes with 2 and 6 layers, for Shampoo, SOAP and
Muon. On a GPU each is a kernel launch; the count is the CPU proxy for launch overhead.
Under the default ``stacking="balanced"`` the count grows with depth until each kind holds
8 blocks (the test checks that too, so that the fused equality is not a property of any
cut).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.common import OperatorCount
from hf_shampoo import DistributedShampoo, make_optimizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.unit

F = 1000  # one refresh at step F, then steady steps


def _gpt2(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=64, n_head=2, vocab_size=256,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _steady_step_operators(kind: str, layers: int, stacking: str) -> int:
    model = _gpt2(layers)
    schedule = dict(lr=1e-3, precondition_frequency=F, start_preconditioning_step=F,
                    distributed="none", stacking=stacking)
    if kind == "muon":
        optimizer = make_optimizer(model, preset="muon", refresh_schedule="all", **schedule)
    elif kind == "soap":
        optimizer = DistributedShampoo(model.parameters(), preconditioner="eigenvalue_corrected",
                                       epsilon=1e-8, **schedule)
    else:
        optimizer = DistributedShampoo(model.parameters(), grafting="adam", epsilon=1e-12,
                                       **schedule)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.randn_like(p) * 1e-2 for p in params]

    def step() -> None:
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()

    step()  # lays out and allocates
    for group in optimizer.param_groups:
        group["step"] = F - 1  # the next step refreshes; the ones after are steady
    step()
    step()
    with OperatorCount() as count:
        step()
    return count.operators


@pytest.mark.parametrize("kind", ["shampoo", "soap", "muon"])
def test_fused_steady_step_dispatches_the_same_kernels_at_any_depth(kind):
    shallow = _steady_step_operators(kind, 2, "fused")
    deep = _steady_step_operators(kind, 6, "fused")
    assert shallow == deep, (kind, shallow, deep)


def test_balanced_stacks_grow_with_depth_below_eight_blocks_a_kind():
    # the contrast: the default cut gives each of these small kinds one stack per block
    assert _steady_step_operators("shampoo", 6, "balanced") > \
        _steady_step_operators("shampoo", 2, "balanced")
